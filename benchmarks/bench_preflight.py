#!/usr/bin/env python3
"""The pre-flight (``run_trainer.py --preflight``) of real swav_tiny boxes on loopback and on a shaped link.

    .venv/bin/python -m benchmarks.bench_preflight --json benchmarks/results/preflight.json \\
        --markdown benchmarks/results/preflight.md

Why: the pre-flight advises settings from what the links do; this runs it where the link is known. Regimes:
``loopback`` (every box on 127.0.0.1) and ``wan_<mbit>mbit`` (every box in a network namespace of its own behind a
veth link shaped to that rate each way with ``tc tbf``, ``benchmarks/netns.py``; the script re-executes itself
inside ``unshare -rn``, no root needed). Each box is a real ``run_trainer.py`` process, started as users start it,
with its own output. Also: the advice each box's numbers give for swav_resnet50's size at its measured link rate
(the size from ``benchmarks/results/traffic.json`` when it is there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import netns
from benchmarks.common import REPO, commit_label, parse_with_quick, write_json, write_text
from vissl_swarm import preflight
from vissl_swarm.local_swarm import LocalPeer, fixed_address, start_swarm_together, wait_until

RESNET50 = "swav_resnet50"
FLAGS = ["--run_id", "benchpf", "--load_state_timeout", "0"]  # the README's defaults otherwise
WAN_PORT = 31337


def resnet50_values() -> int:
    """Values swav_resnet50's averager sends per round (benchmarks/traffic.py's count)."""
    path = REPO / "benchmarks" / "results" / "traffic.json"
    if path.exists():
        for row in json.loads(path.read_text())["rows"]:
            if row["config"] == RESNET50:
                return int(row["values"])
    from benchmarks import traffic

    return traffic.averaged_values(RESNET50)["values"]


def wan_prefix(rank: int) -> list[str]:
    """The trainer in a network namespace of its own, started once its link (plugged in from outside) has its
    address: hivemind listens on it."""
    script = (
        f'ip link set lo up; while ! ip -4 addr show | grep -q "{netns.host_address(rank)}/"; do sleep 0.05; '
        'done; exec "$0" "$@"'
    )
    return ["unshare", "-n", "sh", "-c", script]


def start_wan(peers: list[LocalPeer], data: Path, flags: list[str], mbit: float) -> None:
    """Every box behind its own shaped link; the first one at a fixed address (identity and port), so all start
    together, as ``start_swarm_together`` does on loopback."""
    identity_flags, _ = fixed_address(peers[0])  # makes the identity file; its loopback port is not used here
    identity = Path(identity_flags[1])
    from hivemind.p2p import PeerID

    first = f"/ip4/{netns.host_address(0)}/tcp/{WAN_PORT}/p2p/{PeerID.from_identity(identity.read_bytes())}"
    for rank, peer in enumerate(peers):
        peer.prefix = wan_prefix(rank)
        own = ["--host_maddrs", f"/ip4/{netns.host_address(rank)}/tcp/{WAN_PORT if rank == 0 else 0}"]
        if rank == 0:
            peer.start(data, [], [*flags, "--identity_path", str(identity), *own], [])
        else:
            peer.start(data, [first], [*flags, *own], [])
        netns.wait_for_own_namespace(peer.process.pid, timeout=30)
        netns.plug_in(peer.process.pid, rank, mbit)


def run_regime(name: str, mbit: float | None, boxes: int, seconds: float, data: Path, out: Path) -> dict[str, Any]:
    peers = [LocalPeer(f"box{index}", out / name) for index in range(boxes)]
    flags = [*FLAGS, "--preflight", f"{seconds:g}"]
    started, load_before = time.time(), [round(x, 2) for x in os.getloadavg()]
    try:
        if mbit is None:
            start_swarm_together(peers, data, flags, [])
        else:
            start_wan(peers, data, flags, mbit)
        for peer in peers:
            wait_until(lambda peer=peer: not peer.is_running(), seconds + 600, f"{peer.name}'s pre-flight", poll=1.0)
    finally:
        for peer in peers:
            peer.stop()
        for rank in range(boxes):
            if mbit is not None:
                netns.unplug(rank)
    rows = []
    for peer in peers:
        reports = sorted(peer.checkpoint_dir.glob(f"{preflight.FOLDER}/*/{preflight.REPORT_FILE}"))
        log = peer.log_text()
        row: dict[str, Any] = {"box": peer.name, "exit_code": peer.process.returncode, "traceback": "Traceback" in log}
        if reports:
            document = json.loads(reports[-1].read_text())
            row.update(document)
            fields = {k: v for k, v in document["measured"].items() if k in preflight.Measured.__dataclass_fields__}
            measured = preflight.Measured(**fields | {"group_sizes": tuple(fields["group_sizes"])})
            current = preflight.Settings(**document["settings"])
            big = resnet50_values()
            row["advice_resnet50"] = [vars(a) for a in preflight.advise(measured, current, values=big)]
            if mbit is not None:  # the same at the link's own rate, which the small model's rounds do not reach
                at_link = preflight.advise(measured, current, values=big, link_mbit=mbit)
                row["advice_resnet50_at_link"] = [vars(a) for a in at_link]
            row["table"] = log[log.index("pre-flight of this box") :].split("(as JSON")[0].rstrip()
        rows.append(row)
    return {
        "regime": name,
        "mbit": mbit,
        "boxes": boxes,
        "seconds": seconds,
        "wall_s": round(time.time() - started),
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }


def advice_line(advice: list[dict]) -> str:
    return " ".join(f"{a['flag']} {a['value']}" for a in advice)


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"`python -m benchmarks.bench_preflight {' '.join(meta['argv'])}` at {meta['commit']} ({meta['started']}, "
        f"load before {meta['loadavg_before']}, {meta['cpus']} cores); {meta['resnet50_values']:,} values for "
        f"{RESNET50}.",
        "",
        "| link (load before, after) | box | exit | rounds applied / failed / no group | groups | AllReduce s "
        "median / max | sent per round | link rate (bytes / AllReduce s) | staleness median / max | steps per "
        "round | s per step | advice | advice for swav_resnet50's size at the measured rate | the same at the "
        "link's rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for row in result["rows"]:
            m = row.get("measured")
            if m is None:
                lines.append(f"| {result['regime']} | {row['box']} | {row['exit_code']} | no report ||||||||||")
                continue
            sizes = ", ".join(f"{size} x{m['group_sizes'].count(size)}" for size in sorted(set(m["group_sizes"])))
            at_link = f"`{advice_line(row['advice_resnet50_at_link'])}`" if "advice_resnet50_at_link" in row else "-"
            lines.append(
                f"| {result['regime']} ({result['loadavg_before'][0]:.0f}, {result['loadavg_after'][0]:.0f}) | "
                f"{row['box']} | {row['exit_code']} | {m['rounds_applied']} / "
                f"{m['rounds_failed']} / {m['rounds_no_group']} | {sizes} | {m['allreduce_s'] or 0:.2f} / "
                f"{m['allreduce_max_s'] or 0:.2f} | {(m['bytes_per_round'] or 0) / 1e3:.1f} kB | "
                f"{m['link_mbit'] or 0:.2f} Mbit/s | {m['staleness_steps'] or 0:.1f} / {m['staleness_max_steps']} | "
                f"{m['steps_per_round'] or 0:.1f} | {m['step_s']:.3f} | `{advice_line(row['advice'])}` | "
                f"`{advice_line(row['advice_resnet50'])}` | {at_link} |"
            )
    lines.append("")
    for result in results:
        for row in result["rows"]:
            if "advice" in row:
                lines.append(
                    f"{result['regime']} {row['box']}, reasons: "
                    + "; ".join(f"`{a['flag']} {a['value']}`: {a['reason']}" for a in row["advice"])
                )
                lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="--preflight SECONDS of each box")
    parser.add_argument("--boxes", type=int, default=2)
    parser.add_argument("--mbit", type=float, default=100.0, help="the shaped link's rate, each way")
    parser.add_argument("--regimes", nargs="+", choices=["loopback", "wan"], default=["loopback", "wan"])
    parser.add_argument("--data_path", type=Path, default=REPO / "data" / "digits")
    parser.add_argument("--out", type=Path, default=None, help="the boxes' folders (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parse_with_quick(parser, sys.argv[1:] if argv is None else argv, seconds=20.0, regimes=["wan"])
    if args.seconds <= 0 or args.boxes < 2 or args.mbit <= 0:
        parser.error("--seconds and --mbit must be positive, --boxes at least 2")
    if not (args.data_path / "train").is_dir():
        parser.error(f"{args.data_path}/train is missing: make data (scripts/export_digits.py)")
    if not netns.inside():
        meta_argv = sys.argv[1:] if argv is None else argv
        os.environ["BENCH_LOADAVG_BEFORE"] = json.dumps([round(x, 2) for x in os.getloadavg()])
        os.environ["BENCH_COMMIT"] = commit_label()  # git may not read the repository inside the user namespace
        netns.reexec_inside(["-m", "benchmarks.bench_preflight", *meta_argv])
    netns.create_bridge()
    meta = {
        "argv": sys.argv[1:] if argv is None else argv,
        "commit": os.environ.get("BENCH_COMMIT", "?"),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(),
        "loadavg_before": json.loads(os.environ.get("BENCH_LOADAVG_BEFORE", "null")),
        "resnet50_values": resnet50_values(),
    }
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_preflight-"))
    results = []
    for regime in args.regimes:
        mbit = None if regime == "loopback" else args.mbit
        name = "loopback" if mbit is None else f"wan_{mbit:g}mbit"
        print(f"[bench_preflight] {name}: {args.boxes} boxes, --preflight {args.seconds:g}", flush=True)
        results.append(run_regime(name, mbit, args.boxes, args.seconds, args.data_path.resolve(), out))
    meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    meta["out"] = str(out)
    text = markdown(results, meta)
    print(text)
    write_json(args.json, {"meta": meta, "results": results})
    write_text(args.markdown, text)
    failed = [row["box"] for result in results for row in result["rows"] if row["exit_code"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
