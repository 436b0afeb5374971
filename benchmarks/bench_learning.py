#!/usr/bin/env python3
"""Does a swarm of 3 boxes reach one box's trunk sooner? Every mode trains the same recipe: the same num_epochs, a
budget of samples that one box trains alone and that a swarm shares (the swarm-wide schedule, run_trainer.py's
default), as a DDP run's epochs count its global batch.

    python -m benchmarks.bench_learning --json benchmarks/results/learning.json \
        --markdown benchmarks/results/learning.md --plot benchmarks/results/learning.png
    python -m benchmarks.bench_learning --quick --modes alone swarm      # minutes: digits + swav_tiny, 1 seed

Dataset: Fashion-MNIST exported as ``data/fashion/{train,val}/<class>/*.png`` (60k / 10k; ``make data-fashion``),
config ``swav_fashion`` (``--data_path``, ``--config`` to change; ``--quick`` uses the digits and ``swav_tiny``).

Modes, all from the same initial model per seed and at the same recipe (``config.OPTIMIZER.num_epochs``):
  alone               one box training alone: ``run_trainer.py --isolated`` (VISSL's stock task), the reference
  swarm               3 boxes, this example's DecentralizedSGD, the swarm-wide schedule: each box stops by itself when
                      the swarm has trained on the budget
  swarm_outer         swarm with the outer step of bench_optimizer's experiment outer (``OUTER_FLAGS``: Nesterov b 0.5,
                      a 0.7; off by default in run_trainer.py)
  swarm_churn         swarm whose last box crashes at a third of its steps and comes back as the README's restart
                      (``Churn``, below): the users' normal case; paced (``--churn_pace_s``)
  swarm_paced         swarm paced as swarm_churn, without the kill: the same samples, no kill
  old                 3 boxes, ``--averager old`` (hivemind's TrainingAverager one round at a time), same schedule
  hivemind_optimizer  3 boxes, ``--averager hivemind_optimizer`` (hivemind.Optimizer(use_local_updates=True) inside
                      VISSL's LARC), same schedule; its global epoch (one averaging round) every boxes x batch x R
                      samples of the swarm, R = the local steps per applied round that ``swarm`` measured for the same
                      seed in this invocation (else ``--hivemind_steps_per_round``): rounds as often as ours
  ddp                 VISSL's DDP over 3 local processes (gloo, ``NUM_PROC_PER_NODE=3``, ``--isolated``): the
                      synchronous reference; its epochs count the global batch, so the same samples
  random_init         the seed's untrained trunk with BatchNorm statistics of the training images (the kNN bank's):
                      the floor (any training adapts those statistics, which alone can lift the kNN accuracy)
  raw_pixels          kNN on the raw pixels (the eval transform's tensor, flattened): ~0.86 on Fashion-MNIST

Measured per mode and seed, never against wall time:
- kNN top-1 on the whole val split of every box's final trunk, and along the run (checkpoints every
  ``steps/curve_points`` steps per box): run_eval.py's rule (cosine, k=20, weighted vote, T=0.1). The kNN bank is a
  fixed subset of the train split (``--knn_train``, default 20000 of Fashion-MNIST's 60000, the same images for every
  model): the full bank costs a 60k-image forward pass per checkpoint, about a minute on a busy 2-core machine, and
  a few hundred checkpoints per run; ``--knn_train 0`` uses all of it. Images are decoded once per invocation.
- the SwAV loss on a fixed held-out set: ``--heldout_images`` val images, their crops drawn once with the config's
  training transforms under a fixed seed, cut into fixed Sinkhorn batches of ``--heldout_batch``; every model and
  checkpoint sees exactly these tensors (BatchNorm on batch statistics, as in training; no queue): the optimisation
  curve.
- steps per box, samples of the swarm (a swarm box's checkpoint holds the swarm's count; alone and ddp: steps x their
  global batch), averaging rounds applied per box, local steps per applied round (the ratio that says how much a
  round has to repair), failed rounds.
Reported per mode: final kNN mean ± std over seeds (a seed's value: the mean of its boxes), steps per box, and the
steps per box (and samples of the swarm) at which the mode's kNN curve first reaches ``alone``'s final kNN of the
same seed (linear between checkpoints; "not reached" otherwise). Plots: kNN and held-out loss against samples the
swarm processed and against steps per box.

``--slow_averaging`` runs swarm, old and hivemind_optimizer at the steps-per-round ratio real ResNet-50 boxes would
see (~100-400 local steps per round): matchmaking waits ``--min_matchmaking_time`` (30 s, groups of boxes + 1 so that
no group fills early), hivemind's global epoch every boxes x batch x 200 samples; the ratio actually measured is in the
table. It needs thousands of steps per box to give more than a round or two: ``--quick --slow_averaging --epochs 12``
(~350 steps per box) measured 347 local steps per round for swarm, one round per box, and hivemind_optimizer, given
that ratio, none.

Churn (``swarm_churn``), bench_optimizer's experiment churn on SwAV: box 2's whole session (trainer, DHT, averager,
p2pd) is SIGKILLed once it has logged a third of its share of the steps, and started again with its own command
(the README's restart: VISSL resumes its last checkpoint, every ``checkpoint_every`` steps, the box rejoins through
the initial peers and, the swarm being ahead, takes the swarm's weights, optimizer state and sample counts) so that
it is back when the swarm has trained on two thirds of the budget: a restart takes its seconds (imports, VISSL's
start, the join, the download; its first start's seconds serve as the estimate), so it is started that much early,
at once after the kill if the middle third is shorter than that. Its restart command is its first one without
``--load_state_timeout 0`` (the benchmark's first start: every box builds the seed's initial model instead of
downloading a neighbour's), as in tests/test_swarm_training.py: run_trainer.py's default is what takes the state.
Its steps are logged every step (LOG_FREQUENCY 1) so that the kill lands on its step. As in bench_optimizer, the run
is paced (``--churn_pace_s``, 0.3 s: every step of every box lasts at least that long, tests/paced_trainer.py): on
the recipe of benchmarks/results/learning.md (1 epoch of 12,000 images, ~125 steps per box) the 2-core machine
trains a swarm's box in ~0.2 s a step, and unpaced, box 2, started again at once after the kill, came back after
the others had finished the budget in 2 of 3 seeds (the rest of the run lasted 12-16 s; a restart takes 10-17 s),
and at 82% of the budget in the third.
Pacing changes the local steps per round (rounds come by the clock, and the averager has the cores to itself while
the trainers sleep: 0.3 s measured 2.2 local steps per round, swarm unpaced 4-10), hence ``swarm_paced``, the same
swarm at the same pace without the kill.

What the comparison means: the swarm-wide schedule fixes the swarm's samples, so boxes 0 and 1 train on while box 2
is away and every mode ends at the same samples of the swarm. ``swarm_churn − swarm_paced`` (per seed) is what the
kill costs at the same samples and pace; ``swarm_paced − swarm`` what the pace alone changes. ``swarm_paced`` is also
the reference of "what the lost samples alone explain": no sample of the budget is skipped (the others train it), so
the samples a kill loses are only box 2's steps whose update never reached the swarm (since the snapshot of its last
applied round: the swarm counted them, nobody kept them), and, for box 2 itself, the steps since its checkpoint
(replaced by the swarm's state anyway). Both are reported per seed as numbers, with where in the budget box 2 left
and came back and its share of the swarm's steps. bench_optimizer's ``pause`` (the box up but idle) has no
counterpart with run_trainer.py's processes, and a box that leaves for good would measure a swarm of 2, not the
kill. A restart that comes back after the others finished, or without the swarm's state, fails the run (its log).

A seed is a run id (``learn<seed>``): its boxes share the initial model in every mode (the swarm boxes build it from
the run id, alone and ddp load it with VISSL's ``MODEL.WEIGHTS_INIT``; each run checks its logs for it), box i of
seed s has SEED_VALUE 1000·s + i. The swarm modes train with run_trainer.py's defaults otherwise (``--swarm_lr``:
their LR scaling is recorded as ``lr_factor``). Every invocation trains in a fresh ``--out`` (an existing non-empty
one is refused); every run has a deadline and is stopped on failure, a crash is reported with its log and the other
modes go on; the JSON (git commit, dataset, recipe, per-seed values) is rewritten after every run.
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import json
import math
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean
from typing import Any

import numpy as np
import torch

from benchmarks.common import REPO, crossing, git_state, markdown_table, paired_difference, pyplot, save_figure, spread
from run_eval import IMAGE_SUFFIXES, knn_top1
from vissl_swarm.local_swarm import (
    LocalPeer,
    read_jsonl,
    start_swarm_together,
    stop_all,
    wait_until,
)

MODES = (
    "alone",
    "swarm",
    "swarm_outer",
    "swarm_churn",
    "swarm_paced",
    "old",
    "hivemind_optimizer",
    "ddp",
    "random_init",
    "raw_pixels",
)
TRAINED = ("alone", "swarm", "swarm_outer", "swarm_churn", "swarm_paced", "old", "hivemind_optimizer", "ddp")
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
}
QUICK = {
    "data_path": REPO / "data/digits",
    "config": "swav_tiny",
    "epochs": 6,
    "seeds": 1,
    "curve_points": 3,
    "heldout_images": 128,
    "heldout_batch": 32,
}
NORMAL_MATCHMAKING_S, SLOW_MATCHMAKING_S = 3.0, 30.0
NORMAL_HIVEMIND_STEPS, SLOW_HIVEMIND_STEPS = 20, 200
# Rough costs on the 2-core machine while other work keeps it busy (load 7-10; a quiet one takes about half), from
# the --quick run (swav_tiny; swav_fashion's steps cost about the same): a box alone ~0.2 s per step, 3 processes
# sharing the cores ~0.5 s each; the trunk's forward pass ~1 ms per image on one thread, decoding a PNG ~1.7 ms. Only
# for the estimate printed at start and each run's deadline (4x it + 10 min)
# (swarm_churn: box 2's second start, with its wait for the swarm's state)
STARTUP_S = {
    "alone": 25.0,
    "swarm": 40.0,
    "swarm_outer": 40.0,
    "swarm_churn": 100.0,
    "swarm_paced": 40.0,
    "old": 40.0,
    "hivemind_optimizer": 40.0,
    "ddp": 30.0,
}
SECONDS_PER_STEP = {
    "alone": 0.2,
    "swarm": 0.5,
    "swarm_outer": 0.5,
    "swarm_churn": 0.5,
    "swarm_paced": 0.5,
    "old": 0.55,
    "hivemind_optimizer": 0.55,
    "ddp": 0.5,
}
EVAL_S_PER_IMAGE = 1.0e-3  # trunk forward per image on one thread (bank + val per checkpoint)
DECODE_S_PER_IMAGE = 1.7e-3


class BenchError(Exception):
    """A run that cannot start or did not finish; the message says which and where its log is."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="minutes: the digits and swav_tiny, 1 seed, 2 epochs, 3 curve points (what the tests run)",
    )
    parser.add_argument(
        "--data_path",
        type=Path,
        default=None,
        help=f"train/ and val/ ImageFolders; default {DEFAULTS['data_path']} (--quick: data/digits)",
    )
    parser.add_argument(
        "--config", default=None, help="config of every process; default swav_fashion (--quick: swav_tiny)"
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"the recipe's num_epochs, the budget of samples in every mode (default "
        f"{DEFAULTS['epochs']}; --quick {QUICK['epochs']})",
    )
    parser.add_argument("--seeds", type=int, default=None, help="runs per mode: seeds 0 .. SEEDS-1 (default 3)")
    parser.add_argument("--boxes", type=int, default=3, help="boxes of a swarm (ddp: local processes)")
    parser.add_argument(
        "--train_images",
        type=int,
        default=0,
        help="train on this many images of the train split (0: all, rounded down to a multiple of boxes x batch)",
    )
    parser.add_argument("--curve_points", type=int, default=None, help="checkpoints evaluated along each box's run")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run")
    parser.add_argument(
        "--knn_train",
        type=int,
        default=20000,
        help="kNN bank: this many train images (a fixed subset); 0: the whole train split",
    )
    parser.add_argument(
        "--heldout_images",
        type=int,
        default=None,
        help=f"val images of the held-out SwAV loss (default {DEFAULTS['heldout_images']}; --quick "
        f"{QUICK['heldout_images']})",
    )
    parser.add_argument(
        "--heldout_batch",
        type=int,
        default=None,
        help=f"Sinkhorn batch of the held-out SwAV loss (default {DEFAULTS['heldout_batch']}; --quick "
        f"{QUICK['heldout_batch']})",
    )
    parser.add_argument(
        "--churn_pace_s",
        type=float,
        default=CHURN_PACE_S,
        help="swarm_churn and swarm_paced: each step of their boxes lasts at least this long, so that a restarted "
        "box (12-45 s to start on 2 cores) is back before the others finish the budget; 0: unpaced, as swarm",
    )
    parser.add_argument(
        "--slow_averaging",
        action="store_true",
        help="swarm/old/hivemind_optimizer at ~100-400 local steps per round, as ResNet-50 boxes",
    )
    parser.add_argument(
        "--min_matchmaking_time",
        type=float,
        default=None,
        help=f"of swarm/old/hivemind_optimizer (default {NORMAL_MATCHMAKING_S:g} s; --slow_averaging "
        f"{SLOW_MATCHMAKING_S:g} s)",
    )
    parser.add_argument(
        "--hivemind_steps_per_round",
        type=float,
        default=None,
        help="hivemind_optimizer's local steps per box per global epoch when swarm did not run first "
        f"for the seed (default {NORMAL_HIVEMIND_STEPS}; --slow_averaging {SLOW_HIVEMIND_STEPS})",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Hydra override of the config for every process and the evaluation, e.g. "
        "config.LOSS.swav_loss.epsilon=0.03 (repeatable)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="checkpoints and logs, a new or empty folder; default: benchmarks/out/learning/<time>",
    )
    parser.add_argument("--json", type=Path, default=None, help="write settings, runs and summary here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here")
    parser.add_argument("--plot", type=Path, default=None, help="write the curves here (PNG)")
    return parser


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that --quick and --slow_averaging change; check the rest."""
    for name, value in {**DEFAULTS, **(QUICK if args.quick else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.min_matchmaking_time is None:
        args.min_matchmaking_time = SLOW_MATCHMAKING_S if args.slow_averaging else NORMAL_MATCHMAKING_S
    if args.hivemind_steps_per_round is None:
        args.hivemind_steps_per_round = SLOW_HIVEMIND_STEPS if args.slow_averaging else NORMAL_HIVEMIND_STEPS
    for name in ("epochs", "seeds", "curve_points", "heldout_images", "heldout_batch"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.boxes < 2:
        raise BenchError(f"--boxes must be at least 2, got {args.boxes}")
    if args.min_matchmaking_time <= 0 or args.hivemind_steps_per_round <= 0:
        raise BenchError("--min_matchmaking_time and --hivemind_steps_per_round must be positive")
    if args.churn_pace_s < 0:
        raise BenchError(f"--churn_pace_s must be 0 or more, got {args.churn_pace_s}")
    return args


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


def load_split(folder: Path, transform: Any, indices: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The eval-transformed images of one ImageFolder split (or of ``indices`` of it) and their labels."""
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(str(folder), transform=transform)
    chosen = range(len(dataset)) if indices is None else indices
    images, labels = [], []
    for index in chosen:
        image, label = dataset[index]
        images.append(image)
        labels.append(label)
    return torch.stack(images), torch.tensor(labels)


