#!/usr/bin/env python3
"""Does it learn? Three peers train SwAV on the exported digits for the same wall-clock budget in each mode, then
the frozen trunks are evaluated by kNN on the held-out split. Not a test: a benchmark that prints a table.

    python benchmarks/bench_learning.py --minutes 4 --json benchmarks/results/learning.json

Modes: ``random_init`` (the untrained trunk), ``isolated`` (3 peers, no averaging), ``old`` (3 peers averaging
with hivemind's TrainingAverager driven the old way), ``improved`` (3 peers with this example's DecentralizedSGD).
Per mode: mean kNN top-1 accuracy of the peers' trunks, and the mean pairwise L2 distance between their weights.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from statistics import mean

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from demo import markdown_table  # noqa: E402
from local_swarm import LocalPeer, start_swarm, stop_all  # noqa: E402
from run_eval import load_trunk_state, resolve_checkpoint  # noqa: E402

MODES = ("random_init", "isolated", "old", "improved")
MODE_FLAGS = {"isolated": ["--isolated"], "old": ["--averager", "old"], "improved": []}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_path", type=Path, default=REPO / "data/digits", help="exported digits (train/ val/)")
    parser.add_argument("--minutes", type=float, default=4.0, help="wall-clock training budget of each mode")
    parser.add_argument("--peers", type=int, default=3, help="peers per mode")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of the LR schedule (a peer stops early if done)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/out/learning", help="checkpoints and logs")
    parser.add_argument("--json", type=Path, default=None, help="write {'runs': [...]} here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here")
    return parser


def trunk_weights(checkpoint: Path) -> list[torch.Tensor]:
    return [tensor.double() for _, tensor in sorted(load_trunk_state(checkpoint).items()) if tensor.is_floating_point()]


def mean_pairwise_distance(checkpoints: list[Path]) -> float:
    weights = [trunk_weights(path) for path in checkpoints]
    distances = [math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True)))
                 for a, b in itertools.combinations(weights, 2)]
    return mean(distances)


def train_swarm(mode: str, args: argparse.Namespace) -> list[LocalPeer]:
    """Three peers of one mode, each from its own seed, for the same wall-clock budget (or until done)."""
    out = args.out / mode
    peers = [LocalPeer(f"peer{index}", out) for index in range(args.peers)]
    flags = ["--run_id", f"learn{mode}", "--target_group_size", str(args.peers), "--min_matchmaking_time", "3",
             "--averaging_timeout", "30", "--next_chunk_timeout", "5", "--load_state_timeout", "0",
             *MODE_FLAGS[mode]]
    overrides = [f"config.OPTIMIZER.num_epochs={args.epochs}", "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=20",
                 "config.CHECKPOINT.OVERWRITE_EXISTING=True", "config.LOG_FREQUENCY=10"]
    seed = lambda peer: [f"config.SEED_VALUE={peers.index(peer)}"]  # noqa: E731
    try:
        if mode == "isolated":  # no swarm, so no join line: each peer on its own
            for peer in peers:
                peer.start(args.data_path, [], flags, overrides + seed(peer))
        else:
            start_swarm(peers, args.data_path, flags, overrides, per_peer_overrides=seed)
        deadline = time.monotonic() + args.minutes * 60.0
        while time.monotonic() < deadline and any(peer.is_running() for peer in peers):
            time.sleep(2.0)
    finally:
        stop_all(peers)
    return peers


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    from run_eval import knn_accuracy

    if mode == "random_init":
        return {"mode": mode, "accuracy": knn_accuracy(None, args.data_path), "peer_distance": None,
                "steps_mean": 0, "rounds_mean": 0}
    peers = train_swarm(mode, args)
    checkpoints = [resolve_checkpoint(peer.checkpoint_dir) for peer in peers]  # the final one if training ended
    accuracies = [knn_accuracy(path, args.data_path) for path in checkpoints]
    return {
        "mode": mode,
        "accuracy": round(mean(accuracies), 4),
        "accuracy_per_peer": [round(a, 4) for a in accuracies],
        "peer_distance": round(mean_pairwise_distance(checkpoints), 4),
        "steps_mean": round(mean(peer.last_step() for peer in peers), 1),
        "rounds_mean": round(mean(len(peer.applied_rounds()) for peer in peers), 1),
    }


def markdown(runs: list[dict]) -> str:
    return markdown_table([
        {"mode": run["mode"], "kNN accuracy": f"{run['accuracy']:.4f}",
         "peer distance": "—" if run["peer_distance"] is None else f"{run['peer_distance']:.3f}",
         "steps per peer": run["steps_mean"], "rounds per peer": run["rounds_mean"]}
        for run in runs
    ])  # fmt: skip


def main() -> int:
    args = build_parser().parse_args()
    runs = []
    for mode in args.modes:
        started = time.monotonic()
        runs.append(run_mode(mode, args))
        print(f"{mode}: {runs[-1]} ({time.monotonic() - started:.0f} s)", flush=True)
    table = markdown(runs)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"minutes_per_mode": args.minutes, "peers": args.peers, "runs": runs},
                                        indent=2))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
