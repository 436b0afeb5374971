"""A DecentralizedSGD peer for the NAT scenarios (tests/nat_scenario.py), run inside a box's namespace.

It joins through ``swarm.start_dht`` with the same SwarmSettings as run_trainer.py (``--client_mode``,
``--use_auto_relay``, ``--force_reachability``), so the scenarios test the flags users pass. A trainer peer trains
a tiny model (a local step adds a small constant to the weights) and writes into --out: ``peer.json`` (peer id,
visible multiaddrs), ``rounds.jsonl`` (its round records), ``connections.json`` (every 2 s: each connected peer's
connection addresses from p2pd, a ``/p2p-circuit`` one means relayed) and ``maddrs.json`` (our visible multiaddrs now:
a relay's ``/p2p-circuit`` one appears once auto relay reserved a slot). A joiner (--join) downloads the swarm's state
once (``load_state_from_peers``), writes ``joined.json`` (which peer served it, or null) and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsgd_swarm import FAST, make_model  # noqa: E402

from decentralized_sgd import DecentralizedSGD  # noqa: E402
from vissl_swarm.swarm import SwarmSettings, start_dht  # noqa: E402

MODES = ("public", "none", "client_mode", "auto_relay")  # public: a box with a public address, no flag


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", required=True, help="the box's own address (private behind NAT)")
    parser.add_argument("--port", type=int, default=0, help="TCP port to listen on (0: any)")
    parser.add_argument("--identity_path", default="", help="private key file: a peer id known in advance")
    parser.add_argument("--initial_peers", nargs="*", default=[])
    parser.add_argument("--mode", choices=MODES, default="public")
    parser.add_argument("--force_reachability", default="", choices=["", "public", "private"])
    parser.add_argument("--value", type=float, default=0.0, help="initial value of every weight and float buffer")
    parser.add_argument("--no_state_sharing", action="store_true", help="never serve our state to joiners")
    parser.add_argument("--join", action="store_true", help="download the swarm's state once, then exit")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def settings(args: argparse.Namespace) -> SwarmSettings:
    return SwarmSettings(
        run_id="nat",
        initial_peers=args.initial_peers,
        host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"],
        client_mode=args.mode == "client_mode",
        use_auto_relay=args.mode == "auto_relay",
        identity_path=args.identity_path,
        force_reachability=args.force_reachability,
        join_timeout=240.0,  # generous: every peer starts at once, the first one too
    )


def write_atomically(path: Path, content: dict) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(content))
    path.with_suffix(".tmp").replace(path)


async def _connections(_dht, node) -> dict[str, list[str]]:
    return {str(info.peer_id): [str(a) for a in info.addrs] for info in await node.p2p.list_peers()}


def write_connections(dht, path: Path) -> None:
    """Every 2 s: our p2pd's open connections (peer id -> remote addresses) and our visible multiaddrs."""
    while True:
        try:
            connections = dht.run_coroutine(_connections, return_future=True).result(timeout=10)
            write_atomically(path, connections)
            write_atomically(path.with_name("maddrs.json"), {"maddrs": [str(a) for a in dht.get_visible_maddrs()]})
        except Exception as error:  # a busy DHT: try again next time
            print(f"list_peers failed: {error!r}", file=sys.stderr)
        time.sleep(2.0)


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dht = start_dht(settings(args))
    model = make_model(args.value)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    peer = DecentralizedSGD(
        optimizer,
        dht,
        prefix="nat",
        model=model,
        records_path=str(args.out / "rounds.jsonl"),
        get_extra_state=lambda: {"donor": args.name},
        **FAST,
    )
    if args.no_state_sharing:
        peer.averager.allow_state_sharing = False
    info = {"peer_id": str(dht.peer_id), "name": args.name, "maddrs": [str(a) for a in dht.get_visible_maddrs()]}
    write_atomically(args.out / "peer.json", info)  # the orchestrator reads it as soon as it exists
    threading.Thread(target=write_connections, args=(dht, args.out / "connections.json"), daemon=True).start()
    if args.join:
        t0 = time.monotonic()
        extra = peer.load_state_from_peers(timeout=30)
        joined = {"donor": None if extra is None else extra.get("donor"), "seconds": time.monotonic() - t0}
        write_atomically(args.out / "joined.json", joined)
        peer.shutdown()
        dht.shutdown()
        return
    while True:
        with peer.lock, torch.no_grad():
            model[0].weight.add_(1e-3)  # a local step: the delta rule keeps it
        peer.on_step_end()
        time.sleep(0.01)


if __name__ == "__main__":
    main()