def fixed_subset(size: int, count: int, seed: int) -> list[int] | None:
    """``count`` of ``size`` indices, the same for every model (None: all)."""
    if count <= 0 or count >= size:
        return None
    return sorted(torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:count].tolist())


class Evaluator:
    """kNN top-1 (the bank: a fixed subset of train; the queries: all of val) and the SwAV loss on a fixed held-out
    set, of any checkpoint of the config; the images are decoded once."""

    def __init__(
        self,
        config_name: str,
        overrides: list[str],
        data_path: Path,
        knn_train: int,
        heldout_images: int,
        heldout_batch: int,
    ) -> None:
        from vissl_swarm import vissl_compat

        vissl_compat.apply()
        from classy_vision.generic.distributed_util import set_cpu_device
        from vissl.models import build_model

        from run_eval import eval_transform
        from vissl_swarm.config_loading import compose_config

        set_cpu_device()  # the evaluation runs on the CPU (SwAV's Sinkhorn would move its tensors to a GPU otherwise)
        # the held-out loss without a queue: a fresh loss has an empty one, which would enter the Sinkhorn
        self.config, _ = compose_config(
            config_name, [*overrides, "config.LOSS.swav_loss.queue.queue_length=0"], has_gpu=False
        )
        self.model = build_model(self.config.MODEL, self.config.OPTIMIZER)
        transform = eval_transform(self.config)
        self.bank_indices = fixed_subset(count_images(data_path / "train"), knn_train, seed=1)
        self.bank, self.bank_labels = load_split(data_path / "train", transform, self.bank_indices)
        self.val, self.val_labels = load_split(data_path / "val", transform)
        self.temperature = float(self.config.NEAREST_NEIGHBOR.SIGMA)
        self.heldout = self._heldout_batches(data_path / "val", heldout_images, heldout_batch)

    @property
    def sizes(self) -> dict:
        return {
            "knn_bank": len(self.bank_labels),
            "knn_queries": len(self.val_labels),
            "heldout_batches": len(self.heldout),
        }

    def _heldout_batches(self, folder: Path, count: int, batch: int) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """The held-out crops, drawn once: ``count`` val images (a fixed subset, whole batches), the config's training
        transforms under seed 0 (torch, numpy and random: VISSL's transforms draw from all three), VISSL's collator."""
        from torchvision.datasets import ImageFolder
        from vissl.data.collators import get_collator
        from vissl.data.ssl_transforms import get_transform

        dataset = ImageFolder(str(folder))
        count = max(batch, min(count, len(dataset)) // batch * batch)
        indices = fixed_subset(len(dataset), count, seed=2) or list(range(len(dataset)))[:count]
        transform = get_transform(self.config.DATA.TRAIN.TRANSFORMS)
        train = self.config.DATA.TRAIN
        collate = get_collator(train.COLLATE_FUNCTION, train.get("COLLATE_FUNCTION_PARAMS", {}))
        state = torch.get_rng_state(), np.random.get_state(), random.getstate()
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        try:
            samples = [
                transform({"data": [dataset[index][0]], "label": [index], "data_valid": [1], "data_idx": [index]})
                for index in indices
            ]
        finally:
            torch.set_rng_state(state[0])
            np.random.set_state(state[1])
            random.setstate(state[2])
        batches = []
        for start in range(0, len(samples), batch):
            collated = collate(samples[start : start + batch])
            batches.append((collated["data"][0], collated["label"][0]))
        return batches

    def load(self, checkpoint: Path) -> None:
        """The model of a VISSL checkpoint (trunk and heads, with BatchNorm statistics)."""
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)  # our own benchmark's files
        self.model.set_classy_state(state["classy_state_dict"]["base_model"])

    def features(self, images: torch.Tensor, batch: int = 512) -> torch.Tensor:
        trunk = self.model.trunk.eval()
        with torch.no_grad():
            return torch.cat(
                [
                    torch.nn.functional.normalize(trunk(images[start : start + batch])[0].flatten(1).float(), dim=1)
                    for start in range(0, len(images), batch)
                ]
            )

    def knn(self, bank: torch.Tensor, queries: torch.Tensor, k: int = 20, chunk: int = 2000) -> float:
        """run_eval.py's weighted kNN vote, over chunks of queries (a 10k x 60k similarity matrix is 2.4 GB)."""
        correct = 0.0
        for start in range(0, len(queries), chunk):
            labels = self.val_labels[start : start + chunk]
            part = knn_top1(bank, self.bank_labels, queries[start : start + chunk], labels, k, self.temperature)
            correct += part * len(labels)
        return correct / len(queries)

    def knn_of_model(self) -> float:
        return self.knn(self.features(self.bank), self.features(self.val))

    def heldout_loss(self) -> float:
        """Mean SwAV loss over the fixed held-out batches; BatchNorm on batch statistics (train mode, as training
        computes the loss), no gradients; the model's running statistics are reloaded with the next checkpoint."""
        import vissl.losses  # noqa: F401  (registers VISSL's losses)
        from classy_vision.losses import build_loss

        name = self.config.LOSS["name"]
        loss_config = copy.deepcopy(self.config.LOSS[name])  # VISSL's AttrDict, as its task builds the loss
        loss_config["name"] = name
        loss = build_loss(loss_config)
        self.model.train()
        values = []
        with torch.no_grad():
            for crops, target in self.heldout:
                output = self.model(crops)
                output = output[0] if len(output) == 1 else output  # as VISSL's train step does
                values.append(float(loss(output, target)))
        self.model.eval()
        return mean(values)

    def evaluate(self, checkpoint: Path) -> dict:
        self.load(checkpoint)
        accuracy = self.knn_of_model()
        return {"knn": round(accuracy, 4), "heldout_loss": round(self.heldout_loss(), 4)}

    def adapt_batchnorm(self, batch: int = 256) -> None:
        """The model's BatchNorm statistics recomputed over the kNN bank's train images (run_eval.py --adapt_bn)."""
        trunk = self.model.trunk
        norms = [module for module in trunk.modules() if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)]
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None
        order = torch.randperm(len(self.bank), generator=torch.Generator().manual_seed(0))
        trunk.train()
        with torch.no_grad():
            for start in range(0, len(order), batch):
                trunk(self.bank[order[start : start + batch]])
        trunk.eval()

    def raw_pixels(self) -> float:
        """kNN on the eval tensors themselves, flattened: what the trunk has to beat without any learning."""

        def flat(images: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.normalize(images.flatten(1).float(), dim=1)

        return self.knn(flat(self.bank), flat(self.val))


# ---------------------------------------------------------------------------------------------- initial model


@dataclass(frozen=True)
class InitialModel:
    """What every process of one seed starts from, in every mode, and its evaluation: as is (the curves' step 0)
    and with BatchNorm statistics of the training images (the random_init floor)."""

    path: Path
    trunk_fingerprint: str
    knn: float
    heldout_loss: float
    knn_adapted_bn: float


def run_id(seed: int) -> str:
    return f"learn{seed}"


def write_initial_model(
    seed: int, folder: Path, config_name: str, overrides: list[str], evaluator: Evaluator
) -> InitialModel:
    """The model the swarm boxes of run ``learn<seed>`` build (decentralized_task.py seeds it from the run id and
    config name), saved as VISSL weights: alone and ddp load it with MODEL.WEIGHTS_INIT."""
    from vissl_swarm import vissl_compat

    vissl_compat.apply()
    from vissl.models import build_model
    from vissl.utils.misc import set_torch_seed

    from vissl_swarm.config_loading import compose_config
    from vissl_swarm.initial_model import initial_model_seed, weights_fingerprint

    config, _ = compose_config(config_name, overrides, has_gpu=False)
    init_seed = initial_model_seed(run_id(seed), config_name)
    config.MODEL._MODEL_INIT_SEED = init_seed  # as the task does: VISSL seeds the heads with it
    with set_torch_seed(init_seed):
        model = build_model(config.MODEL, config.OPTIMIZER)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run_id(seed)}.torch"
    torch.save({"classy_state_dict": {"base_model": model.get_classy_state()}}, path)
    as_is = evaluator.evaluate(path)
    evaluator.load(path)
    evaluator.adapt_batchnorm()
    return InitialModel(
        path, weights_fingerprint(model.trunk), as_is["knn"], as_is["heldout_loss"], round(evaluator.knn_of_model(), 4)
    )


