#!/usr/bin/env python3
"""A local swarm: 3 peers on 127.0.0.1 train SwAV (small CPU config) on the exported digits for a few minutes.

    python demo.py --data_path data/digits --minutes 3

The first peer prints the join line; the others join with it, exactly as boxes on a network would. Live
progress of every peer is shown; at the end, a summary table and a PNG with loss curves and the averaging
timeline of all peers (in --out).

Every demo is a new one: it empties --out first (a folder an earlier demo made, or an empty one: anything else is
refused, so a mistyped --out never loses files). A folder per run would keep the old results, but each run's
checkpoints take tens of MB, and a rerun in the same folder would resume the finished checkpoints instead of
training. The minutes count from the moment every peer has logged its first step.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from statistics import mean

from benchmarks.common import OUTCOME_COLORS, markdown_table, pyplot, round_outcome, save_figure
from vissl_swarm.local_swarm import REPO, LocalPeer, start_swarm, stop_all, wait_until

MARKER = ".made_by_demo"  # in --out: the folder is ours to empty
START_TIMEOUT_S = 300.0  # from launching the first peer until every peer trains (VISSL's start is slow on 2 cores)


class DemoError(RuntimeError):
    """The demo could not run or its peers did not train; the message says what to look at."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_path", type=Path, default=REPO / "data/digits", help="exported digits (train/ val/)")
    parser.add_argument(
        "--minutes",
        type=float,
        default=3.0,
        help="how long the swarm trains, from the moment every peer has logged its first step",
    )
    parser.add_argument("--peers", type=int, default=3, help="number of peers on this machine")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "demo_out",
        help="checkpoints, logs, table and plot; emptied at start (only if a demo made it, or empty)",
    )
    parser.add_argument("--min_matchmaking_time", type=float, default=3.0, help="seconds to gather each group")
    return parser


def show_progress(peers: list[LocalPeer], shown: list[int]) -> None:
    for index, peer in enumerate(peers):
        entries = peer.progress()
        for entry in entries[shown[index] :]:
            line = (
                f"[{peer.name}] step {entry['step']:4d}  loss {entry['loss']:.4f}  "
                f"{entry['samples_per_s']:6.1f} samples/s  swarm at {entry.get('where', 0):6.1%}  "
                f"rounds ok {entry.get('rounds_ok', 0)}"
            )
            if entry.get("group_size"):
                line += f"  last group {entry['group_size']}  staleness {entry['staleness_steps']}"
            print(line, flush=True)
        shown[index] = len(entries)


def summarize(peers: list[LocalPeer]) -> list[dict]:
    rows = []
    for peer in peers:
        progress, rounds = peer.progress(), peer.applied_rounds()
        rows.append(
            {
                "peer": peer.name,
                "steps": progress[-1]["step"] if progress else 0,
                "own_samples": progress[-1].get("own_samples") if progress else None,
                "swarm_samples": progress[-1].get("swarm_samples") if progress else None,
                "final_loss": round(progress[-1]["loss"], 4) if progress else None,
                "rounds": len(rounds),
                "mean_group_size": round(mean(r["group_size"] for r in rounds), 2) if rounds else None,
                "mean_staleness": round(mean(r["staleness_steps"] for r in rounds), 2) if rounds else None,
            }
        )
    return rows


def plot(peers: list[LocalPeer], path: Path) -> None:
    from matplotlib.patches import Patch

    figure, (loss_axis, timeline_axis) = pyplot().subplots(2, 1, figsize=(10, 7))
    t0 = min((peer.started_at for peer in peers), default=0.0)
    for index, peer in enumerate(peers):
        progress = peer.progress()
        loss_axis.plot([e["step"] for e in progress], [e["loss"] for e in progress], label=peer.name)
        for record in peer.rounds():
            start, end = record.get("t_start"), record.get("t_end")
            if start is None or end is None:
                continue
            color = OUTCOME_COLORS[round_outcome(record)]
            timeline_axis.barh(index, end - start, left=start - t0, height=0.6, color=color, alpha=0.5)
    loss_axis.set(xlabel="step", ylabel="SwAV loss", title="loss of each peer")
    loss_axis.legend()
    timeline_axis.set(
        xlabel="seconds",
        ylabel="peer",
        title="averaging rounds of each peer",
        yticks=range(len(peers)),
        yticklabels=[peer.name for peer in peers],
    )
    legend = [Patch(color=color, alpha=0.5, label=outcome) for outcome, color in OUTCOME_COLORS.items()]
    timeline_axis.legend(handles=legend, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(legend), fontsize=8)
    save_figure(figure, path, dpi=100)


