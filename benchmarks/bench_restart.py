#!/usr/bin/env python3
"""How soon a restarted box averages again: the README's three boxes, the first one killed and started again
(tests/test_swarm_training.py checks the outcome; this times it).

    python -m benchmarks.bench_restart --repeats 3 --json benchmarks/results/restart.json \
        --markdown benchmarks/results/restart.md

Three ``swav_tiny`` boxes train on the digits on 127.0.0.1: box0 as the README's first box (an identity file, a fixed
port, no --initial_peers), box1 and box2 joined through it. Once all three averaged, box0 gets SIGKILL (its process
only, as the OOM killer would: its DHT and p2p daemon must end by themselves and free the port) and is started again
``--down_for`` seconds later with the same command. Timed from that start: the first logged step and the first
applied round with a groupmate. Nobody dials box0: it must find the others through its address book.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from tempfile import mkdtemp

from benchmarks.common import (
    REPO,
    commit_label,
    fast_round_flags,
    markdown_table,
    parse_with_quick,
    write_json,
    write_text,
)
from vissl_swarm.address_book import KNOWN_PEERS_FILE, AddressBook
from vissl_swarm.local_swarm import LocalPeer, fixed_address, start_swarm, stop_all, wait_until

FLAGS = fast_round_flags("restart")
OVERRIDES = [
    "config.DATA.TRAIN.DATA_LIMIT=160",
    "config.OPTIMIZER.num_epochs=3000",
    "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=10",
    "config.LOG_FREQUENCY=5",
]


def averaged(peer: LocalPeer) -> bool:
    return any(record["group_size"] >= 2 for record in peer.applied_rounds())


def one_restart(data: Path, out: Path, down_for: float) -> dict:
    peers = [LocalPeer(f"box{index}", out) for index in range(3)]
    first_flags, _ = fixed_address(peers[0])
    try:
        start_swarm(peers, data, FLAGS, OVERRIDES, first_flags=first_flags)
        for peer in peers:
            wait_until(lambda peer=peer: averaged(peer), 300, f"a round on {peer.name}")
        book = peers[0].checkpoint_dir / KNOWN_PEERS_FILE
        wait_until(lambda: len(AddressBook(book)) >= 2, 120, "box1 and box2 in box0's address book")
        os.kill(peers[0].process.pid, signal.SIGKILL)  # the trainer only; its DHT and p2pd must end by themselves
        peers[0].process.wait()
        time.sleep(down_for)
        peers[0].start(data, [], [*FLAGS, *first_flags], OVERRIDES)
        started = peers[0].started_at
        first_step = wait_until(
            lambda: next((e["time"] for e in peers[0].progress() if e["time"] > started), None),
            300,
            "box0's first logged step after its restart",
        )
        first_round = wait_until(
            lambda: min(
                (r["t_end"] for r in peers[0].applied_rounds(since=started) if r["group_size"] >= 2), default=None
            ),
            300,
            "box0's first round with a groupmate after its restart",
        )
        back = "back in the swarm" in peers[0].log_text()
    finally:
        stop_all(peers)
    return {
        "first_step_s": round(first_step - started, 1),
        "first_round_s": round(first_round - started, 1),
        "dialed_known_peers": back,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_path", type=Path, default=REPO / "data" / "digits")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--down_for", type=float, default=5.0, help="seconds between the kill and the restart")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parse_with_quick(parser, repeats=1)
    out = Path(mkdtemp(prefix="bench_restart_"))
    runs = []
    for repeat in range(args.repeats):
        runs.append(one_restart(args.data_path, out / f"run{repeat}", args.down_for))
        print(f"run {repeat}: {runs[-1]}", flush=True)
    summary = {
        "commit": commit_label(),
        "repeats": args.repeats,
        "down_for_s": args.down_for,
        "runs": runs,
        "first_round_s_median": statistics.median(run["first_round_s"] for run in runs),
        "first_round_s_max": max(run["first_round_s"] for run in runs),
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
    }
    rows = [{"run": index, **run} for index, run in enumerate(runs)]
    table = markdown_table(rows)
    print(table)
    write_json(args.json, summary)
    write_text(
        args.markdown,
        f"# A restarted first box: seconds from its start to its first step and to its first round\n\n"
        f"`python -m benchmarks.bench_restart --repeats {args.repeats}` at commit {summary['commit']} (3 swav_tiny "
        f"boxes on 127.0.0.1, 2 cores; box0 killed with SIGKILL once all averaged, started again {args.down_for:g} s "
        f"later)\n\n{table}\n\nmedian to the first round: {summary['first_round_s_median']} s, max "
        f"{summary['first_round_s_max']} s",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