def started_from(mode: str, peers: list[LocalPeer], initial: InitialModel) -> bool:
    """Whether every process logged starting from the seed's initial model (a swarm box logs its trunk's fingerprint,
    VISSL logs loading the weights file)."""
    if mode in SWARM_MODES:  # (a restarted box builds it again before it loads its checkpoint: logged twice)
        return all(
            set(re.findall(r"trunk fingerprint (\w+)", peer.log_text())) == {initial.trunk_fingerprint}
            for peer in peers
        )
    return all(f"Initializing model from: {initial.path}" in peer.log_text() for peer in peers)


# ---------------------------------------------------------------------------------------------------- training


def make_peers(mode: str, seed: int, out: Path, plan: Plan, env: dict[str, str], pace_s: float) -> list[LocalPeer]:
    """The run's processes; ``pace_s`` > 0: swarm boxes whose steps last at least that long (tests/paced_trainer.py:
    run_trainer.py's main with one hook that sleeps the rest of the step)."""
    run_dir = out / mode / f"seed{seed}"
    if mode == "ddp":  # gloo on the loopback only (it would pick the host name's interface otherwise)
        return [LocalPeer("ddp", run_dir, config=plan.config, env={"GLOO_SOCKET_IFNAME": "lo"})]
    if mode == "alone":
        return [LocalPeer("box0", run_dir, config=plan.config)]
    script = LocalPeer.script
    if pace_s > 0:
        from tests.paced_trainer import MIN_STEP_ENV, SCRIPT

        env, script = {**env, MIN_STEP_ENV: f"{pace_s:g}"}, SCRIPT
    return [
        LocalPeer(f"box{index}", run_dir, config=plan.config, env=dict(env), script=script)
        for index in range(plan.boxes)
    ]


