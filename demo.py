#!/usr/bin/env python3
"""A few minutes of SwAV on the exported digits with the small CPU config, showing live progress.

    python demo.py --data_path data/digits --minutes 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_path", type=Path, default=REPO / "data/digits", help="exported digits (train/ val/)")
    parser.add_argument("--minutes", type=float, default=3.0, help="wall-clock budget of the demo")
    parser.add_argument("--out", type=Path, default=REPO / "demo_out", help="checkpoints and logs of the demo")
    return parser


def read_progress(stdout_json: Path) -> list[dict]:
    """VISSL appends one JSON line per logged iteration to CHECKPOINT.DIR/stdout.json."""
    if not stdout_json.exists():
        return []
    entries = []
    for line in stdout_json.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written right now
    return entries


def progress_line(name: str, entry: dict, batch_size: int, started: float, budget_s: float) -> str:
    batch_ms = max(entry.get("btime(ms)", 0), 1)
    eta = max(0.0, budget_s - (time.monotonic() - started))
    return (f"[{name}] step {entry['iter']:5d}  loss {entry['loss']:.4f}  lr {entry['lr']:.4f}  "
            f"{batch_size * 1000.0 / batch_ms:6.1f} samples/s  demo ETA {eta:5.0f} s")


def main() -> int:
    args = build_parser().parse_args()
    budget_s = args.minutes * 60.0
    checkpoint_dir = args.out / "peer0"
    batch_size = 16
    command = [sys.executable, str(REPO / "run_trainer.py"), "--config", "swav_tiny", "--data_path",
               str(args.data_path), "--checkpoint_dir", str(checkpoint_dir), "config.OPTIMIZER.num_epochs=50",
               "config.LOG_FREQUENCY=5", "config.CHECKPOINT.OVERWRITE_EXISTING=True"]
    log_path = args.out / "peer0.log"
    args.out.mkdir(parents=True, exist_ok=True)
    print("starting:", " ".join(command), flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started, shown = time.monotonic(), 0
    try:
        while time.monotonic() - started < budget_s and process.poll() is None:
            time.sleep(2.0)
            entries = read_progress(checkpoint_dir / "stdout.json")
            for entry in entries[shown:]:
                print(progress_line("peer0", entry, batch_size, started, budget_s), flush=True)
            shown = len(entries)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    entries = read_progress(checkpoint_dir / "stdout.json")
    if not entries:
        print(f"the trainer logged no step; see {log_path}", file=sys.stderr)
        return 1
    print(f"done: {entries[-1]['iter']} steps, loss {entries[0]['loss']:.4f} -> {entries[-1]['loss']:.4f}; "
          f"logs and checkpoints in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
