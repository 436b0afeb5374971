"""One NAT scenario, run inside a fresh user + network namespace (``unshare -rn``; tests/nat_testbed.py builds it).

Scenarios: ``a`` two public boxes + one behind NAT; ``b`` one public box + two each behind a router of its own.
Modes (what the NATed boxes pass): ``none`` (no flag), ``client_mode``, ``auto_relay`` (``--use_auto_relay``, with
``--force_reachability private`` when ``--force_private``); ``public``: the same boxes, all public (the baseline).

Steps: check the NAT (a public box cannot open a TCP connection to a NATed box, a NATed box can to a public one);
start one peer per box (tests/nat_peer.py, bootstrapped from the first public box); wait until every NATed box has
applied ``--until_rounds`` rounds in a group of >= 2, or ``--measure_s`` seconds passed; then, with ``--join``, a
fresh public box downloads the state while the public boxes do not share theirs (so only a NATed box can serve it).
Writes OUT/summary.json (see ``summarize``); exits non-zero only if the test bed itself failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import nat_testbed as tb  # noqa: E402

PEER = Path(__file__).resolve().parent / "nat_peer.py"
SCENARIOS = {"a": ("public", "public", "natted"), "b": ("public", "natted", "natted")}
PROBE_PORT = 7000
BOOTSTRAP_PORT = 31337


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("mode", choices=["public", "none", "client_mode", "auto_relay"])
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--force_private",
        action="store_true",
        help="auto_relay: NATed boxes --force_reachability private, public ones public",
    )
    parser.add_argument("--until_rounds", type=int, default=0, help="stop once every NATed box applied this many")
    parser.add_argument("--measure_s", type=float, default=60.0, help="at most this long after every peer started")
    parser.add_argument("--join", action="store_true", help="then check which box serves its state to a joiner")
    return parser.parse_args()


def public_in_layout(scenario: str) -> list[str]:
    """The boxes that are public in the scenario's NAT layout (the others are NATed, or would be)."""
    return [f"box{i}" for i, kind in enumerate(SCENARIOS[scenario]) if kind == "public"]


def bootstrap_identity(out: Path, box: tb.Box) -> tuple[list[str], list[str]]:
    """The first peer's multiaddr known before it starts (an identity file, a fixed port), so that every peer can
    start at once (on a busy 2-core machine one peer takes tens of seconds to start); and its extra flags."""
    from hivemind.p2p import P2P, PeerID

    (out / box.name).mkdir(parents=True, exist_ok=True)
    path = out / box.name / "identity.key"
    P2P.generate_identity(str(path))
    peer_id = PeerID.from_identity(path.read_bytes())
    return [f"/ip4/{box.address}/tcp/{BOOTSTRAP_PORT}/p2p/{peer_id}"], [
        "--identity_path",
        str(path),
        "--port",
        str(BOOTSTRAP_PORT),
    ]


def nat_check(bed: tb.NatTestbed) -> dict:
    """Through the routers: can a public box dial a NATed box's own address, can a NATed box dial out?"""
    public = [b for b in bed.boxes if not b.natted][0]
    result = {"public_dials_natted": [], "natted_dials_public": []}
    listener = tb.listen_once(public, PROBE_PORT)
    try:
        result["natted_dials_public"] = [tb.can_connect(b, public.address, PROBE_PORT) for b in bed.boxes if b.natted]
    finally:
        tb.stop(listener)
    for box in (b for b in bed.boxes if b.natted):
        listener = tb.listen_once(box, PROBE_PORT)
        try:
            result["public_dials_natted"].append(tb.can_connect(public, box.address, PROBE_PORT, timeout=2.0))
        finally:
            tb.stop(listener)
    return result


def start_peer(box: tb.Box, out: Path, args: argparse.Namespace, initial_peers: list[str], *extra: str):
    """tests/nat_peer.py on `box`. With --join, public boxes never share their state: a joiner's download then
    tells whether a NATed box can serve one (in the all-public baseline, the would-be NATed boxes serve)."""
    mode = args.mode if box.natted else "public"
    if args.join and box.name in public_in_layout(args.scenario):
        extra = (*extra, "--no_state_sharing")
    command = [
        sys.executable,
        str(PEER),
        "--name",
        box.name,
        "--host",
        box.address,
        "--mode",
        mode,
        "--out",
        str(out / box.name),
        "--initial_peers",
        *initial_peers,
        *extra,
    ]
    if mode == "auto_relay" and args.force_private:
        command += ["--force_reachability", "private"]
    if mode == "public" and args.mode == "auto_relay" and args.force_private:  # their relay service needs it
        command += ["--force_reachability", "public"]
    (out / box.name).mkdir(parents=True, exist_ok=True)
    log = open(out / box.name / "log.txt", "w")  # the process outlives this function
    return box.ns.popen(command, stdout=log, stderr=log)