def pace_of(mode: str, args: argparse.Namespace) -> float:
    return args.churn_pace_s if mode in PACED_MODES else 0.0


def trainer_arguments(
    mode: str, seed: int, plan: Plan, initial: InitialModel, args: argparse.Namespace
) -> tuple[list[str], list[str]]:
    """(flags, overrides) of every process of a run, ``--override`` first; the box's own SEED_VALUE is added per box.
    Every mode: the same num_epochs (the budget) and the same DATA_LIMIT."""
    flags = ["--run_id", run_id(seed)]
    overrides = [
        *args.override,
        f"config.OPTIMIZER.num_epochs={plan.epochs}",
        f"config.DATA.TRAIN.DATA_LIMIT={plan.data_limit}",
        f"config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY={plan.checkpoint_every(mode)}",
        "config.CHECKPOINT.CHECKPOINT_FREQUENCY=1000000",
        f"config.LOG_FREQUENCY={1 if mode in PACED_MODES else 20}",  # churn: the kill lands on box 2's step
    ]
    if mode in SWARM_MODES:
        group = plan.boxes + 1 if args.slow_averaging else plan.boxes  # slow: no group fills before the deadline
        flags += [
            "--averager",
            SWARM_MODES[mode],
            "--target_group_size",
            str(group),
            "--min_matchmaking_time",
            f"{args.min_matchmaking_time:g}",
            "--averaging_timeout",
            "30",
            "--next_chunk_timeout",
            "5",
            *NO_STATE_DOWNLOAD,
            *(OUTER_FLAGS if mode == "swarm_outer" else []),
        ]
    else:  # VISSL's stock self_supervision_task, from the seed's initial model
        flags.append("--isolated")
        overrides.append(f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={initial.path}")
    if mode == "ddp":
        overrides.append(f"config.DISTRIBUTED.NUM_PROC_PER_NODE={plan.boxes}")
    return flags, overrides


def box_seed(seed: int, index: int) -> list[str]:
    return [f"config.SEED_VALUE={1000 * seed + index}"]


def train(
    mode: str,
    seed: int,
    peers: list[LocalPeer],
    args: argparse.Namespace,
    plan: Plan,
    initial: InitialModel,
    deadline_s: float,
) -> tuple[float, dict | None]:
    """Start the run's processes (swarm_churn: crash and restart its box, ``run_churn``), wait until all exited;
    return the wall-clock seconds (reported, never plotted) and the churn's record (None in other modes). BenchError
    if one failed or the run passed its deadline (every process is stopped then)."""
    flags, overrides = trainer_arguments(mode, seed, plan, initial, args)
    started = time.monotonic()
    watch = Watch(mode, seed, peers, started + deadline_s)
    churned = None
    try:
        if mode in SWARM_MODES:
            addresses = start_swarm_together(
                peers,
                args.data_path,
                flags,
                overrides,
                per_peer_overrides=lambda peer: box_seed(seed, peers.index(peer)),
            )
        else:
            peers[0].start(args.data_path, [], flags, overrides + box_seed(seed, 0))
        if mode == "swarm_churn":

            def restart(box: LocalPeer) -> None:  # its own command, as its first start had it (README's restart)
                box.start(args.data_path, addresses, restart_flags(flags), overrides + box_seed(seed, peers.index(box)))

            churned = run_churn(Churn.of(plan), peers, restart, watch)
        watch.until(lambda: not any(peer.is_running() for peer in peers), "every process finishing", poll=1.0)
    except (RuntimeError, TimeoutError) as error:  # a box that died or hung before its join line, or the deadline
        raise BenchError(f"{mode} seed {seed}: {error}{crash_report(peers)}") from error
    finally:
        stop_all(peers)
    check_exits(mode, seed, peers)
    return time.monotonic() - started, churned


@dataclass(frozen=True)
class Watch:
    """The waits of one run: each until a condition holds, all before the run's deadline (``time.monotonic()``); a
    process of ``peers`` (or of the wait's own list) that failed meanwhile ends the wait with its log line."""

    mode: str
    seed: int
    peers: list[LocalPeer]
    deadline: float

    def until(
        self, condition: Callable[[], Any], what: str, watched: list[LocalPeer] | None = None, poll: float = 0.2
    ) -> Any:
        def checked() -> Any:
            check_exits(self.mode, self.seed, self.peers if watched is None else watched)
            return condition()

        return wait_until(
            checked, max(1.0, self.deadline - time.monotonic()), f"{what} (logs: {self.peers[0].out_dir})", poll
        )


def restart_flags(flags: list[str]) -> list[str]:
    """A box's command again without the first start's ``NO_STATE_DOWNLOAD``: run_trainer.py's default timeout, with
    which a restarted box takes the swarm's state when the swarm is ahead of its checkpoint."""
    at = next(i for i in range(len(flags)) if flags[i : i + len(NO_STATE_DOWNLOAD)] == NO_STATE_DOWNLOAD)
    return flags[:at] + flags[at + len(NO_STATE_DOWNLOAD) :]


# ------------------------------------------------------------------------------------------------------- churn


CHURN_MEANS = (  # of a churn record, averaged over seeds in the summary
    "lost_steps",
    "steps_not_in_a_round",
    "away_share_of_budget",
    "share_of_steps",
    "steps_after_rejoin",
    "restart_s",
)
SPEED_WINDOW_S = 3.0  # the others' speed after the kill (when to restart the churned box): over this much at least


@dataclass(frozen=True)
class Churn:
    """swarm_churn: box ``box`` is killed once it logged step ``kill_step`` (a third of its share) and should be back
    when the swarm has trained on ``back_at`` samples (two thirds of the budget)."""

    box: int
    kill_step: int
    back_at: int

    @classmethod
    def of(cls, plan: Plan) -> Churn:
        return cls(box=plan.boxes - 1, kill_step=max(1, plan.shared_steps // 3), back_at=2 * plan.budget_samples // 3)


def run_churn(churn: Churn, peers: list[LocalPeer], restart: Callable[[LocalPeer], None], watch: Watch) -> dict:
    """Kill the box at its step, start it again with ``restart`` when, given its first start-up's seconds, it would
    be back at ``churn.back_at``, and wait until it trains again; its record: where it left and came back."""
    box = peers[churn.box]
    others = [peer for peer in peers if peer is not box]
    first = watch.until(lambda: box.progress()[:1], f"{box.name}'s first step")[0]
    startup_s = first["time"] - box.started_at
    watch.until(
        lambda: box.last_step() >= churn.kill_step or not box.is_running(),
        f"{box.name} reaching step {churn.kill_step}",
        poll=0.05,
    )
    if not box.is_running():
        raise BenchError(f"{box.name} ended before its step {churn.kill_step}; its log: {box.log_path}")
    box.kill()  # its whole session (trainer, DHT, averager, p2pd): a box that lost power
    killed_at, at_kill = time.time(), box.progress()[-1]
    snapshots = [r["step_at_snapshot"] for r in box.applied_rounds() if r.get("step_at_snapshot") is not None]
    due = functools.partial(restart_due, others, churn.back_at, startup_s, killed_at)
    watch.until(due, "the swarm nearing two thirds", others)
    at_restart = swarm_position(others)
    log_offset = len(box.log_text())
    restart(box)
    back = watch.until(lambda: back_in_swarm(box, others), f"{box.name} training again after its restart")
    after = box.log_text()[log_offset:]
    joined = re.search(r"Joined the swarm at its position: (\d+) samples", after)
    if joined is None:  # it trained from its checkpoint: not the README's restart (no donor answered in time)
        raise BenchError(f"{box.name} restarted without taking the swarm's state; its log: {box.log_path}")
    resumed = re.search(r"Resume from file: .*model_iteration(\d+)\.torch", after)
    return {
        "box": churn.box,
        "kill_step_planned": churn.kill_step,
        "back_at_samples_planned": churn.back_at,
        "first_startup_s": round(startup_s, 1),
        "killed_at_step": at_kill["step"],
        "steps_not_in_a_round": at_kill["step"] - max(snapshots, default=0),
        "resumed_step": int(resumed.group(1)) if resumed else 0,
        "swarm_samples_at_kill": at_kill.get("swarm_samples"),
        "swarm_samples_at_restart": at_restart,
        "swarm_samples_at_rejoin": int(joined.group(1)),
        "restart_s": round(back - box.started_at, 1),
        "away_s": round(back - killed_at, 1),
    }


def swarm_position(peers: list[LocalPeer]) -> int:
    """The swarm's samples as the freshest logged step of ``peers`` says."""
    return freshest_steps(peers)[-1]["swarm_samples"]


def freshest_steps(peers: list[LocalPeer]) -> list[dict]:
    """The logged steps of the peer that logged last (each box knows where the swarm is)."""
    return max((peer.progress() for peer in peers), key=lambda lines: lines[-1]["time"] if lines else 0.0)


def restart_due(others: list[LocalPeer], back_at: int, startup_s: float, killed_at: float) -> bool:
    """Whether the churned box, started now, would be back about when the swarm reaches ``back_at`` samples, given
    its first start-up's seconds and the others' own speed since the kill (the swarm's position is no speed: it
    counts the dead box's speed for a while after the kill, then waits for the counts to catch up)."""
    lines = freshest_steps(others)
    if lines and lines[-1]["swarm_samples"] >= back_at:
        return True
    speed = sum(own_speed(peer, killed_at) for peer in others)
    return speed > 0 and (back_at - lines[-1]["swarm_samples"]) / speed <= startup_s


def own_speed(peer: LocalPeer, since: float) -> float:
    """The samples per second ``peer`` trained since ``since``, over at least ``SPEED_WINDOW_S`` of its steps."""
    lines = [line for line in peer.progress() if line["time"] >= since]
    if len(lines) < 2 or lines[-1]["time"] - lines[0]["time"] < SPEED_WINDOW_S:
        return 0.0
    return (lines[-1]["own_samples"] - lines[0]["own_samples"]) / (lines[-1]["time"] - lines[0]["time"])


def back_in_swarm(box: LocalPeer, others: list[LocalPeer]) -> float | None:
    """When the restarted box logged its first step (or ended: the budget done as it came back); BenchError if the
    others finished before it came back, which would leave it to train the rest of the budget alone."""
    steps = [line for line in box.progress() if line["time"] >= box.started_at]
    if steps:
        return steps[0]["time"]
    if not box.is_running():
        return time.time()  # exited: a failure is reported by the caller's check of the exits
    if not any(peer.is_running() for peer in others):
        box.kill()
        raise BenchError(
            f"{box.name} was not back before the others finished the budget (restarted "
            f"{time.time() - box.started_at:.0f} s ago); its log: {box.log_path}"
        )
    return None


def churn_summary(churn: dict, steps_per_box: list[int], batch: int, budget: int) -> dict:
    """The record with what follows from the run's end: the churned box's steps after its rejoin, its share of the
    swarm's steps (it trained ``killed_at_step`` before the crash, ``resumed_step`` of which its checkpoint kept),
    the samples lost (steps not in any round: the swarm never got them; since the checkpoint: the box's own), and
    the part of the budget it was away."""
    after = steps_per_box[churn["box"]] - churn["resumed_step"]
    trained = [*steps_per_box]
    trained[churn["box"]] = churn["killed_at_step"] + after
    lost_steps = churn["killed_at_step"] - churn["resumed_step"]
    away = churn["swarm_samples_at_rejoin"] - (churn["swarm_samples_at_kill"] or 0)
    return {
        **churn,
        "steps_after_rejoin": after,
        "share_of_steps": round(trained[churn["box"]] / sum(trained), 4),
        "lost_steps": lost_steps,
        "lost_samples_of_box": lost_steps * batch,
        "lost_samples_of_swarm": churn["steps_not_in_a_round"] * batch,
        "away_share_of_budget": round(away / budget, 4),
    }


def crash_report(peers: list[LocalPeer]) -> str:
    """Every process that exited with an error, with the last error line of its log."""
    return "".join(
        f"\n  {peer.name} exited with code {peer.process.poll()} ({peer.log_path}): {last_error_line(peer)}"
        for peer in peers
        if peer.process is not None and peer.process.poll() not in (None, 0)
    )


def check_exits(mode: str, seed: int, peers: list[LocalPeer]) -> None:
    if report := crash_report(peers):
        raise BenchError(f"{mode} seed {seed}: a process failed{report}")


def last_error_line(peer: LocalPeer) -> str:
    lines = [line for line in peer.log_text().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["(empty log)"])[-1][:300]


# -------------------------------------------------------------------------------------------------- a run's records


def box_checkpoints(folder: Path, mode: str, plan: Plan) -> list[dict]:
    """A box's checkpoints along the run and its final one, in order: path, steps of the box, samples of the swarm
    (a swarm box's checkpoint holds the swarm's count; alone and ddp: steps x their global batch)."""
    finals = list(folder.glob("model_final_checkpoint*.torch"))
    if not finals:
        raise BenchError(f"{folder} holds no final checkpoint (model_final_checkpoint_*.torch): training did not end")
    found: dict[int, dict] = {}
    for path in [*folder.glob("model_iteration*.torch"), *finals]:  # the final one last: it wins a shared step
        state = torch.load(path, map_location="cpu", weights_only=False)  # our own benchmark's files
        steps = int(state["iteration"])
        progress = state["classy_state_dict"].get("swarm_progress")
        samples = int(progress["position"]) if progress else steps * plan.global_batch(mode)
        found[steps] = {"path": path, "steps": steps, "samples": samples, "final": path in finals}
    return [found[steps] for steps in sorted(found)]


def rounds_of(peer: LocalPeer) -> dict:
    """A swarm box's averaging rounds (its averaging_rounds.jsonl)."""
    records = read_jsonl(peer.checkpoint_dir / "averaging_rounds.jsonl")
    applied = [record for record in records if record.get("applied")]
    staleness = [record["staleness_steps"] for record in applied if record.get("staleness_steps") is not None]
    return {
        "applied": len(applied),
        "failed": len(records) - len(applied),
        "group_size_mean": _rounded(mean(r["group_size"] for r in applied)) if applied else None,
        "staleness_mean": _rounded(mean(staleness)) if staleness else None,
    }


def mean_curve(boxes: list[list[dict]], initial: InitialModel) -> list[dict]:
    """The run's curve: step 0 (the initial model), then the checkpoints every box has at the same step, then the
    boxes' final checkpoints; each point the mean over boxes."""
    common = set.intersection(*({point["steps"] for point in box if not point["final"]} for box in boxes))
    points = [{"steps": 0, "samples": 0, "knn": initial.knn, "heldout_loss": initial.heldout_loss}]
    groups = [[next(p for p in box if p["steps"] == steps) for box in boxes] for steps in sorted(common)]
    groups.append([box[-1] for box in boxes])
    for group in groups:
        points.append(
            {
                key: _rounded(mean(point[key] for point in group), 4 if key in ("knn", "heldout_loss") else 1)
                for key in ("steps", "samples", "knn", "heldout_loss")
            }
        )
    return points


def reached(curve: list[dict], target: float, axis: str) -> float | None:
    """Where the curve first reaches ``target`` kNN along ``axis`` (steps or samples); None if it never does."""
    at = crossing([(point[axis], point["knn"]) for point in curve], target)
    return None if at is None else round(at, 1)


def trunk_distance(paths: list[Path]) -> float | None:
    """Mean pairwise L2 distance of the boxes' final trunks (how far the swarm's boxes are apart at the end)."""
    from run_eval import load_trunk_state

    weights = [
        [tensor.double() for _, tensor in sorted(load_trunk_state(path).items()) if tensor.is_floating_point()]
        for path in paths
    ]
    distances = [
        math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True)))
        for a, b in itertools.combinations(weights, 2)
    ]
    return _rounded(mean(distances), 3) if distances else None


