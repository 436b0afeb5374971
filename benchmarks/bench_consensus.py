#!/usr/bin/env python
"""How fast a larger swarm agrees: N DecentralizedSGD peers (default 16) of the test suite's swarm reach consensus.

Why: the slow-peer fixes were tuned on one slow peer among 5 (bench_averaging's straggler); a large swarm on a small
machine is slow everywhere, and there they must not ban node after node (benchmarks/results/consensus16.md). Each
mode runs ``tests/dsgd_swarm.py``'s swarm until every averaged value is within ``--tolerance`` of the swarm's mean.

    python -m benchmarks.bench_consensus [--peers 16] [--group 4] [--deadline 120] [--modes fixes no_slow_peer_fixes]
        [--tolerance 0.01] [--repeat 1] [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import commit_label, parse_with_quick, write_json, write_text
from tests.dsgd_swarm import Swarm, averaged_tensors, make_model

MODES = {"fixes": {}, "no_slow_peer_fixes": {"slow_peer_fixes": False}}  # DecentralizedSGD kwargs of each mode
PER_PEER = (
    "rounds_applied",
    "rounds_failed",
    "rounds_no_group",
    "slow_dht_node_bans",
    "slow_leader_timeouts",
    "slow_leader_requests_skipped",
    "starvation_episodes",
)


def spread(peers: list) -> float:
    """Largest distance of any peer's averaged value from the swarm's mean of that value."""
    stacked = torch.stack([torch.cat([t.detach().flatten() for t in averaged_tensors(p)]) for p in peers])
    return float((stacked - stacked.mean(dim=0)).abs().max())


def run_swarm(peers: int, group: int, deadline: float, tolerance: float, **kwargs: Any) -> dict[str, Any]:
    """One swarm, from fresh processes to teardown; the measurement starts when every trainer thread runs."""
    swarm = Swarm()
    try:
        t_setup = time.monotonic()
        members = [swarm.peer(make_model(float(i)), target_group_size=group, **kwargs) for i in range(peers)]
        setup_s = time.monotonic() - t_setup
        for peer in members:
            swarm.train(peer)
        started, consensus_s = time.monotonic(), None
        while time.monotonic() - started < deadline:
            if spread(members) <= tolerance:
                consensus_s = time.monotonic() - started
                break
            time.sleep(0.2)
        elapsed = time.monotonic() - started
        swarm.stop_training()
        counters = [dict(p.counters) for p in members]
        records = [list(p.records) for p in members]
        reasons = Counter(str(r.get("error"))[:80] for rs in records for r in rs if r.get("error"))
        final_spread = spread(members)
    finally:
        swarm.close()
    result: dict[str, Any] = dict(
        peers=peers,
        group=group,
        deadline_s=deadline,
        tolerance=tolerance,
        consensus_s=consensus_s,
        elapsed_s=round(elapsed, 2),
        setup_s=round(setup_s, 2),
        final_spread=final_spread,
        load_1min=os.getloadavg()[0],
    )
    for name in PER_PEER:
        values = [c.get(name, 0) for c in counters]
        result[name] = dict(min=min(values), median=statistics.median(values), max=max(values), total=sum(values))
    result["slow_dht_node_bans"]["peer0"] = counters[0].get("slow_dht_node_bans", 0)
    result["failure_reasons"] = dict(reasons.most_common(5))
    result["rounds_per_min"] = round(result["rounds_applied"]["median"] * 60 / elapsed, 2)
    result["rounds_ended"] = sum(len(rs) for rs in records)
    result["failed_share"] = result["rounds_failed"]["total"] / max(1, result["rounds_ended"])
    result["no_group_share"] = result["rounds_no_group"]["total"] / max(1, result["rounds_ended"])
    grouped = [r for rs in records for r in rs if r.get("group_size")]  # rounds that formed a group
    result["groups_formed"] = len(grouped)
    result["mean_group_size"] = statistics.mean(r["group_size"] for r in grouped) if grouped else None
    waits = [r["matchmaking_s"] for r in grouped if r.get("matchmaking_s") is not None]
    result["matchmaking_s_median"] = statistics.median(waits) if waits else None
    wall_start = time.time() - (time.monotonic() - started)  # records carry wall-clock times
    result["failures"] = [
        dict(
            peer=index,
            nth=nth,
            t_start_s=round(r["t_start"] - wall_start, 2),
            group_size=r.get("group_size"),
            error=str(r.get("error"))[:300],
        )
        for index, rs in enumerate(records)
        for nth, r in enumerate(rs)
        if r["state"] == "FAILED" and r.get("t_group_formed") is not None
    ]
    return result


def markdown(report: dict[str, Any]) -> str:
    def mmm(stat: dict) -> str:
        return f"{stat['min']:g} / {stat['median']:g} / {stat['max']:g} ({stat['total']:g})"

    def share(run: dict, counter: str) -> str:  # with run_swarm's failed_share / no_group_share
        fraction = run[counter.removeprefix("rounds_") + "_share"]
        return f"{run[counter]['total']:g} of {run['rounds_ended']} ({fraction:.1%})"

    def groups(run: dict) -> str:  # formed groups, every peer's (a group of 4 counts 4 times)
        size = run.get("mean_group_size")
        return f"{run.get('groups_formed', '—')} ({'—' if size is None else format(size, '.2f')})"

    lines = [
        f"# Consensus of {report['runs'][0]['peers']} peers (`python -m benchmarks.bench_consensus`)",
        "",
        f"commit `{report['commit']}`, {report['started']}, {os.cpu_count()} CPUs; per peer: min / median / "
        "max (swarm total)",
        "",
        "| mode | consensus s | rounds/min | applied | failed | failed share | no group | no group share | "
        "groups (mean size) | matchmaking s | DHT bans (peer 0) | leader time-outs | joins skipped | starved | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        consensus = "—" if run["consensus_s"] is None else f"{run['consensus_s']:.1f}"
        lines.append(
            f"| {run['mode']} | {consensus} (of {run['deadline_s']:g}) | {run['rounds_per_min']} | "
            f"{mmm(run['rounds_applied'])} | {mmm(run['rounds_failed'])} | {share(run, 'rounds_failed')} | "
            f"{mmm(run['rounds_no_group'])} | {share(run, 'rounds_no_group')} | {groups(run)} | "
            f"{'—' if run.get('matchmaking_s_median') is None else format(run['matchmaking_s_median'], '.2f')} | "
            f"{run['slow_dht_node_bans']['total']:g} ({run['slow_dht_node_bans']['peer0']:g}) | "
            f"{mmm(run['slow_leader_timeouts'])} | {mmm(run['slow_leader_requests_skipped'])} | "
            f"{run['starvation_episodes']['total']:g} | {run['load_1min']:.1f} |"
        )
    failures = [failure for run in report["runs"] for failure in run.get("failures", [])]
    if failures:
        firsts = sum(failure["nth"] == 0 for failure in failures)
        lines += [
            "",
            f"Rounds counted as failed (a group formed, then the AllReduce failed): {len(failures)}, of them {firsts} "
            "a peer's first round. Errors:",
            "",
            *(f"- {count} × `{error}`" for error, count in Counter(f["error"][:160] for f in failures).most_common(5)),
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="target_group_size")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds to wait for consensus")
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--repeat", type=int, default=1, help="runs of each mode")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parse_with_quick(parser, peers=4, group=2, deadline=60.0)
    report: dict[str, Any] = dict(commit=commit_label(), started=time.strftime("%F %T %Z"), argv=sys.argv[1:], runs=[])
    for mode in args.modes:
        for _ in range(args.repeat):
            run = run_swarm(args.peers, args.group, args.deadline, args.tolerance, **MODES[mode])
            report["runs"].append({"mode": mode, **run})
            print(json.dumps(report["runs"][-1]), flush=True)
    write_json(args.json, report)
    write_text(args.markdown, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
