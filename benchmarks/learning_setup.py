"""bench_learning's recipe and plan: its modes, the defaults and --quick's, what a run costs, the plan every mode
trains (``Plan``)."""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO
from run_eval import IMAGE_SUFFIXES

TRAINED = ("alone", "swarm", "swarm_outer", "swarm_churn", "swarm_paced", "old", "hivemind_optimizer", "ddp")
MODES = (*TRAINED, "random_init", "raw_pixels")
SWARM_MODES = {
    "swarm": "improved",
    "swarm_outer": "improved",
    "swarm_churn": "improved",
    "swarm_paced": "improved",
    "old": "old",
    "hivemind_optimizer": "hivemind_optimizer",
}
PAIRED = (  # per-seed differences the report gives
    ("swarm_outer", "swarm"),
    ("swarm_churn", "swarm_paced"),
    ("swarm_churn", "swarm"),
    ("swarm_paced", "swarm"),
)
PACED_MODES = ("swarm_churn", "swarm_paced")  # their steps last at least --churn_pace_s
CHURN_PACE_S = 0.3  # unpaced, the restarted box came back after the others finished (see Churn in the docstring)
NO_STATE_DOWNLOAD = ["--load_state_timeout", "0"]  # a first start: every box builds the seed's initial model
OUTER_FLAGS = ["--outer_momentum", "0.5", "--outer_lr", "0.7", "--outer_nesterov"]  # swarm_outer: bench_optimizer's
FLOOR_ROWS = {"random_init": "--", "raw_pixels": ":"}  # kNN rows drawn as horizontal lines
HIVEMIND_TARGET_ENV = "SWAV_HIVEMIND_TARGET_BATCH_SIZE"  # baselines.hivemind_optimizer.TARGET_BATCH_ENV
DEFAULTS = {
    "data_path": REPO / "data/fashion",
    "config": "swav_fashion",
    "epochs": 4,
    "seeds": 3,
    "curve_points": 8,
    "heldout_images": 1024,
    "heldout_batch": 64,
    "train_images": 0,
    "modes": list(MODES),
}
QUICK = {
    "data_path": REPO / "data/digits",
    "config": "swav_tiny",
    "epochs": 4,
    "seeds": 1,
    "curve_points": 3,
    "heldout_images": 128,
    "heldout_batch": 32,
    "train_images": 720,  # 180 steps alone, 60 per box of 3: under 3 minutes on 2 cores
    "modes": ["alone", "swarm", "random_init", "raw_pixels"],
}
NORMAL_MATCHMAKING_S, SLOW_MATCHMAKING_S = 3.0, 30.0
NORMAL_HIVEMIND_STEPS, SLOW_HIVEMIND_STEPS = 20, 200
# Rough costs on the 2-core machine while other work keeps it busy (load 7-10; a quiet one takes about half), from
# the --quick run (swav_tiny; swav_fashion's steps cost about the same): a box alone ~0.2 s per step, 3 processes
# sharing the cores ~0.5 s each; the trunk's forward pass ~1 ms per image on one thread, decoding a PNG ~1.7 ms. Only
# for the estimate printed at start and each run's deadline (4x it + 10 min)
# (swarm_churn: box 2's second start, with its wait for the swarm's state)
STARTUP_S = {"alone": 25.0, "ddp": 30.0, **dict.fromkeys(SWARM_MODES, 40.0), "swarm_churn": 100.0}
SECONDS_PER_STEP = {**dict.fromkeys(TRAINED, 0.5), "alone": 0.2, "old": 0.55, "hivemind_optimizer": 0.55}
EVAL_S_PER_IMAGE = 1.0e-3  # trunk forward per image on one thread (bank + val per checkpoint)
DECODE_S_PER_IMAGE = 1.7e-3


class BenchError(Exception):
    """A run that cannot start or did not finish; the message says which and where its log is."""


# ---------------------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    """The recipe every mode trains. ``data_limit`` images (a multiple of boxes x batch; VISSL's DATA_LIMIT also
    shuffles the folder, which is sorted by class: ddp's ranks would otherwise each get a few classes only), one box
    alone takes ``alone_steps``; a swarm's boxes and ddp's processes share them (``shared_steps`` each)."""

    config: str
    batch: int
    boxes: int
    train_images: int
    data_limit: int
    epochs: int
    curve_points: int

    @property
    def alone_steps(self) -> int:
        return self.epochs * (self.data_limit // self.batch)

    @property
    def budget_samples(self) -> int:
        return self.alone_steps * self.batch

    @property
    def shared_steps(self) -> int:
        return self.alone_steps // self.boxes

    def expected_steps(self, mode: str) -> int:
        return self.alone_steps if mode == "alone" else self.shared_steps

    def checkpoint_every(self, mode: str) -> int:
        return max(1, math.ceil(self.expected_steps(mode) / self.curve_points))

    def global_batch(self, mode: str) -> int:
        return self.batch * self.boxes if mode == "ddp" else self.batch


def make_plan(args: argparse.Namespace) -> Plan:
    if not (args.data_path / "train").is_dir() or not (args.data_path / "val").is_dir():
        raise BenchError(
            f"--data_path {args.data_path}: expected train/ and val/ ImageFolders (`make data-fashion`, "
            f"or `python scripts/export_digits.py --out {args.data_path}`)"
        )
    images = count_images(args.data_path / "train")
    batch = batch_per_box(args.config, args.override)
    usable = min(images, args.train_images) if args.train_images else images
    data_limit = usable - usable % (batch * args.boxes)
    if data_limit < batch * args.boxes:
        raise BenchError(f"{usable} training images are fewer than {args.boxes} boxes x batch {batch}")
    return Plan(
        config=args.config,
        batch=batch,
        boxes=args.boxes,
        train_images=images,
        data_limit=data_limit,
        epochs=args.epochs,
        curve_points=args.curve_points,
    )


def count_images(folder: Path) -> int:
    return sum(1 for path in folder.glob("*/*") if path.suffix.lower() in IMAGE_SUFFIXES)


def batch_per_box(config_name: str, overrides: list[str]) -> int:
    from vissl_swarm.config_loading import ConfigError, compose_config

    try:
        config, _ = compose_config(config_name, overrides, has_gpu=False)
    except ConfigError as error:
        raise BenchError(f"--config/--override: {error}") from error
    return int(config.DATA.TRAIN.BATCHSIZE_PER_REPLICA)


def fresh_out_dir(out: Path | None) -> Path:
    """A folder no earlier run wrote into: boxes would resume its checkpoints and report old trunks as new."""
    if out is None:
        out = REPO / "benchmarks/out/learning" / time.strftime("%Y%m%d-%H%M%S")
    if out.exists() and any(out.iterdir()):
        raise BenchError(
            f"--out {out} is not empty: its checkpoints would be resumed and evaluated as new. "
            "Pass a new folder, or delete this one"
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


def estimated_seconds(mode: str, plan: Plan, eval_images: int, pace_s: float = 0.0) -> float:
    """Rough: start-up, steps (at least ``pace_s`` each), and the kNN/held-out evaluation of every box's
    checkpoints."""
    if mode in FLOOR_ROWS:
        return 2 * eval_images * EVAL_S_PER_IMAGE
    trunks = 1 if mode in ("alone", "ddp") else plan.boxes
    evaluations = trunks * (plan.curve_points + 2)
    return (
        STARTUP_S[mode]
        + plan.expected_steps(mode) * max(SECONDS_PER_STEP[mode], pace_s)
        + evaluations * eval_images * EVAL_S_PER_IMAGE
    )