def evaluate_run(
    mode: str,
    seed: int,
    peers: list[LocalPeer],
    plan: Plan,
    evaluator: Evaluator,
    initial: InitialModel,
    wall_s: float,
    hivemind_target: int | None,
) -> dict:
    """Every box's checkpoints evaluated (kNN, held-out loss), the run's mean curve, steps, samples and rounds."""
    boxes, final_paths = [], []
    for peer in peers:
        points = box_checkpoints(peer.checkpoint_dir, mode, plan)
        final_paths.append(points[-1]["path"])
        for point in points:
            point.update(evaluator.evaluate(point.pop("path")))
        boxes.append(points)
    finals = [box[-1] for box in boxes]
    result = {
        "mode": mode,
        "seed": seed,
        "wall_s": round(wall_s, 1),
        "same_initial_model": started_from(mode, peers, initial),
        "knn": round(mean(point["knn"] for point in finals), 4),
        "knn_per_box": [point["knn"] for point in finals],
        "heldout_loss": round(mean(point["heldout_loss"] for point in finals), 4),
        "steps_per_box": [point["steps"] for point in finals],
        "samples_of_swarm": max(point["samples"] for point in finals),
        "curve": mean_curve(boxes, initial),
        "curves_per_box": [[{k: v for k, v in point.items() if k != "final"} for point in box] for box in boxes],
    }
    if mode in SWARM_MODES:
        rounds = [rounds_of(peer) for peer in peers]
        applied = [entry["applied"] for entry in rounds]
        ratios = [steps / count for steps, count in zip(result["steps_per_box"], applied, strict=True) if count]
        last_logged = [peer.progress()[-1] for peer in peers if peer.progress()]
        result.update(
            rounds_per_box=rounds,
            rounds_applied_per_box=applied,
            steps_per_round=_rounded(mean(ratios), 1) if ratios else None,
            trunk_distance=trunk_distance(final_paths),
            lr_factor=[entry.get("lr_factor") for entry in last_logged],
        )  # --swarm_lr scaling
        if mode == "hivemind_optimizer":
            result["hivemind_target_batch_size"] = hivemind_target
    return result


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def floor_runs(mode: str, seed: int, initial: InitialModel, raw_pixels: float | None) -> dict:
    value = initial.knn_adapted_bn if mode == "random_init" else raw_pixels
    return {"mode": mode, "seed": seed, "knn": value, "steps_per_box": [0], "samples_of_swarm": 0, "curve": []}


