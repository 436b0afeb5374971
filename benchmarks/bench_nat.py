"""NAT benchmark: which flags let a box behind a home/office router average and serve its state, through a real NAT.

Each scenario x mode runs tests/nat_scenario.py in a fresh user + network namespace (tests/nat_testbed.py: a public
bridge, one router namespace with masquerading NAT and a stateful firewall per NATed box). Scenarios: ``a`` two public
boxes + one NATed, ``b`` one public box + two NATed (each behind its own router). Modes, passed by the NATed boxes:
``public`` (the same boxes all public: the baseline), ``none`` (no flag), ``client_mode``, ``auto_relay``
(``--use_auto_relay``) and ``auto_relay_private`` (``--use_auto_relay --force_reachability private``, and the public
boxes ``--force_reachability public``: libp2p's AutoNAT never dials private addresses back, so on these addresses a
NATed box never finds itself private, nor a public box public, which its relay service waits for).

``python -m benchmarks.bench_nat`` writes benchmarks/results/nat.{md,json} (needs unshare, nsenter, ip and iptables).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, git_state, parse_with_quick, write_json, write_text
from tests.nat_testbed import run_orchestrator

SCENARIO = REPO / "tests" / "nat_scenario.py"

MODES = ("public", "none", "client_mode", "auto_relay", "auto_relay_private")


def run_one(scenario: str, mode: str, out: Path, measure_s: float) -> dict:
    """One scenario x mode in its own namespace; its summary.json (with an "error" if the run failed)."""
    flags = ["--force_private"] if mode == "auto_relay_private" else []
    command = ["unshare", "-rn", sys.executable, str(SCENARIO), scenario, mode.replace("_private", ""), str(out)]
    command += ["--measure_s", str(measure_s), "--join", *flags]
    t0 = time.monotonic()
    result = run_orchestrator(command, timeout=900)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    summary.update(mode=mode, wall_s=time.monotonic() - t0)
    if result.returncode != 0:
        summary["error"] = result.stderr[-2000:]
    return summary


def row(summary: dict) -> dict:
    """The table's columns from one summary."""
    boxes = summary.get("boxes", {})
    layout_natted = [n for n, b in boxes.items() if b["natted"]] or (
        ["box2"] if summary["scenario"] == "a" else ["box1", "box2"]
    )
    joined = summary.get("joined", {})
    kinds = sorted({kind for n in layout_natted for kind in boxes.get(n, {}).get("connections", {}).values()})
    check = summary.get("nat_check", {})
    return {
        "scenario": summary["scenario"],
        "mode": summary["mode"],
        "nat_blocks_inbound": (
            not any(check["public_dials_natted"]) and all(check["natted_dials_public"]) if check else None
        ),
        "natted_rounds_applied": [boxes.get(n, {}).get("rounds_in_group_of_2_plus", 0) for n in layout_natted],
        "joiner_served_by": joined.get("donor"),
        "served_by_natted_box": joined.get("donor") in layout_natted,
        "rounds_per_min_per_box": (sum(b["rounds_per_min"] for b in boxes.values()) / len(boxes)) if boxes else 0.0,
        "connections": "/".join(kinds) or "-",
        "relay_address": (
            None
            if "maddrs_at_end" not in summary
            else any("/p2p-circuit" in a for n in layout_natted for a in summary["maddrs_at_end"].get(n) or [])
        ),
        "error": summary.get("error", ""),
    }


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# NAT scenarios (benchmarks/bench_nat.py)",
        "",
        f"commit {meta['commit']}{' (dirty)' if meta['dirty'] else ''}, {meta['date']}; every row a fresh namespace "
        f"test bed, {meta['measure_s']:g} s of averaging once every peer runs, on a 2-core machine shared with other "
        "work (rates are relative). Scenario a: 2 public boxes + 1 NATed; b: 1 public + 2 NATed (own routers). "
        "Mode: the NATed boxes' flags (public: the same boxes, all public).",
        "",
        "| scenario | mode | NAT blocks inbound | NATed boxes' rounds (group >= 2) | joiner served by "
        "(public boxes do not share) | rounds/min per box | NATed box's connections | NATed box has a relay address |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kind = "NATed" if r["mode"] != "public" else "would-be NATed"
        served = (
            f"{r['joiner_served_by']} ({kind if r['served_by_natted_box'] else 'public'})"
            if r["joiner_served_by"]
            else "nobody"
        )
        relay = {None: "? (not recorded)", True: "yes", False: "no"}[r["relay_address"]]
        relay = "-" if r["mode"] == "public" else relay
        blocks = "-" if r["nat_blocks_inbound"] is None else "yes" if r["nat_blocks_inbound"] else "NO"
        lines.append(
            f"| {r['scenario']} | {r['mode']} | {blocks} | {', '.join(map(str, r['natted_rounds_applied']))}"
            f" | {served} | {r['rounds_per_min_per_box']:.1f} | {r['connections']} | {relay} |"
            + (f" error: {r['error'][-200:]!r}" if r["error"] else "")
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenarios", nargs="+", default=["a", "b"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--measure_s", type=float, default=45.0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "nat")
    parser.add_argument("--runs_dir", type=Path, default=None, help="keep each run's folder here (default: a temp one)")
    args = parse_with_quick(parser, scenarios=["a"], modes=["public"], measure_s=20.0)
    git = git_state()
    meta = {"commit": git["commit"], "dirty": git["dirty"], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    meta["measure_s"] = args.measure_s
    summaries, rows = [], []
    with tempfile.TemporaryDirectory(prefix="bench_nat_") as tmp:
        runs_dir = args.runs_dir or Path(tmp)
        for scenario in args.scenarios:
            for mode in args.modes:
                summaries.append(run_one(scenario, mode, runs_dir / f"{scenario}_{mode}", args.measure_s))
                rows.append(row(summaries[-1]))
                print(json.dumps(rows[-1]), flush=True)
    write_json(args.out.with_suffix(".json"), {**meta, "rows": rows, "summaries": summaries})
    write_text(args.out.with_suffix(".md"), markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
