"""Churn in ``bench_optimizer.py`` (``RunSpec.churn``): the last of the 3 peers is away for the middle third of the
run, the users' normal case.

- ``kill``: its whole session is SIGKILLed at a third of its steps; restarted at once (a new process starts slowly)
  by the README's restart, it loads its checkpoint and, once the others are at two thirds, takes the swarm's state.
- ``pause``: it stays up, trains nothing from a third to two thirds, then rejoins the same way; ``kill − pause`` is
  what the crash costs beyond the lost samples. Peers tell their steps through ``ProgressFiles``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CHURNS = ("kill", "pause")
CHECKPOINT_EVERY = 25  # local steps between the churned peer's checkpoints (about one round in the main regime)
PROGRESS_EVERY = 5  # local steps between progress files


@dataclass(frozen=True)
class ChurnPlan:
    """Which peer is away, and between which of its local steps."""

    rank: int
    stop_at: int
    resume_at: int

    @classmethod
    def of(cls, churn: str, peers: int, steps: int) -> ChurnPlan | None:
        if not churn:
            return None
        if churn not in CHURNS:
            raise ValueError(f"churn must be one of {CHURNS} (or empty), got {churn!r}")
        return cls(rank=peers - 1, stop_at=steps // 3, resume_at=2 * steps // 3)


class ProgressFiles:
    """``progress{rank}.json`` in the run's folder: each peer's last local step, written atomically."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def write(self, rank: int, step: int) -> None:
        path = self.run_dir / f"progress{rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step}))
        tmp.rename(path)

    def step_of(self, rank: int) -> int:
        try:
            return int(json.loads((self.run_dir / f"progress{rank}.json").read_text())["step"])
        except (OSError, ValueError, KeyError):
            return -1

    def others_reached(self, ranks: list[int], step: int) -> bool:
        return all(self.step_of(rank) >= step for rank in ranks)

    def wait_for(self, ranks: list[int], step: int, deadline: float, while_waiting: Callable[[], Any]) -> None:
        """Until every peer of ``ranks`` reached ``step``; TimeoutError at the deadline."""
        while not self.others_reached(ranks, step):
            if time.time() > deadline:
                raise TimeoutError(f"peers {ranks} did not reach step {step} before the deadline")
            while_waiting()
            time.sleep(0.1)


def checkpoint_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"checkpoint{rank}.pt"


def save_checkpoint(run_dir: Path, rank: int, model: torch.nn.Module, optimizer: Any, step: int, curve: list) -> None:
    """What a box's checkpoint holds (the weights, the optimizer's state, its step) and the curve so far; atomic."""
    path = checkpoint_path(run_dir, rank)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "curve": curve}, tmp)
    tmp.rename(path)


def load_checkpoint(run_dir: Path, rank: int) -> dict:
    return torch.load(checkpoint_path(run_dir, rank))


def crash() -> None:
    """SIGKILL this process's whole session, as a box that lost power: nothing gets to clean up."""
    os.killpg(os.getpgid(0), signal.SIGKILL)