def hivemind_target_for(seed: int, runs: list[dict], plan: Plan, args: argparse.Namespace) -> tuple[int, str]:
    """hivemind_optimizer's samples per global epoch: rounds as often as ``swarm``'s (its measured local steps per
    applied round, same seed), else ``--hivemind_steps_per_round``."""
    measured = next(
        (
            run.get("steps_per_round")
            for run in runs
            if run["mode"] == "swarm" and run["seed"] == seed and "error" not in run
        ),
        None,
    )
    steps = measured or args.hivemind_steps_per_round
    source = f"swarm's {measured} steps per round" if measured else f"--hivemind_steps_per_round {steps:g}"
    return max(plan.batch, round(plan.boxes * plan.batch * steps)), source


def run_one(
    mode: str,
    seed: int,
    args: argparse.Namespace,
    plan: Plan,
    evaluator: Evaluator,
    initial: InitialModel,
    runs: list[dict],
    raw_pixels: float | None,
    eval_images: int,
) -> dict:
    if mode in FLOOR_ROWS:
        return floor_runs(mode, seed, initial, raw_pixels)
    env, target = {}, None
    if mode == "hivemind_optimizer":
        target, source = hivemind_target_for(seed, runs, plan, args)
        env[HIVEMIND_TARGET_ENV] = str(target)
        print(
            f"hivemind_optimizer seed {seed}: a global epoch every {target} samples of the swarm ({source})", flush=True
        )
    peers = make_peers(mode, seed, args.out, plan, env, pace_of(mode, args))
    deadline_s = 4 * estimated_seconds(mode, plan, eval_images, pace_of(mode, args)) + 600
    wall_s, churned = train(mode, seed, peers, args, plan, initial, deadline_s)
    result = evaluate_run(mode, seed, peers, plan, evaluator, initial, wall_s, target)
    if churned is not None:
        result["churn"] = churn_summary(churned, result["steps_per_box"], plan.batch, plan.budget_samples)
    if not result["same_initial_model"]:
        print(
            f"warning: {mode} seed {seed}: not every process logged starting from {initial.path} (trunk "
            f"{initial.trunk_fingerprint}); logs: {peers[0].out_dir}",
            file=sys.stderr,
            flush=True,
        )
    return result


