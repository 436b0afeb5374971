"""A DecentralizedSGD peer in its own process, for fault-injection tests: the test kills, restarts or cuts it off.

It trains a tiny model (a local step adds a small constant to the weights, so every round has local steps to keep),
writes its peer id and its round records to files, and touches a marker file at the moment the test waits for:
``looking`` (its only round is in matchmaking, after one applied round) or ``applied`` (it just applied a round).
Without ``--initial_peers``, and with ``--identity_path``, a fixed port and ``--address_book``, it is a swarm's first
box as the README starts one (``swarm.start_dht`` with the settings run_trainer.py gives it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsgd_swarm import FAST, JOIN_TIMEOUT_S, make_model  # noqa: E402

from decentralized_sgd import DecentralizedSGD  # noqa: E402
from vissl_swarm.dht_rejoin import groupmates_listener  # noqa: E402
from vissl_swarm.swarm import SwarmSettings, start_dht  # noqa: E402


def command(out: Path, initial_peers: list[str], marker_when: str, *extra: str) -> list[str]:
    """The command line that runs this script (used by the fault tests and the network-cut scenario)."""
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        *(["--initial_peers", *initial_peers] if initial_peers else []),
        "--out",
        str(out),
        "--marker",
        str(out / "marker"),
        "--marker_when",
        marker_when,
        *extra,
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--initial_peers", nargs="+", default=[], help="none: the swarm's first box")
    parser.add_argument("--host_maddrs", nargs="+", default=["/ip4/127.0.0.1/tcp/0"])
    parser.add_argument("--identity_path", default="")
    parser.add_argument(
        "--address_book", default="", help="the box's known_peers.json (run_trainer.py's is in its checkpoint folder)"
    )
    parser.add_argument("--value", type=float, default=0.0, help="initial value of every weight and float buffer")
    parser.add_argument("--step_s", type=float, default=0.01)
    parser.add_argument("--marker", type=Path, default=None)
    parser.add_argument("--marker_when", choices=["looking", "applied"], default="looking")
    parser.add_argument("--out", type=Path, required=True, help="folder for peer_id.txt and rounds.jsonl")
    parser.add_argument("--load_state", action="store_true", help="download the swarm's state first (a restart)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # as a box starts it: it dials the initial peers again (hivemind's bootstrap pings once, and a busy first peer
    # missed that ping with two busy processes beside the suite), and keeps connected (the network-cut scenario)
    settings = SwarmSettings(
        host_maddrs=args.host_maddrs,
        initial_peers=args.initial_peers,
        join_timeout=JOIN_TIMEOUT_S,
        identity_path=args.identity_path,
        address_book=args.address_book,
    )
    dht = start_dht(settings, startup_timeout=60)
    model = make_model(args.value)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    records = str(args.out / "rounds.jsonl")
    peer = DecentralizedSGD(
        optimizer, dht, prefix="test", model=model, records_path=records, on_group=groupmates_listener(dht), **FAST
    )
    (args.out / "peer_id.txt").write_text(str(peer.peer_id))
    if args.load_state:
        peer.load_state_from_peers(timeout=20)
    applied = 0
    while True:
        with peer.lock, torch.no_grad():
            model[0].weight.add_(1e-3)  # a local step: the delta rule must keep it
        peer.on_step_end()
        if args.marker is not None and not args.marker.exists():
            rounds = peer.in_flight_rounds()
            looking = len(rounds) == 1 and rounds[0]["state"] == "LOOKING"
            newly_applied = peer.counters["rounds_applied"] > applied
            if (args.marker_when == "looking" and applied and looking) or (
                args.marker_when == "applied" and newly_applied
            ):
                args.marker.touch()
            applied = int(peer.counters["rounds_applied"])
        time.sleep(args.step_s)


if __name__ == "__main__":
    main()