def read_records(out: Path, name: str) -> list[dict]:
    path = out / name / "rounds.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def connection_kinds(out: Path, box: tb.Box, ids: dict[str, str]) -> dict[str, str]:
    """For a NATed box: each other box it is connected to -> direct / relayed (a /p2p-circuit address) / both."""
    kinds = {}
    for peer_id, addresses in read_json(out / box.name / "connections.json").items():
        if peer_id in ids and ids[peer_id] != box.name:
            relayed = ["/p2p-circuit" in a for a in addresses]
            kinds[ids[peer_id]] = "relayed" if all(relayed) else "direct" if not any(relayed) else "both"
    return kinds


def summarize(out: Path, bed: tb.NatTestbed, ids: dict[str, str], window: tuple[float, float]) -> dict:
    """Per box: applied rounds, those in a group of >= 2, those with a NATed box in the group; rounds/min per box
    over `window` (every peer running); for NATed boxes, how they are connected to the others."""
    natted_ids = {i for i, name in ids.items() if next(b for b in bed.boxes if b.name == name).natted}
    boxes = {}
    for box in bed.boxes:
        if box.name.startswith("joiner"):
            continue
        applied = [r for r in read_records(out, box.name) if r["applied"]]
        in_window = [r for r in applied if window[0] <= (r["t_end"] or 0) <= window[1]]
        boxes[box.name] = {
            "natted": box.natted,
            "rounds_applied": len(applied),
            "rounds_in_group_of_2_plus": sum((r["group_size"] or 0) >= 2 for r in applied),
            "rounds_with_a_natted_box": sum(bool(natted_ids & set(r["group"] or [])) for r in applied),
            "rounds_per_min": len(in_window) / max(window[1] - window[0], 1e-9) * 60,
            "connections": connection_kinds(out, box, ids) if box.natted else {},
        }
    return boxes


def join(out: Path, joiner: tb.Box, args: argparse.Namespace, bootstrap: list[str]) -> dict:
    """A fresh public peer downloads the swarm's state: {"donor": the box that served it or None, "seconds"}."""
    process = start_peer(joiner, out, args, bootstrap, "--join")
    try:
        return json.loads(tb.read_text_when_ready(out / joiner.name / "joined.json", process, 240))
    except RuntimeError as error:
        return {"donor": None, "error": str(error)}
    finally:
        tb.stop(process)


def main(args: argparse.Namespace) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tb.exit_on_sigterm()
    summary: dict = {"scenario": args.scenario, "mode": args.mode, "force_private": args.force_private}
    bed = tb.NatTestbed()
    peers = []
    try:
        for i, kind in enumerate(SCENARIOS[args.scenario]):
            if kind == "public" or args.mode == "public":
                bed.public_box(f"box{i}")
            else:
                bed.natted_box(f"box{i}")
        joiner = bed.public_box("joiner") if args.join else None
        summary["nat_check"] = nat_check(bed) if any(b.natted for b in bed.boxes) else {}
        boxes = [b for b in bed.boxes if b is not joiner]
        started = time.time()
        bootstrap, first = bootstrap_identity(out, boxes[0])  # all peers start at once: they retry joining
        peers.append(start_peer(boxes[0], out, args, [], *first))
        for i, box in enumerate(boxes[1:], start=1):
            peers.append(start_peer(box, out, args, bootstrap, "--value", str(2.0 * i)))
        infos = [
            json.loads(tb.read_text_when_ready(out / box.name / "peer.json", process, 180))
            for box, process in zip(boxes, peers, strict=True)
        ]
        ids = {info["peer_id"]: info["name"] for info in infos}
        summary["maddrs"] = {info["name"]: info["maddrs"] for info in infos}
        running = time.time()
        summary["seconds_to_start"] = running - started
        natted = [b.name for b in boxes if b.name not in public_in_layout(args.scenario)]  # or would-be NATed

        def done() -> bool:
            counts = summarize(out, bed, ids, (running, time.time()))
            return bool(args.until_rounds) and all(
                counts[n]["rounds_in_group_of_2_plus"] >= args.until_rounds for n in natted
            )

        while time.time() < running + args.measure_s and not done():
            assert all(p.poll() is None for p in peers), "a peer process died: see its log.txt"
            time.sleep(1.0)
        ended = time.time()
        summary["boxes"] = summarize(out, bed, ids, (running, ended))
        summary["maddrs_at_end"] = {box.name: read_json(out / box.name / "maddrs.json").get("maddrs") for box in boxes}
        summary["window_s"] = ended - running
        if joiner is not None:
            summary["joined"] = join(out, joiner, args, bootstrap)
    finally:
        for process in peers:
            tb.stop(process)
        bed.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(parse_args())