# ----------------------------------------------------------------------------------------------------- reports


def summarize(mode: str, runs: list[dict], alone: dict[int, float]) -> dict:
    """Mean ± std over the seeds that finished; the steps (and samples) at which a seed's curve reaches the same
    seed's alone kNN."""
    done = [run for run in runs if "error" not in run]
    summary: dict[str, Any] = {"mode": mode, "seeds": len(done), "failed": len(runs) - len(done)}
    if not done:
        return summary
    knn, knn_std = spread([run["knn"] for run in done])
    summary.update(knn_mean=_rounded(knn), knn_std=_rounded(knn_std))
    if mode in FLOOR_ROWS:
        return summary
    reach = [
        (reached(run["curve"], alone[run["seed"]], "steps"), reached(run["curve"], alone[run["seed"]], "samples"))
        for run in done
        if run["seed"] in alone
    ]
    reached = [pair for pair in reach if pair[0] is not None]
    summary.update(
        heldout_loss_mean=_rounded(mean(run["heldout_loss"] for run in done)),
        steps_per_box_mean=round(mean(s for run in done for s in run["steps_per_box"]), 1),
        samples_of_swarm_mean=round(mean(run["samples_of_swarm"] for run in done), 1),
        seeds_reaching_alone=len(reached),
        seeds_compared_with_alone=len(reach),
        steps_to_alone_mean=_rounded(mean(p[0] for p in reached), 1) if reached else None,
        samples_to_alone_mean=_rounded(mean(p[1] for p in reached), 1) if reached else None,
        curve=curve_over_seeds([run["curve"] for run in done]),
    )
    if mode in SWARM_MODES:
        ratios = [run["steps_per_round"] for run in done if run.get("steps_per_round") is not None]
        summary.update(
            steps_per_round_mean=_rounded(mean(ratios), 1) if ratios else None,
            rounds_per_box_mean=round(mean(a for run in done for a in run["rounds_applied_per_box"]), 1),
        )
    if churns := [run["churn"] for run in done if "churn" in run]:
        summary["churn_mean"] = {key: _rounded(mean(churn[key] for churn in churns)) for key in CHURN_MEANS}
    return summary


def curve_over_seeds(curves: list[list[dict]]) -> list[dict]:
    """Point k of every seed's curve (seeds share the checkpoint schedule), mean ± std."""
    points = []
    for group in zip(*curves, strict=False):
        point = {key: _rounded(mean(p[key] for p in group), 1) for key in ("steps", "samples")}
        for key in ("knn", "heldout_loss"):
            value, std = spread([p[key] for p in group])
            point[key], point[f"{key}_std"] = _rounded(value), _rounded(std)
        points.append(point)
    return points


def markdown(summaries: list[dict]) -> str:
    def cell(value: Any, digits: int = 1) -> str:
        return "—" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))

    rows = []
    for summary in summaries:
        row = {
            "mode": summary["mode"],
            "kNN top-1 (mean ± std)": "—",
            "seeds": summary["seeds"],
            "steps per box": "—",
            "samples of the swarm": "—",
            "steps per box to alone's kNN": "—",
            "held-out SwAV loss": "—",
            "local steps per round": "—",
            "rounds per box": "—",
        }
        if summary["failed"]:
            row["seeds"] = f"{summary['seeds']} ({summary['failed']} failed)"
        if summary["seeds"]:
            row["kNN top-1 (mean ± std)"] = f"{summary['knn_mean']:.4f} ± {cell(summary['knn_std'], 4)}"
        if summary["seeds"] and summary["mode"] not in FLOOR_ROWS:
            reached, compared = summary["seeds_reaching_alone"], summary["seeds_compared_with_alone"]
            to_alone = (
                "—"
                if not compared
                else (
                    "not reached"
                    if not reached
                    else f"{summary['steps_to_alone_mean']:g}"
                    + (f" ({reached}/{compared} seeds)" if reached < compared else "")
                )
            )
            row.update(
                {
                    "steps per box": f"{summary['steps_per_box_mean']:g}",
                    "samples of the swarm": f"{summary['samples_of_swarm_mean']:g}",
                    "steps per box to alone's kNN": to_alone,
                    "held-out SwAV loss": cell(summary["heldout_loss_mean"], 4),
                    "local steps per round": cell(summary.get("steps_per_round_mean")),
                    "rounds per box": cell(summary.get("rounds_per_box_mean")),
                }
            )
        rows.append(row)
    return markdown_table(rows)


def plot(summaries: list[dict], path: Path, title: str) -> None:
    """kNN and held-out loss (rows) against samples of the swarm and steps per box (columns), mean ± std over seeds;
    the floors as horizontal lines."""
    figure, axes = pyplot().subplots(2, 2, figsize=(12, 8))
    for summary in summaries:
        if not summary["seeds"]:
            continue
        if summary["mode"] in FLOOR_ROWS:
            for axis in axes[0]:
                axis.axhline(
                    summary["knn_mean"], color="gray", linestyle=FLOOR_ROWS[summary["mode"]], label=summary["mode"]
                )
            continue
        curve = summary["curve"]
        for row, key in enumerate(("knn", "heldout_loss")):
            for column, axis_key in enumerate(("samples", "steps")):
                axis = axes[row][column]
                xs = [point[axis_key] for point in curve]
                ys = [point[key] for point in curve]
                stds = [point[f"{key}_std"] or 0.0 for point in curve]
                (line,) = axis.plot(xs, ys, marker="o", markersize=3, label=summary["mode"])
                axis.fill_between(
                    xs,
                    [y - s for y, s in zip(ys, stds, strict=True)],
                    [y + s for y, s in zip(ys, stds, strict=True)],
                    color=line.get_color(),
                    alpha=0.15,
                )
    for row, label in enumerate(("kNN top-1 on val", "held-out SwAV loss")):
        for column, xlabel in enumerate(("samples the swarm processed", "steps per box")):
            axis = axes[row][column]
            axis.set_xlabel(xlabel)
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle(title)
    save_figure(figure, path)