def empty_out_dir(out: Path) -> None:
    """Start from an empty --out; refuse a non-empty folder that no demo made (it may hold the user's files)."""
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out} is a file; pass a folder")
    if out.is_dir() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise DemoError(f"--out {out} is not empty and no demo made it; pass a new or empty folder")
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("demo.py empties this folder at the start of every demo\n")


def raise_if_a_peer_failed(peers: list[LocalPeer]) -> None:
    """DemoError naming the first peer that exited with an error (exit code 0 is a peer that ended when the swarm
    had trained on the recipe's epochs: on a fast machine that comes before --minutes are up)."""
    for peer in peers:
        if not peer.is_running() and peer.process is not None and peer.process.returncode != 0:
            raise DemoError(f"{peer.exit_message()} before the end of the demo")


def any_training(peers: list[LocalPeer]) -> bool:
    return any(peer.is_running() for peer in peers)


def run_swarm(peers: list[LocalPeer], args: argparse.Namespace) -> None:
    """Start the peers, wait until each trains, let them train for --minutes while showing their progress."""
    flags = [
        "--run_id",
        "demo",
        "--target_group_size",
        str(args.peers),
        "--min_matchmaking_time",
        str(args.min_matchmaking_time),
        "--averaging_timeout",
        "30",
        "--next_chunk_timeout",
        "5",
    ]
    # 40 epochs of the digits for the whole swarm (the swarm-wide schedule): one peer alone would take 3,560 steps
    overrides = ["config.OPTIMIZER.num_epochs=40", "config.CHECKPOINT.OVERWRITE_EXISTING=True"]
    started = time.monotonic()
    addresses = start_swarm(
        peers,
        args.data_path,
        flags,
        overrides,
        per_peer_overrides=lambda peer: [f"config.SEED_VALUE={peers.index(peer)}"],
    )
    print(f"[peer0] join line: python run_trainer.py --config swav_tiny --initial_peers {' '.join(addresses)}")
    shown = [0] * len(peers)

    def all_training() -> bool:
        raise_if_a_peer_failed(peers)
        show_progress(peers, shown)
        return all(peer.progress() for peer in peers)

    wait_until(all_training, START_TIMEOUT_S - (time.monotonic() - started), "the first logged step of every peer")
    deadline = time.monotonic() + args.minutes * 60.0
    while time.monotonic() < deadline:
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        raise_if_a_peer_failed(peers)
        show_progress(peers, shown)
        if not any_training(peers):
            print(
                "the swarm trained on the recipe's epochs before the end of --minutes: every peer ended by itself",
                flush=True,
            )
            break


def warn_of_tracebacks(peers: list[LocalPeer]) -> None:
    """A traceback in a peer's log is a bug or an unhandled failure, even when training went on: say where."""
    for peer in peers:
        count = peer.log_text().count("Traceback (most recent call last)")
        if count:
            print(
                f"warning: {peer.name}'s log holds {count} traceback(s), though the peer trained on: "
                f"{peer.log_path} (please report it)",
                file=sys.stderr,
            )


def report(peers: list[LocalPeer], out: Path) -> list[dict]:
    """The table and the plot of this demo's peers (--out held nothing else), printed and written to --out."""
    rows = summarize(peers)
    table = markdown_table(rows)
    (out / "summary.md").write_text(table + "\n")
    plot(peers, out / "swarm.png")
    print("\n" + table)
    print(f"\nplot: {out / 'swarm.png'}; logs and checkpoints: {out}")
    return rows


def main() -> int:
    args = build_parser().parse_args()
    try:
        empty_out_dir(args.out)
    except DemoError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    peers = [LocalPeer(f"peer{index}", args.out) for index in range(args.peers)]
    failure = None
    try:
        run_swarm(peers, args)
    except (RuntimeError, TimeoutError) as error:  # DemoError; local_swarm's when peer0 exits before its join line
        failure = str(error)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the peers", flush=True)
    finally:
        stop_all(peers)
    rows = report(peers, args.out)
    warn_of_tracebacks(peers)
    problems = [
        f"{peer.name} did not train" + (f" (see {peer.log_path})" if peer.process else " (not started)")
        for peer, row in zip(peers, rows, strict=True)
        if row["steps"] == 0
    ] + ([failure] if failure else [])
    if problems:
        print(f"\nerror: the demo failed: {'; '.join(problems)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