def paired_differences(runs: list[dict]) -> list[dict]:
    """``variant − reference`` seed by seed (the same initial model), for each pair of ``PAIRED`` that ran: final kNN
    and held-out loss, each seed's difference and their mean ± std over the seeds where both finished."""
    done = {(run["mode"], run["seed"]): run for run in runs if "error" not in run}
    differences = []
    for variant, reference in PAIRED:
        entry: dict[str, Any] = {"variant": variant, "reference": reference}
        for key in ("knn", "heldout_loss"):
            arm = {
                mode: {seed: run[key] for (m, seed), run in done.items() if m == mode} for mode in (variant, reference)
            }
            entry[key] = paired_difference(arm[variant], arm[reference])
        if entry["knn"] is not None:
            entry["seeds"] = entry["knn"]["seeds"]
            differences.append(entry)
    return differences


def differences_markdown(differences: list[dict]) -> str:
    def signed(stats: dict) -> str:
        std = f" ± {stats['std']:.4f}" if stats["std"] is not None else ""
        return f"{stats['mean']:+.4f}{std} (per seed {', '.join(f'{d:+.4f}' for d in stats['per_seed'])})"

    return "\n".join(
        f"- {e['variant']} − {e['reference']}, seed by seed (n={len(e['seeds'])}, mean ± std): kNN "
        f"{signed(e['knn'])}; held-out SwAV loss {signed(e['heldout_loss'])}"
        for e in differences
    )


def churn_row(seed: int, churn: dict) -> dict:
    """A swarm_churn seed in the report: where the box left and came back, and what it lost."""
    return {
        "seed": seed,
        "box killed at step (planned)": f"{churn['killed_at_step']} ({churn['kill_step_planned']})",
        "resumed checkpoint's step": churn["resumed_step"],
        "lost steps of the box (samples)": f"{churn['lost_steps']} ({churn['lost_samples_of_box']})",
        "steps in no round (samples)": f"{churn['steps_not_in_a_round']} ({churn['lost_samples_of_swarm']})",
        "swarm samples at kill / restart / rejoin (planned rejoin)": (
            f"{churn['swarm_samples_at_kill']} / {churn['swarm_samples_at_restart']} / "
            f"{churn['swarm_samples_at_rejoin']} ({churn['back_at_samples_planned']})"
        ),
        "away, share of the budget": churn["away_share_of_budget"],
        "restart s (first start s)": f"{churn['restart_s']} ({churn['first_startup_s']})",
        "box steps after rejoin": churn["steps_after_rejoin"],
        "box share of the swarm's steps": churn["share_of_steps"],
    }


def report_markdown(summaries: list[dict], differences: list[dict], runs: list[dict]) -> str:
    """The table of modes, then the paired differences and the churn's rows where there are any."""
    parts = [markdown(summaries)]
    if differences:
        parts.append(differences_markdown(differences))
    churns = [run for run in runs if "churn" in run]
    if churns:
        box = churns[0]["churn"]["box"]
        headline = f"swarm_churn, per seed: box {box} crashed at a third of its steps and came back (README's restart)"
        parts.append(headline)
        parts.append(markdown_table([churn_row(run["seed"], run["churn"]) for run in churns]))
    return "\n\n".join(parts)


def write_outputs(args: argparse.Namespace, settings: dict, runs: list[dict]) -> tuple[list[dict], list[dict]]:
    alone = {run["seed"]: run["knn"] for run in runs if run["mode"] == "alone" and "error" not in run}
    summaries = [
        summarize(mode, [run for run in runs if run["mode"] == mode], alone)
        for mode in args.modes
        if any(run["mode"] == mode for run in runs)
    ]
    differences = paired_differences(runs)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = {"settings": settings, "summary": summaries, "differences": differences, "runs": runs}
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return summaries, differences


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args = resolve_args(args)
        plan = make_plan(args)
        args.out = fresh_out_dir(args.out)
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # one thread for the evaluations: with two, a busy machine makes each 10x slower (OpenMP threads spinning)
    torch.set_num_threads(1)
    seeds = list(range(args.seeds))
    val_images = count_images(args.data_path / "val")
    bank = min(args.knn_train, plan.train_images) if args.knn_train else plan.train_images
    eval_images = bank + val_images
    trained = [mode for mode in args.modes if mode in TRAINED]
    expected = eval_images * DECODE_S_PER_IMAGE + len(seeds) * (
        3 * eval_images * EVAL_S_PER_IMAGE
        + sum(estimated_seconds(mode, plan, eval_images, pace_of(mode, args)) for mode in args.modes)
    )
    print(
        f"{len(args.modes)} modes x {len(seeds)} seeds: {plan.config} on {args.data_path}, {plan.epochs} epochs of "
        f"{plan.data_limit} images = {plan.budget_samples} samples per run ({plan.alone_steps} steps alone at batch "
        f"{plan.batch}, ~{plan.shared_steps} per box of {plan.boxes}), kNN bank {bank} / {val_images} queries, "
        f"into {args.out}; expected about {expected / 60:.0f} min on a busy 2-core machine",
        flush=True,
    )
    settings = {
        "git": git_state(),
        "command": sys.argv if argv is None else ["bench_learning.py", *argv],
        "dataset": {
            "path": str(args.data_path),
            "train_images": plan.train_images,
            "val_images": val_images,
            "knn_bank": bank,
        },
        "recipe": {
            **asdict(plan),
            "alone_steps": plan.alone_steps,
            "shared_steps": plan.shared_steps,
            "budget_samples": plan.budget_samples,
            "overrides": args.override,
            "checkpoint_every": {mode: plan.checkpoint_every(mode) for mode in trained},
        },
        "averaging": {
            "slow_averaging": args.slow_averaging,
            "min_matchmaking_time": args.min_matchmaking_time,
            "hivemind_steps_per_round": args.hivemind_steps_per_round,
            "churn_pace_s": {mode: pace_of(mode, args) for mode in PACED_MODES if mode in args.modes},
        },
        "heldout": {"images": args.heldout_images, "batch": args.heldout_batch},
        "seeds": seeds,
        "out": str(args.out),
    }
    evaluator = Evaluator(
        plan.config, args.override, args.data_path, args.knn_train, args.heldout_images, args.heldout_batch
    )
    settings["evaluation"] = evaluator.sizes
    raw_pixels = round(evaluator.raw_pixels(), 4) if "raw_pixels" in args.modes else None
    runs: list[dict] = []
    for seed in seeds:
        initial = write_initial_model(seed, args.out / "initial", plan.config, args.override, evaluator)
        settings.setdefault("initial_models", {})[seed] = {
            "knn": initial.knn,
            "heldout_loss": initial.heldout_loss,
            "knn_adapted_bn": initial.knn_adapted_bn,
        }
        for mode in args.modes:
            try:
                run = run_one(mode, seed, args, plan, evaluator, initial, runs, raw_pixels, eval_images)
            except BenchError as error:  # e.g. one mode crashing: report it, keep measuring the others
                print(f"error: {error}", file=sys.stderr, flush=True)
                run = {"mode": mode, "seed": seed, "error": str(error)}
            runs.append(run)
            shown = {k: v for k, v in run.items() if k not in ("curve", "curves_per_box", "rounds_per_box")}
            print(f"{mode} seed {seed}: {json.dumps(shown)}", flush=True)
            write_outputs(args, settings, runs)  # partial results survive an interrupted benchmark
    summaries, differences = write_outputs(args, settings, runs)
    table = report_markdown(summaries, differences, runs)
    print(table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    if args.plot:
        regime = "slow averaging" if args.slow_averaging else f"matchmaking {args.min_matchmaking_time:g} s"
        plot(
            summaries,
            args.plot,
            f"{plan.config}, {plan.epochs} epochs of {plan.data_limit} images, {plan.boxes} "
            f"boxes x batch {plan.batch}, {regime}; mean ± std over {len(seeds)} seed(s)",
        )
    return 0 if all("error" not in run for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
