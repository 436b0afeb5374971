#!/usr/bin/env python3
"""Does a swarm of 3 peers reach one peer's result sooner? The optimizer alone, in a plain PyTorch loop.

    nice -n 10 .venv/bin/python benchmarks/bench_optimizer.py --json benchmarks/results/optimizer.json \
        --markdown benchmarks/results/optimizer.md --plot benchmarks/results/optimizer.png

Why this benchmark: ``bench_learning.py`` measures SwAV in VISSL, where collapse and a tiny dataset hide what the
averaging does. Here the task rewards more samples: a small CNN (2 strided convs + 2 fc, ~0.1M parameters, a
couple of ms per step on one CPU thread) classifies Fashion-MNIST (60k training images, test accuracy on the 10k
test set; read from the IDX files of Debian's ``dataset-fashion-mnist``). SGD with momentum, a linear warm-up and a
cosine decay over a fixed budget of SAMPLES ``S`` (``--samples``). Every peer is a separate process (its own
session, killed as a whole afterwards), hivemind peers listen on 127.0.0.1 only, each with its own DHT; peer 0
bootstraps, the others join through its visible multiaddrs. The peers of a run start training at the same
instant (a file barrier), from the same initial model (``torch.manual_seed(seed)``: the same in every mode), and
each peer has its own data order (peer ``i`` of seed ``s`` shuffles with ``1000·s + i``).

Modes:
  alone               one peer trains the whole budget: S samples at batch B, the LR schedule over its own steps.
  swarm               3 peers with ``decentralized_sgd.DecentralizedSGD`` (default settings but target_group_size 3,
                      compression none, ``min_matchmaking_time`` 1 s). A full group forms as soon as its 3 peers are
                      in (min_matchmaking_time only holds back a group that is not full), so on loopback rounds
                      follow one another every few tenths of a second: ~20 local steps per round, as measured.
  old                 the same with the old design, ``baselines.old_design.OldDesignAverager`` (hivemind's
                      TrainingAverager one round at a time); its lock is held from forward to step
                      (``needs_lock_for_forward``: it applies a round from its own thread).
  hivemind_optimizer  ``hivemind.Optimizer(use_local_updates=True)`` set up as its docstring tells a user: its own
                      DHT, a run_id, batch_size_per_step=B, target_batch_size = the swarm's samples in as few
                      local steps as hivemind can keep up with (``--hivemind_target_batch_size``, see "Defaults":
                      its global epoch, at which it averages parameters, ``average_state_every=1``; it cannot be
                      made as short as one of DecentralizedSGD's rounds), matchmaking_time = the regime's
                      min_matchmaking_time, averaging_timeout 15 s. Its LR is driven by this loop from the swarm
                      position at every step, as in the other modes, and no ``scheduler`` is passed: hivemind steps a
                      scheduler once per global epoch (``target_batch_size`` samples), which would turn the cosine
                      into a staircase of ~a dozen steps and make this mode's schedule differ from the others'.
  ddp                 torch.distributed over gloo, 3 local processes on 127.0.0.1: synchronous, global batch 3B,
                      S/3 samples per process, the LR scaled linearly for the global batch (x3): the reference.
  ideal               the swarm's 3 peers as replicas in one process (``ideal_swarm``), averaged exactly and all
                      together every H local steps (``--ideal_period``, ``--slowed_ideal_period``: the swarm's
                      measured median steps per round in each regime), no hivemind: swarm − ideal at the same H is
                      what the system costs, ideal − ddp what periodic averaging costs (the table "Where the gap to
                      ddp goes").

Paced steps: an averaging peer's step lasts at least ``--min_step_s`` (15 ms; the rest of the step is a sleep), as
a box whose accelerator takes a fixed time per step. Why: unpaced, on a 2-core machine shared with other work, the
3 peers' ~5 ms CPU steps ran at very different speeds (one peer finished its 1250 steps in 9 s, another in 30 s), so
peers trained much of their run without partners, a peer's schedule position (local steps x 3) no longer matched
the swarm's, and steps per round ranged from 22 to 312 between runs of the same setting: the LR rules could not be
compared. Paced, the peers keep step and the averaging frequency is set by the regime. Alone and ddp are not paced
(no averaging runs beside them; ddp is synchronous). Nothing is measured in wall time either way.

The SWARM-WIDE schedule: in every swarm mode the budget S is the swarm's total, so each of the 3 equal peers
trains S/3 samples, and the LR schedule's position is the swarm's samples: a peer's local steps times the swarm's
total batch per step (for equal peers local_samples x 3). That is what the product's swarm schedule gives equal
boxes (the schedule follows the swarm's progress, not the box's own). The position is nominal: it assumes the
peers advance at the same pace, which the start barrier and equal work make nearly true.

How each peer's LR scales with the swarm's total batch (``--swarm_lr``), with peak LR ``lr`` for
batch B (``--lr``) and a box's own LR ``lr·b/B`` for its batch b (linear per box, as ``recipe.scale_lr``):
  box     every peer keeps the LR of its own batch (lr·b/B);
  sqrt    lr·b/B · sqrt(total batch / b);
  linear  lr · total batch / B, as DDP does for the global batch.

Experiments (``--experiments``):
  main       the modes (``--modes``; default all) at ``--swarm_lr`` (>= 5 seeds).
  lr         swarm at every rule of ``--lr_rules`` (the main rule's runs are shared with main).
  weighting  the unequal swarm: peer 2 at batch 2B, peers 0 and 1 at B and twice as slow per sample (each of their
             steps is followed by a sleep as long as the step: all three step at about the same rate, as boxes of
             which one is twice as fast; the sleep costs no CPU and nothing is measured in wall time). The budget
             is still S: the 2B peer trains S/2, the others S/4 each, all the same number of steps, and the schedule
             position is local steps x 4B. DecentralizedSGD with equal weights against ``weight_by_samples=True``
             (each peer weighted by its samples since the previous round).
  slowed     swarm with target_group_size 4 (never full with 3 peers, so a group forms only after
             min_matchmaking_time) and ``--slowed_min_matchmaking_time`` (4 s): rounds far apart, ~100-400 local
             steps per round on this machine, the ratio real ResNet-50 boxes at 100 Mbit/s see; at every rule of
             ``--slowed_lr_rules``: does the LR result carry over? (A larger min_matchmaking_time alone would change
             nothing: the groups are full.)
  ideal      the ideal swarm in both regimes (``--seeds`` seeds).
  outer      DecentralizedSGD's outer optimizer (``--outer_momentum``, ``--outer_lr``, ``--outer_nesterov``: Nesterov
             b 0.5, a 0.7 by default), swarm and ideal, main and slowed regimes, each beside the same without it.

Recorded: test accuracy at ``--curve_points`` points along each peer's run (and its initial model) against the
samples the whole swarm processed and against steps per peer; per peer the local steps per applied averaging round
(hivemind_optimizer: per successful state averaging, counted from its log); per run the mean over peers. The JSON
holds the git commit (``git rev-parse HEAD`` and a dirty flag), the dataset, the settings, every run and peer.
The table gives, per variant, the final test accuracy (mean over a run's peers, then mean ± std over seeds), the
speed-up over alone (alone's steps to the end of its run / the steps per peer at which the variant's mean curve
first reaches alone's mean final accuracy, interpolated linearly; "not reached" if never; and the same for alone's
accuracy at half and at a third of its run: a swarm that ends short of alone's final accuracy still shows how far
it got, and a third of alone's run is the steps a swarm peer takes, so a speed-up below 1x there means the swarm
did worse than one peer alone in the same steps), and the final accuracy against ddp's at the same samples.
Nothing is measured in wall time: the averaging frequency depends on the machine's load, so steps per round are
reported as measured. Run it under ``nice -n 10``; every peer runs with OMP_NUM_THREADS=1.

``--quick``: 24k samples, 1 seed, 4 curve points, the ``--modes`` given (default alone swarm), and every averaging
peer's step paced to at least 100 ms, so that a swarm peer trains long enough (~25 s) to average a few times on any
machine. Paced to 40 ms (~10 s), a swarm's peers applied 11, 11, 10 rounds and 3, 3, 1 beside the test suite, and
one peer none in a suite's run; the pace is a sleep: it costs no CPU. ``--resume JSON``: keep that file's finished
runs (same settings) and run only the rest of the plan.

Defaults and how they were chosen (on this 2-core machine, loaded by other work): peak LR 0.025 at B = 32 is the
best of 0.0125 / 0.025 / 0.05 / 0.1 for alone (S = 180k, 1-2 seeds: 0.895 / 0.901 / 0.894 / 0.871); --swarm_lr sqrt
was the best of the three rules in a 1-seed trial (box 0.880, sqrt 0.884, linear 0.879 at S = 180k); the lr table
is the measurement (those trials were not paced). S = 120k keeps the whole benchmark near 100 minutes on the
loaded machine while alone's curve is still rising at a third of its run (0.868 at a third, 0.90 at the end, S =
180k). --hivemind_target_batch_size 6144 (64 steps of the 3 peers' 32 samples): paced, hivemind's progress tracker
lands near this nominal epoch (72 local steps per epoch, 1 seed at 25 ms steps). That is ~3x the local steps of one
DecentralizedSGD round here (~25), but a smaller target is not usable: at 2304 (24 steps' worth, about one round)
the tracker, which extrapolates every peer's throughput between its 0.5 s refreshes, started a new epoch every few
local steps, and each epoch's averaging blocks hivemind's trainer (its local step waits for the pending round:
state_averager.step with the delta rule): > 360 rounds and 8 minutes into a run that trains 19 s, we stopped it.
Unpaced, 6144 gave epochs every ~13 steps. Steps per round are reported as measured.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gzip
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean, median, stdev
from typing import Any

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from optimizer_churn import (  # noqa: E402 (benchmarks/ is not a package)
    CHECKPOINT_EVERY,
    PROGRESS_EVERY,
    ChurnPlan,
    ProgressFiles,
    crash,
    load_checkpoint,
    save_checkpoint,
)

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
IDX_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
PIXEL_MEAN, PIXEL_STD = 0.2860, 0.3530  # Fashion-MNIST's training-set statistics
MODES = ("alone", "swarm", "old", "hivemind_optimizer", "ddp", "ideal")
SWARM_MODES = ("swarm", "old", "hivemind_optimizer")  # averaging peers: steps per round and the swarm_lr rule apply
LR_RULES = ("box", "sqrt", "linear")
EXPERIMENTS = ("main", "lr", "weighting", "slowed", "ideal", "outer", "churn")
LOCAL = "/ip4/127.0.0.1/tcp/0"
EVAL_CHUNK = 2000
# rough costs on the 2-core machine when quiet, for the estimate printed at start and each run's deadline: start-up
# and shutdown of a run's processes, and CPU seconds per training sample of the whole run (3 peers share 2 cores)
STARTUP_S = {"alone": 6.0, "ddp": 10.0, "swarm": 25.0, "old": 20.0, "hivemind_optimizer": 25.0, "ideal": 5.0}
CPU_S_PER_SAMPLE = {
    "alone": 70e-6,
    "ddp": 60e-6,
    "swarm": 60e-6,
    "old": 60e-6,
    "hivemind_optimizer": 70e-6,
    "ideal": 180e-6,  # 3 replicas in one thread
}
MODE_SETTINGS = {"hivemind_target_batch_size": "hivemind_optimizer", "hivemind_averaging_timeout": "hivemind_optimizer"}
SETUP_TIMEOUT_S = 180.0  # processes started, DHTs joined, optimizers built (a loaded machine is slow at this)
JOIN_TIMEOUT_S = 60.0  # how long a peer dials peer 0 (our peers: swarm.start_dht)
SHUTDOWN_GRACE_S = 30.0  # DecentralizedSGD's shutdown deadline is 17 s; then the run's sessions are killed


# ----------------------------------------------------------------------------------------------------- data, model


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzip): magic (0, 0, dtype 0x08 = uint8, ndim), ndim big-endian uint32 sizes, the data."""
    with gzip.open(path, "rb") as file:
        raw = file.read()
    if raw[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (magic {raw[:4].hex()})")
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


@dataclass
class FashionMNIST:
    """Training images stay uint8 (47 MB; each batch is normalized when drawn), the test set is normalized once."""

    train_images: torch.Tensor  # uint8 [60000, 28, 28]
    train_labels: torch.Tensor  # int64 [60000]
    test_images: torch.Tensor  # float32 [10000, 1, 28, 28], normalized
    test_labels: torch.Tensor  # int64 [10000]

    @classmethod
    def load(cls, folder: Path) -> FashionMNIST:
        arrays = {name: read_idx(folder / file) for name, file in IDX_FILES.items()}
        return cls(
            torch.from_numpy(arrays["train_images"].copy()),
            torch.from_numpy(arrays["train_labels"].astype(np.int64)),
            normalize(torch.from_numpy(arrays["test_images"].copy())),
            torch.from_numpy(arrays["test_labels"].astype(np.int64)),
        )


def normalize(images: torch.Tensor) -> torch.Tensor:
    return ((images.float() / 255.0 - PIXEL_MEAN) / PIXEL_STD).unsqueeze(1)


def make_model(seed: int) -> nn.Sequential:
    """2 strided convs + 2 fc (~0.1M parameters, ~2 ms per step of 32 on one thread). No BatchNorm on purpose: every
    mode then averages the same tensors (hivemind.Optimizer averages parameters only, DDP broadcasts rank 0's
    buffers), so the comparison is about the averaging of the weights. The seed fixes the initial model."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, stride=2, padding=2),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


@torch.no_grad()
def test_accuracy(model: nn.Module, data: FashionMNIST) -> float:
    model.eval()
    correct = sum(
        int((model(data.test_images[i : i + EVAL_CHUNK]).argmax(1) == data.test_labels[i : i + EVAL_CHUNK]).sum())
        for i in range(0, len(data.test_labels), EVAL_CHUNK)
    )
    model.train()
    return correct / len(data.test_labels)


class Batches:
    """This peer's own data order: a fresh permutation of the training set every epoch (without replacement)."""

    def __init__(self, data: FashionMNIST, seed: int):
        self.data, self.generator = data, torch.Generator().manual_seed(seed)
        self.order, self.at = torch.randperm(len(data.train_labels), generator=self.generator), 0

    def next(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.at + size > len(self.order):
            self.order, self.at = torch.randperm(len(self.data.train_labels), generator=self.generator), 0
        index = self.order[self.at : self.at + size]
        self.at += size
        return normalize(self.data.train_images[index]), self.data.train_labels[index]


# ----------------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Settings:
    """The budget and the recipe, the same for every run of an invocation."""

    samples: int = 120_000  # S, the swarm's total
    batch: int = 32  # B
    lr: float = 0.025  # peak LR at batch B (the best of 0.0125, 0.025, 0.05, 0.1 for alone, 2 seeds)
    momentum: float = 0.9
    warmup: float = 0.05  # share of the budget
    peers: int = 3
    curve_points: int = 8
    min_matchmaking_time: float = 1.0  # the main regime
    slowed_min_matchmaking_time: float = 4.0
    hivemind_target_batch_size: int = 6_144  # 64 steps of the 3 peers: see the docstring
    hivemind_averaging_timeout: float = 15.0
    min_step_s: float = 0.015  # every averaging peer's step lasts at least this long (a sleep): see the docstring
    data_dir: str = str(DATA_DIR)


@dataclass(frozen=True)
class RunSpec:
    """One run: a mode with its options and a seed."""

    mode: str
    seed: int
    swarm_lr: str = "box"
    unequal: bool = False  # peer 2 at batch 2B, the others at B and half speed (experiment weighting)
    weight_by_samples: bool = False
    min_matchmaking_time: float = 1.0
    target_group_size: int = 3  # slowed: 4 > 3 peers, so that a group forms only after min_matchmaking_time
    regime: str = "loopback"  # "slowed": rounds far apart
    period: int = 0  # ideal: local steps between its exact rounds (the swarm's measured steps per round)
    outer_momentum: float = 0.0  # DecentralizedSGD's outer optimizer (swarm and ideal); 0 and 1: off
    outer_lr: float = 1.0
    outer_nesterov: bool = False
    churn: str = ""  # "kill" | "pause": the last peer is away for the middle third of the run (optimizer_churn)
    pace_s: float = 0.0  # > 0: this run's min_step_s (churn: long enough for a restarted process to come back)

    @property
    def variant(self) -> str:
        """What the tables group seeds by."""
        if self.mode in ("alone", "ddp"):
            return self.mode
        name = f"{self.mode} [{self.swarm_lr}]"
        if self.mode == "ideal":
            name += f" H={self.period}"
        if self.outer_momentum or self.outer_lr != 1.0:
            kind = "nesterov" if self.outer_nesterov else "slowmo"
            name += f" outer {kind} b={self.outer_momentum:g} a={self.outer_lr:g}"
        if self.churn:
            name += f" churn {self.churn}"
        if self.pace_s:
            name += f" paced {1000 * self.pace_s:g} ms"
        if self.unequal:
            name += " unequal, " + ("weight_by_samples" if self.weight_by_samples else "equal weights")
        if self.regime != "loopback":
            name += f" {self.regime}"
        return name

    def processes(self, settings: Settings) -> int:
        return 1 if self.mode in ("alone", "ideal") else settings.peers

    def batches(self, settings: Settings) -> list[int]:
        """Each peer's batch; unequal: the last peer at 2B."""
        count = 1 if self.mode == "alone" else settings.peers
        return [settings.batch * (2 if self.unequal and rank == count - 1 else 1) for rank in range(count)]

    def total_batch(self, settings: Settings) -> int:
        """The swarm's samples per step of every peer: what one step moves the schedule's position by."""
        return sum(self.batches(settings))

    def steps(self, settings: Settings) -> int:
        """Steps per peer: the budget S over the swarm's total batch (alone: S / B)."""
        return max(1, settings.samples // self.total_batch(settings))

    def peak_lr(self, settings: Settings, rank: int) -> float:
        own, total = self.batches(settings)[rank], self.total_batch(settings)
        box = settings.lr * own / settings.batch
        if self.mode == "alone":
            return box
        if self.mode == "ddp" or self.swarm_lr == "linear":
            return settings.lr * total / settings.batch
        return box * math.sqrt(total / own) if self.swarm_lr == "sqrt" else box

    def slowdown(self, settings: Settings, rank: int) -> float:
        """A step followed by a sleep of (slowdown - 1) times its own duration: the slower boxes of unequal."""
        return 2.0 if self.unequal and self.batches(settings)[rank] == settings.batch else 1.0


def lr_at(position: int, settings: Settings, peak: float) -> float:
    """Warm-up (linear from ~0) over the first ``warmup`` share of S samples, then a cosine to 0 at S. ``position``:
    the samples the swarm has processed before this step."""
    warm = max(1.0, settings.warmup * settings.samples)
    if position < warm:
        return peak * (position + settings.batch) / (warm + settings.batch)
    progress = min(1.0, (position - warm) / max(1.0, settings.samples - warm))
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def checkpoint_steps(steps: int, points: int) -> list[int]:
    """Steps after which a peer evaluates (0: the initial model)."""
    return sorted({round(steps * k / points) for k in range(points + 1)})


def plan(args: argparse.Namespace, settings: Settings) -> list[RunSpec]:
    """The runs of an invocation, the main rule's swarm runs shared by main and lr."""
    runs: list[RunSpec] = []
    loopback = dict(min_matchmaking_time=settings.min_matchmaking_time)

    def add(spec: RunSpec) -> None:
        if spec not in runs:
            runs.append(spec)

    seeds = range(args.seeds)
    if "main" in args.experiments:
        for mode in args.modes:
            for seed in seeds:
                period = args.ideal_period if mode == "ideal" else 0
                add(RunSpec(mode, seed, swarm_lr=args.swarm_lr, period=period, **loopback))
    if "lr" in args.experiments:
        for rule in args.lr_rules:
            for seed in seeds:
                add(RunSpec("swarm", seed, swarm_lr=rule, **loopback))
    if "weighting" in args.experiments:
        for by_samples in (False, True):
            for seed in range(args.weighting_seeds):
                add(
                    RunSpec(
                        "swarm", seed, swarm_lr=args.swarm_lr, unequal=True, weight_by_samples=by_samples, **loopback
                    )
                )
    slowed = dict(
        regime="slowed",
        target_group_size=settings.peers + 1,
        min_matchmaking_time=settings.slowed_min_matchmaking_time,
    )
    periods = {"loopback": args.ideal_period, "slowed": args.slowed_ideal_period}
    outer = dict(outer_momentum=args.outer_momentum, outer_lr=args.outer_lr, outer_nesterov=args.outer_nesterov)
    for seed in seeds if "ideal" in args.experiments or "outer" in args.experiments else ():
        for regime, period in periods.items():
            with_outer = [{}, outer] if "outer" in args.experiments else [{}]
            for options in with_outer:
                add(RunSpec("ideal", seed, swarm_lr=args.swarm_lr, regime=regime, period=period, **options))
        if "outer" in args.experiments:
            add(RunSpec("swarm", seed, swarm_lr=args.swarm_lr, **loopback, **outer))
            add(RunSpec("swarm", seed, swarm_lr=args.swarm_lr, **loopback))
            add(RunSpec("swarm", seed, swarm_lr=args.swarm_lr, **slowed, **outer))
            add(RunSpec("swarm", seed, swarm_lr=args.swarm_lr, **slowed))
    if "churn" in args.experiments:
        paced = dict(pace_s=args.churn_pace_s, **loopback)
        for seed in seeds:
            for churn in ("kill", "pause"):
                add(RunSpec("swarm", seed, swarm_lr=args.swarm_lr, churn=churn, **paced))
            add(RunSpec("swarm", seed, swarm_lr=args.swarm_lr, **paced))
    if "slowed" in args.experiments:
        for rule in args.slowed_lr_rules:
            for seed in range(args.slowed_seeds):
                add(
                    RunSpec(
                        "swarm",
                        seed,
                        swarm_lr=rule,
                        regime="slowed",
                        target_group_size=settings.peers + 1,
                        min_matchmaking_time=settings.slowed_min_matchmaking_time,
                    )
                )
    return sorted(runs, key=lambda spec: spec.seed)  # seed by seed: a run cut short still compares every variant


def estimated_seconds(spec: RunSpec, settings: Settings) -> float:
    """Quiet 2-core machine: start-up, the run's training (CPU over 2 cores; unequal: the slow peers' sleeps), its
    evaluations (~0.25 s each), and the pacing of --quick."""
    processes = spec.processes(settings)
    cpu = CPU_S_PER_SAMPLE[spec.mode] * settings.samples / min(2, processes)
    if spec.unequal:
        cpu *= 1.5
    evals = 0.25 * (settings.curve_points + 1) * (1 if spec.mode == "ddp" else processes) / min(2, processes)
    paced = spec.steps(settings) * (spec.pace_s or settings.min_step_s) if spec.mode in SWARM_MODES else 0.0
    if spec.mode == "ideal":
        evals *= settings.peers
    return STARTUP_S[spec.mode] + max(cpu, paced) + evals


# ----------------------------------------------------------------------------------------------------- peer side


@dataclass
class PeerConfig:
    """What one process needs (written as JSON by the orchestrator)."""

    settings: dict
    spec: dict
    rank: int
    run_dir: str
    deadline: float  # time.time() after which the process kills its own session
    orchestrator_pid: int
    ddp_port: int = 0
    restarted: bool = False  # churn kill: the churned peer started again (optimizer_churn)

    def paths(self) -> dict[str, Path]:
        run = Path(self.run_dir)
        return {
            "maddrs": run / "maddrs.json",
            "go": run / "go.json",
            "ready": run / f"ready{self.rank}.json",
            "result": run / f"result{self.rank}.json",
        }


def watchdog(deadline: float, orchestrator_pid: int) -> None:
    """Kill this process's whole session (its DHT, averager and p2pd children too) after the deadline or when the
    orchestrator is gone: a peer never outlives its run, whatever happens to the benchmark."""

    def watch() -> None:
        while True:
            orphaned = os.getppid() != orchestrator_pid
            if orphaned or time.time() > deadline:
                print(
                    f"[bench peer] {'orchestrator gone' if orphaned else 'deadline passed'}: killing my session",
                    file=sys.stderr,
                    flush=True,
                )
                os.killpg(os.getpgrp(), signal.SIGKILL)
            time.sleep(1.0)

    threading.Thread(target=watch, name="bench-watchdog", daemon=True).start()


def wait_for_file(path: Path, deadline: float, what: str) -> dict:
    while not path.exists():
        if time.time() > deadline:
            raise TimeoutError(f"no {what} ({path}) before the deadline")
        time.sleep(0.1)
    time.sleep(0.05)  # written with a rename, but be gentle with slow file systems
    return json.loads(path.read_text())


def write_json(path: Path, value: Any) -> None:
    """Atomic: readers poll for the file and must never see half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.rename(path)


class LogCounter(logging.Handler):
    """Counts hivemind.Optimizer's own status lines (it reports averaging rounds only in its log)."""

    PATTERNS = {
        "rounds_applied": re.compile(r"Averaged parameters with (\d+) peers"),
        "rounds_failed": re.compile(r"Averaging failed with"),
        "loaded_state": re.compile(r"Peer is out of sync"),
    }

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.counts = dict.fromkeys(self.PATTERNS, 0)
        self.group_sizes: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for name, pattern in self.PATTERNS.items():
            found = pattern.search(message)
            if found:
                self.counts[name] += 1
                if found.groups():
                    self.group_sizes.append(int(found.group(1)))


class Driver:
    """One mode's optimizer as a training loop uses it. ``lock``: held from forward to step where the mode needs it
    (the old design) and while the evaluation copies the weights (nothing may change them halfway)."""

    needs_lock_for_forward = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.lock: Any = contextlib.nullcontext()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, batch_size: int) -> None:
        self.optimizer.step()

    def weights(self) -> nn.Module:
        return self.model

    def stats(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


def start_dht(config: PeerConfig, user_dht: bool) -> Any:
    """Peer 0 starts the swarm and publishes its visible multiaddrs; the others join through them. Our peers get the
    DHT the product starts (``swarm.start_dht``: a FixedDHT that dials peer 0 again for up to ``JOIN_TIMEOUT_S``, then
    keeps connected; one ping, hivemind's own bootstrap, was missed by a busy peer 0 at load 37: "none of the
    initial_peers responded to a ping"); hivemind_optimizer a plain hivemind.DHT, as its users would start one."""
    sys.path.insert(0, str(REPO))
    import hivemind

    from vissl_swarm import swarm

    paths = config.paths()
    initial = [] if config.rank == 0 else wait_for_file(paths["maddrs"], config.deadline, "peer 0's addresses")
    if user_dht:
        dht = hivemind.DHT(start=True, host_maddrs=[LOCAL], initial_peers=initial or None, startup_timeout=60)
    else:
        settings = swarm.SwarmSettings(host_maddrs=[LOCAL], initial_peers=initial, join_timeout=JOIN_TIMEOUT_S)
        dht = swarm.start_dht(settings, startup_timeout=60)
    if config.rank == 0:
        write_json(paths["maddrs"], [str(address) for address in dht.get_visible_maddrs()])
    return dht


class SwarmDriver(Driver):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: PeerConfig, spec: RunSpec):
        super().__init__(model, optimizer)
        from decentralized_sgd import DecentralizedSGD
        from decentralized_sgd.outer import OuterSettings

        self.dht = start_dht(config, user_dht=False)
        self.dsgd = DecentralizedSGD(
            optimizer,
            self.dht,
            prefix=f"benchopt_{Path(config.run_dir).name}",
            model=model,
            target_group_size=spec.target_group_size,
            min_matchmaking_time=spec.min_matchmaking_time,
            weight_by_samples=spec.weight_by_samples,
            compression="none",
            outer=OuterSettings(spec.outer_momentum, spec.outer_lr, spec.outer_nesterov),
        )
        self.lock = self.dsgd.lock  # rounds are applied at step boundaries, in this thread: only the copy needs it

    def step(self, batch_size: int) -> None:
        self.dsgd.step(batch_size=batch_size)

    def stats(self) -> dict:
        applied = [record for record in self.dsgd.records if record.get("applied")]
        staleness = [record["staleness_steps"] for record in applied if record.get("staleness_steps") is not None]
        counters = {key: value for key, value in self.dsgd.counters.items() if value}
        return {
            "rounds_applied": int(self.dsgd.counters["rounds_applied"]),
            "rounds_failed": int(self.dsgd.counters["rounds_failed"]),
            "group_size_mean": mean(r["group_size"] for r in applied) if applied else None,
            "staleness_steps_mean": mean(staleness) if staleness else None,
            "counters": counters,
        }

    def shutdown(self) -> None:
        self.dsgd.shutdown()
        self.dht.shutdown()


class OldDriver(Driver):
    needs_lock_for_forward = True  # OldDesignAverager applies a round from its own thread, under its lock

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: PeerConfig, spec: RunSpec):
        super().__init__(model, optimizer)
        from baselines.old_design import OldDesignAverager

        self.dht = start_dht(config, user_dht=False)
        self.averager = OldDesignAverager(
            optimizer,
            self.dht,
            prefix=f"benchopt_{Path(config.run_dir).name}",
            model=model,
            target_group_size=spec.target_group_size,
            min_matchmaking_time=spec.min_matchmaking_time,
            compression="none",
        )
        self.lock = self.averager.lock

    def step(self, batch_size: int) -> None:
        self.optimizer.step()
        self.averager.on_step_end(batch_size)

    def stats(self) -> dict:
        applied = [record for record in self.averager.records if record.get("applied")]
        staleness = [record["staleness_steps"] for record in applied if record.get("staleness_steps") is not None]
        return {
            "rounds_applied": int(self.averager.counters["rounds_applied"]),
            "rounds_failed": int(self.averager.counters["rounds_failed"]),
            "group_size_mean": mean(r["group_size"] for r in applied) if applied else None,
            "staleness_steps_mean": mean(staleness) if staleness else None,
        }

    def shutdown(self) -> None:
        self.averager.shutdown()
        self.dht.shutdown()


class HivemindDriver(Driver):
    """hivemind.Optimizer with local updates. Its ``param_groups`` property returns copies: the LR is set on the
    torch optimizer it wraps (``opt.opt``)."""

    def __init__(self, model: nn.Module, config: PeerConfig, spec: RunSpec, momentum: float):
        import hivemind

        settings = Settings(**config.settings)
        self.counter = LogCounter()
        for name in ("hivemind.optim.state_averager", "hivemind.optim.optimizer"):
            logging.getLogger(name).addHandler(self.counter)
        self.dht = start_dht(config, user_dht=True)
        self.opt = hivemind.Optimizer(
            dht=self.dht,
            run_id=f"benchopt_{Path(config.run_dir).name}",
            params=model.parameters(),
            optimizer=lambda params: torch.optim.SGD(params, lr=settings.lr, momentum=momentum),
            batch_size_per_step=spec.batches(settings)[config.rank],
            target_batch_size=settings.hivemind_target_batch_size,
            use_local_updates=True,
            matchmaking_time=spec.min_matchmaking_time,
            averaging_timeout=settings.hivemind_averaging_timeout,
            average_state_every=1,
            verbose=True,
        )
        super().__init__(model, self.opt.opt)

    def step(self, batch_size: int) -> None:
        self.opt.step(batch_size=batch_size)

    def stats(self) -> dict:
        sizes = self.counter.group_sizes
        return {
            **self.counter.counts,
            "epochs": int(self.opt.local_epoch),
            "group_size_mean": mean(sizes) if sizes else None,
        }

    def shutdown(self) -> None:
        self.opt.shutdown()
        self.dht.shutdown()


class DdpDriver(Driver):
    def __init__(self, model: nn.Module, config: PeerConfig, momentum: float, lr: float):
        import datetime

        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{config.ddp_port}",
            rank=config.rank,
            world_size=config.settings["peers"],
            timeout=datetime.timedelta(seconds=SETUP_TIMEOUT_S),
        )
        self.inner = model
        wrapped = DistributedDataParallel(model)
        super().__init__(wrapped, torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=momentum))

    def weights(self) -> nn.Module:
        return self.inner

    def shutdown(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def make_driver(model: nn.Module, config: PeerConfig, spec: RunSpec, settings: Settings) -> Driver:
    peak = spec.peak_lr(settings, config.rank)
    if spec.mode == "swarm":
        optimizer = torch.optim.SGD(model.parameters(), lr=peak, momentum=settings.momentum)
        return SwarmDriver(model, optimizer, config, spec)
    if spec.mode == "old":
        optimizer = torch.optim.SGD(model.parameters(), lr=peak, momentum=settings.momentum)
        return OldDriver(model, optimizer, config, spec)
    if spec.mode == "hivemind_optimizer":
        return HivemindDriver(model, config, spec, settings.momentum)
    if spec.mode == "ddp":
        return DdpDriver(model, config, settings.momentum, peak)
    return Driver(model, torch.optim.SGD(model.parameters(), lr=peak, momentum=settings.momentum))


def train(config: PeerConfig, data: FashionMNIST) -> dict:
    """The plain PyTorch loop every mode shares; returns this peer's result (curve, rounds, pace)."""
    settings, spec = Settings(**config.settings), RunSpec(**config.spec)
    if spec.mode == "ideal":
        return train_ideal_replicas(config, spec, settings, data)
    batch = spec.batches(settings)[config.rank]
    steps, total_batch = spec.steps(settings), spec.total_batch(settings)
    peak, slowdown = spec.peak_lr(settings, config.rank), spec.slowdown(settings, config.rank)
    min_step_s = (spec.pace_s or settings.min_step_s) if spec.mode in SWARM_MODES else 0.0  # only averaging needs it
    model = make_model(spec.seed)
    evaluated = copy.deepcopy(model)
    batches = Batches(data, 1000 * spec.seed + config.rank + (100 if config.restarted else 0))
    run_dir = Path(config.run_dir)
    churn = ChurnPlan.of(spec.churn, settings.peers, steps)
    churned = churn is not None and config.rank == churn.rank
    progress = ProgressFiles(run_dir)
    others = [rank for rank in range(settings.peers) if rank != config.rank]
    saved = load_checkpoint(run_dir, config.rank) if config.restarted else None
    if saved is not None:
        model.load_state_dict(saved["model"])  # the box's last checkpoint, before it joins again
    driver = make_driver(model, config, spec, settings)
    paths = config.paths()
    write_json(paths["ready"], {"rank": config.rank, "t": time.time()})
    go = wait_for_file(paths["go"], config.deadline, "go from the orchestrator")
    time.sleep(max(0.0, go["start_at"] - time.time()))

    curve: list[dict] = []
    first = 0
    if saved is not None:  # the README's restart: resume the checkpoint, then take the swarm's state if it is ahead
        driver.optimizer.load_state_dict(saved["optimizer"])
        curve = saved["curve"]
        progress.wait_for(others, churn.resume_at, config.deadline, lambda: None)  # started early: see optimizer_churn
        taken = driver.dsgd.load_state_from_peers(timeout=60, accept=None)
        first = driver.dsgd.local_step if taken is not None else saved["step"]
        print(f"[bench peer] restarted: checkpoint of step {saved['step']}, continuing at {first}", flush=True)
        if first >= steps - (steps - churn.resume_at) // 2:  # it would miss most of the last third: not a churn run
            raise RuntimeError(
                f"the restarted peer came back at step {first} of {steps}, after most of the run: this machine "
                "started it too slowly for the pace (raise --churn_pace_s, or run on a quieter machine)"
            )
    evaluates = set(checkpoint_steps(steps, settings.curve_points)) if config.rank == 0 or spec.mode != "ddp" else set()

    def evaluate(step: int) -> None:
        with driver.lock:  # a consistent copy of the weights (the old design applies from its own thread)
            evaluated.load_state_dict(driver.weights().state_dict())
        curve.append(
            {
                "step": step,
                "swarm_samples": step * total_batch,
                "local_samples": step * batch,
                "accuracy": test_accuracy(evaluated, data),
            }
        )

    losses: list[float] = []
    t_train, train_s = time.time(), 0.0
    try:
        if 0 in evaluates and saved is None:
            evaluate(0)
        step = first - 1
        while step + 1 < steps:
            step += 1
            if step % PROGRESS_EVERY == 0:
                progress.write(config.rank, step)
            if churned and not config.restarted:
                if spec.churn == "kill" and step % CHECKPOINT_EVERY == 0:
                    save_checkpoint(run_dir, config.rank, model, driver.optimizer, step, curve)
                if step == churn.stop_at and spec.churn == "kill":
                    crash()
                if step == churn.stop_at:  # pause: in the swarm, training nothing, until the others are at 2/3,
                    progress.wait_for(others, churn.resume_at, config.deadline, lambda: None)
                    taken = driver.dsgd.load_state_from_peers(timeout=60, accept=None)  # then as the restart does
                    step = driver.dsgd.local_step if taken is not None else churn.resume_at
            t_step = time.perf_counter()
            images, labels = batches.next(batch)
            driver.set_lr(lr_at(step * total_batch, settings, peak))
            with driver.lock if driver.needs_lock_for_forward else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(driver.model(images), labels)
                driver.model.zero_grad(set_to_none=True)
                loss.backward()
                driver.step(batch)
            losses.append(float(loss))
            busy = time.perf_counter() - t_step
            train_s += busy
            pause = max(busy * (slowdown - 1.0), min_step_s - busy)
            time.sleep(max(0.0, pause))  # also lets the old design's averaging thread take its lock
            if step + 1 in evaluates:
                evaluate(step + 1)
        progress.write(config.rank, steps)
        result = {
            "rank": config.rank,
            "batch": batch,
            "steps": steps,
            "restarted": config.restarted,
            "resumed_at": first,
            "local_samples": steps * batch,
            "peak_lr": peak,
            "curve": curve,
            "final_accuracy": curve[-1]["accuracy"] if curve else None,
            "loss_tail": mean(losses[-50:]) if losses else None,
            "train_s": train_s,
            "wall_s": time.time() - t_train,
            **driver.stats(),
        }
        rounds = result.get("rounds_applied")
        result["steps_per_round"] = steps / rounds if rounds else None
        write_json(paths["result"], result)
        return result
    finally:
        driver.shutdown()


def train_ideal_replicas(config: PeerConfig, spec: RunSpec, settings: Settings, data: FashionMNIST) -> dict:
    """Mode ideal: every peer as a replica in this one process (``ideal_swarm``); the result holds each replica's
    result in a peer's shape (``replicas``), which the orchestrator unpacks."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ideal_swarm import IdealOptions, train_ideal

    from decentralized_sgd.outer import OuterSettings

    outer = OuterSettings(spec.outer_momentum, spec.outer_lr, spec.outer_nesterov)
    paths = config.paths()
    write_json(paths["ready"], {"rank": config.rank, "t": time.time()})
    wait_for_file(paths["go"], config.deadline, "go from the orchestrator")
    t0 = time.time()
    replicas = train_ideal(spec, settings, data, IdealOptions(period=spec.period, outer=outer), sys.modules[__name__])
    result = {"replicas": [{**replica, "wall_s": time.time() - t0} for replica in replicas]}
    write_json(paths["result"], result)
    return result


def peer_main(config_path: Path) -> int:
    config = PeerConfig(**json.loads(config_path.read_text()))
    watchdog(config.deadline, config.orchestrator_pid)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.path.insert(0, str(REPO))
    data = FashionMNIST.load(Path(config.settings["data_dir"]))
    train(config, data)
    return 0


# ----------------------------------------------------------------------------------------------------- orchestrator


def peer_env() -> dict[str, str]:
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        MASTER_ADDR="127.0.0.1",
    )
    env["PYTHONPATH"] = str(REPO)
    return env


def kill_session(process: subprocess.Popen) -> None:
    """The peer and everything it started (it leads its own session): only what this benchmark started, by id."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def run_one(spec: RunSpec, settings: Settings, out: Path, index: int) -> dict:
    """One run with fresh processes; every process it started is killed before it returns."""
    name = f"{index:03d}_{spec.mode}_s{spec.seed}"
    run_dir = out / name
    run_dir.mkdir(parents=True)
    count = spec.processes(settings)
    expected = estimated_seconds(spec, settings)
    deadline = time.time() + SETUP_TIMEOUT_S + 6 * expected + 120
    sys.path.insert(0, str(REPO))
    from vissl_swarm.local_swarm import free_port

    port = free_port() if spec.mode == "ddp" else 0
    record: dict[str, Any] = {
        "variant": spec.variant,
        **asdict(spec),
        "run_dir": str(run_dir),
        "error": None,
        "loadavg_before": os.getloadavg()[0],
        "commit": git_commit(),
    }
    processes: list[subprocess.Popen] = []
    logs = []
    started = time.time()
    try:
        for rank in range(count):
            config = PeerConfig(asdict(settings), asdict(spec), rank, str(run_dir), deadline, os.getpid(), port)
            (run_dir / f"peer{rank}.json").write_text(json.dumps(asdict(config)))
            logs.append(open(run_dir / f"peer{rank}.log", "w"))  # noqa: SIM115 (closed in finally)
            processes.append(
                subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--peer", str(run_dir / f"peer{rank}.json")],
                    cwd=REPO,
                    env=peer_env(),
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        wait_for_all(
            processes, [run_dir / f"ready{rank}.json" for rank in range(count)], started + SETUP_TIMEOUT_S, "ready"
        )
        record["setup_s"] = time.time() - started
        write_json(run_dir / "go.json", {"start_at": time.time() + 0.5})
        if spec.churn == "kill":
            restart_churned_peer(spec, settings, run_dir, processes, logs, deadline, port)
        results = wait_for_all(processes, [run_dir / f"result{rank}.json" for rank in range(count)], deadline, "result")
        if spec.mode == "ideal":
            results = results[0]["replicas"]
        exit_by = time.time() + SHUTDOWN_GRACE_S
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, exit_by - time.time()))
        record["clean_exit"] = all(process.returncode == 0 for process in processes)
        record["peers"] = results
    except Exception as error:
        record["error"] = f"{type(error).__name__}: {error}"
        record["logs"] = [str(run_dir / f"peer{rank}.log") for rank in range(count)]
    finally:
        for process in processes:
            kill_session(process)
        for log in logs:
            log.close()
    record["pids"] = [
        process.pid for process in processes
    ]  # (churn kill: the restarted process's)  # each led its own session: see leftovers()
    record["leftover_processes"] = leftovers(record["pids"])
    record["wall_s"] = time.time() - started
    record["loadavg_after"] = os.getloadavg()[0]
    if record["error"] is None:
        record.update(summarize_run(record["peers"]))
    return record


def restart_churned_peer(
    spec: RunSpec,
    settings: Settings,
    run_dir: Path,
    processes: list[subprocess.Popen],
    logs: list,
    deadline: float,
    port: int,
) -> None:
    """Churn kill: wait for the churned peer's crash and start it again at once with its own command
    (``restarted``: it waits for the others to reach two thirds of the run before it takes the swarm's state and
    trains); its new process replaces the old one in ``processes``."""
    churn = ChurnPlan.of(spec.churn, settings.peers, spec.steps(settings))
    crashed = processes[churn.rank]
    while crashed.poll() is None:
        if time.time() > deadline:
            raise TimeoutError(f"peer {churn.rank} did not crash at step {churn.stop_at} before the deadline")
        time.sleep(0.1)
    kill_session(crashed)  # whatever of its session survived the SIGKILL
    others = [rank for rank in range(settings.peers) if rank != churn.rank]
    for rank in others:
        if processes[rank].poll() is not None:
            raise RuntimeError(f"peer {rank} exited ({processes[rank].returncode}) while peer {churn.rank} was away")
    config = PeerConfig(
        asdict(settings), asdict(spec), churn.rank, str(run_dir), deadline, os.getpid(), port, restarted=True
    )
    config_path = run_dir / f"peer{churn.rank}_restarted.json"
    config_path.write_text(json.dumps(asdict(config)))
    logs.append(open(run_dir / f"peer{churn.rank}_restarted.log", "w"))  # noqa: SIM115 (closed by run_one)
    processes[churn.rank] = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--peer", str(config_path)],
        cwd=REPO,
        env=peer_env(),
        stdout=logs[-1],
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def leftovers(sessions: list[int]) -> list[str]:
    """Processes still alive in the sessions this run's peers led (p2pd, averagers): there should be none."""
    listing = subprocess.run(["ps", "-e", "-o", "sid=,pid=,args="], capture_output=True, text=True, timeout=30)
    return [
        line.strip()[:200] for line in listing.stdout.splitlines() if line.split() and int(line.split()[0]) in sessions
    ]


def wait_for_all(processes: list[subprocess.Popen], files: list[Path], deadline: float, what: str) -> list[dict]:
    """Until every file exists; a process that exits without writing its file, or the deadline, fails the run."""
    while True:
        missing = [rank for rank, path in enumerate(files) if not path.exists()]
        if not missing:
            return [json.loads(path.read_text()) for path in files]
        for rank in missing:
            if processes[rank].poll() is not None and not files[rank].exists():
                tail = tail_of(files[rank].parent / f"peer{rank}.log")
                raise RuntimeError(f"peer {rank} exited ({processes[rank].returncode}) before '{what}':\n{tail}")
        if time.time() > deadline:
            raise TimeoutError(f"peers {missing} did not report '{what}' before the deadline")
        time.sleep(0.2)


def tail_of(path: Path, lines: int = 25) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


# ----------------------------------------------------------------------------------------------------- summaries


def summarize_run(peers: list[dict]) -> dict:
    """A run's curve: at each checkpoint the mean accuracy over the peers that evaluated (ddp: rank 0)."""
    evaluated = [peer for peer in peers if peer["curve"]]
    by_step = [{point["step"]: point for point in peer["curve"]} for peer in evaluated]
    points = []
    for first in evaluated[0]["curve"]:  # churn: a peer away at a checkpoint has no point there
        accuracies = [curve[first["step"]]["accuracy"] for curve in by_step if first["step"] in curve]
        points.append({"step": first["step"], "swarm_samples": first["swarm_samples"], "accuracy": mean(accuracies)})
    per_round = [peer["steps_per_round"] for peer in peers if peer.get("steps_per_round")]
    return {
        "curve": points,
        "final_accuracy": points[-1]["accuracy"],
        "steps_per_peer": peers[0]["steps"],
        "rounds_applied_per_peer": mean(peer.get("rounds_applied", 0) for peer in peers),
        "steps_per_round": mean(per_round) if per_round else None,
        "peer_final_accuracies": [peer["final_accuracy"] for peer in evaluated],
    }


def crossing(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first x at which the piecewise-linear curve (x, accuracy) reaches target; None if it never does."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
        if y0 >= target:
            return x0
        if y1 >= target:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return curve[-1][0] if curve and curve[-1][1] >= target else None


def value_at(curve: list[tuple[float, float]], x: float) -> float:
    for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return curve[-1][1]


def spread(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return mean(values), stdev(values) if len(values) > 1 else None


def summarize(runs: list[dict]) -> list[dict]:
    """Per variant: seeds, final accuracy mean ± std, the mean curve, steps per round, the speed-up over alone and
    the difference to ddp's final accuracy (both from this invocation's alone and ddp runs, if any)."""
    variants: dict[str, list[dict]] = {}
    for run in runs:
        variants.setdefault(run["variant"], []).append(run)
    summaries = []
    for variant, group in variants.items():
        done = [run for run in group if run["error"] is None]
        entry: dict[str, Any] = {
            "variant": variant,
            "mode": group[0]["mode"],
            "swarm_lr": group[0]["swarm_lr"],
            "unequal": group[0]["unequal"],
            "regime": group[0]["regime"],
            "weight_by_samples": group[0]["weight_by_samples"],
            "period": group[0].get("period", 0),
            "churn": group[0].get("churn", ""),
            "pace_s": group[0].get("pace_s", 0.0),
            "outer": [group[0].get("outer_momentum", 0.0), group[0].get("outer_lr", 1.0)]
            + [group[0].get("outer_nesterov", False)],
            "runs": len(group),
            "seeds": [run["seed"] for run in done],
            "errors": len(group) - len(done),
        }
        if done:
            finals = [run["final_accuracy"] for run in done]
            entry["final_mean"], entry["final_std"] = spread(finals)
            entry["per_seed"] = {str(run["seed"]): round(run["final_accuracy"], 4) for run in done}
            curves = [run["curve"] for run in done if len(run["curve"]) == len(done[0]["curve"])]
            entry["curve"] = [
                {
                    "step": point["step"],
                    "swarm_samples": point["swarm_samples"],
                    "accuracy": mean(curve[at]["accuracy"] for curve in curves),
                    "std": spread([curve[at]["accuracy"] for curve in curves])[1],
                }
                for at, point in enumerate(curves[0])
            ]
            entry["steps_per_peer"] = done[0]["steps_per_peer"]
            entry["rounds_per_peer"] = mean(run["rounds_applied_per_peer"] for run in done)
            per_round = [run["steps_per_round"] for run in done if run["steps_per_round"]]
            entry["steps_per_round"], entry["steps_per_round_std"] = spread(per_round)
            entry["steps_per_round_per_seed"] = [round(value, 1) for value in per_round]
            if variant.endswith("unequal, weight_by_samples") or variant.endswith("unequal, equal weights"):
                entry["fast_peer_final_mean"] = mean(run["peer_final_accuracies"][-1] for run in done)
                entry["slow_peers_final_mean"] = mean(mean(run["peer_final_accuracies"][:-1]) for run in done)
        summaries.append(entry)
    add_comparisons(summaries)
    return summaries


def add_comparisons(summaries: list[dict]) -> None:
    by_name = {entry["variant"]: entry for entry in summaries}
    alone, ddp = by_name.get("alone"), by_name.get("ddp")
    for entry in summaries:
        if "curve" not in entry:
            continue
        curve = [(point["step"], point["accuracy"]) for point in entry["curve"]]
        if alone is not None and "curve" in alone:
            alone_curve = [(point["step"], point["accuracy"]) for point in alone["curve"]]
            alone_steps = alone_curve[-1][0]
            targets = {
                "final": (alone["final_mean"], alone_steps),
                "half": (value_at(alone_curve, alone_steps / 2), alone_steps / 2),
                "third": (value_at(alone_curve, alone_steps / 3), alone_steps / 3),
            }
            for name, (target, steps) in targets.items():
                reached = steps if entry is alone else crossing(curve, target)  # alone: the reference, by definition
                entry[f"target_{name}"] = target
                entry[f"steps_to_alone_{name}"] = reached
                entry[f"speedup_{name}"] = steps / reached if reached else None
        if ddp is not None and ddp.get("final_mean") is not None:
            entry["vs_ddp"] = entry["final_mean"] - ddp["final_mean"]


# ----------------------------------------------------------------------------------------------------- outputs


def fmt(value: float | None, digits: int = 4, signed: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def mean_std(entry: dict) -> str:
    if entry.get("final_mean") is None:
        return "—"
    std = entry.get("final_std")
    return f"{entry['final_mean']:.4f} ± {std:.4f}" if std is not None else f"{entry['final_mean']:.4f}"


def speedup(entry: dict, name: str) -> str:
    if entry.get(f"target_{name}") is None:
        return "—"
    value = entry.get(f"speedup_{name}")
    return "not reached" if value is None else f"{value:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def row(entry: dict) -> list[str]:
    return [
        entry["variant"],
        mean_std(entry),
        str(len(entry.get("seeds", []))),
        str(entry.get("steps_per_peer", "—")),
        speedup(entry, "final"),
        speedup(entry, "half"),
        speedup(entry, "third"),
        fmt(entry.get("vs_ddp"), signed=True),
        steps_per_round(entry),
        fmt(entry.get("rounds_per_peer"), 1),
    ]


def steps_per_round(entry: dict) -> str:
    """Median (min-max) over seeds: one run on a busy machine can average far less often than the others."""
    values = entry.get("steps_per_round_per_seed")
    if not values:
        return "—"
    return f"{median(values):.0f} ({min(values):.0f}–{max(values):.0f})" if len(values) > 1 else f"{values[0]:.0f}"


HEADER = [
    "variant",
    "final test acc (mean ± std)",
    "seeds",
    "steps per peer",
    "speed-up to alone's final",
    "speed-up to alone's half-run acc",
    "speed-up to alone's third-run acc",
    "final acc − ddp's",
    "local steps per applied round (median (min–max) over seeds)",
    "applied rounds per peer",
]


def markdown(result: dict) -> str:
    summaries, settings = result["summary"], result["settings"]
    by_exp: dict[str, list[dict]] = {"main": [], "lr": [], "weighting": [], "slowed": [], "gap": [], "churn": []}
    for entry in summaries:
        if entry["churn"] or entry["pace_s"]:
            by_exp["churn"].append(entry)
        elif entry["mode"] == "ideal" or entry["outer"][:2] != [0.0, 1.0]:
            by_exp["gap"].append(entry)
        elif entry["unequal"]:
            by_exp["weighting"].append(entry)
        elif entry["regime"] != "loopback":
            by_exp["slowed"].append(entry)
        elif entry["mode"] == "swarm" and entry["swarm_lr"] != result["swarm_lr"]:
            by_exp["lr"].append(entry)
        else:
            by_exp["main"].append(entry)
    reference = [e for e in by_exp["main"] if e["mode"] in ("alone", "ddp")]
    main_swarm = [e for e in by_exp["main"] if e["mode"] == "swarm"]
    parts = [
        f"Fashion-MNIST, S = {settings['samples']} samples (the swarm's total), B = {settings['batch']}, peak LR "
        f"{settings['lr']} at B, momentum {settings['momentum']}, warm-up {settings['warmup']:.0%} + cosine; "
        f"{settings['peers']} peers; commit {result['commit']['head'][:10]}"
        f"{' (dirty)' if result['commit']['dirty'] else ''}. Speed-ups: alone's steps / the steps per peer at "
        "which the variant's mean curve first reaches alone's mean accuracy (final, or at half or a third of its "
        "run; a third: the steps a swarm peer takes, so below 1x the swarm does worse than one peer alone in "
        'the same steps). "not reached": the variant\'s curve never gets there.',
        "",
    ]
    sections = [
        ("Modes", by_exp["main"], []),
        (f"LR scaling of the swarm (swarm_lr; main rule: {result['swarm_lr']})", by_exp["lr"], reference + main_swarm),
        ("Unequal peers: one at 2B; equal weights vs weight_by_samples", by_exp["weighting"], reference),
        ("Averaging frequency: slowed rounds", by_exp["slowed"], reference + main_swarm),
        ("The ideal swarm and the outer optimizer", by_exp["gap"], reference + main_swarm + by_exp["slowed"]),
        ("Churn: peer 2 away for the middle third of the run", by_exp["churn"], reference + main_swarm),
    ]
    for title, own, context in sections:
        if own:
            entries = sorted(context + own, key=lambda e: (e["mode"] not in ("alone", "ddp"), e["variant"]))
            parts += [f"### {title}", "", table(HEADER, [row(entry) for entry in entries]), ""]
    if by_exp["weighting"]:
        parts += [
            "Unequal: final accuracy of the 2B peer / of the B peers (mean over seeds): "
            + "; ".join(
                f"{e['variant']}: {fmt(e.get('fast_peer_final_mean'))} / {fmt(e.get('slow_peers_final_mean'))}"
                for e in by_exp["weighting"]
            ),
            "",
        ]
    if by_exp["gap"]:
        parts += gap_decomposition(summaries)
    if by_exp["churn"]:
        by_churn = {e["churn"]: e for e in by_exp["churn"] if e["mode"] == "swarm"}
        whole = by_churn.get("")
        if "kill" in by_churn and "pause" in by_churn:
            parts += [
                "Churn, per seed: kill − pause (what the crash costs beyond its lost samples) "
                f"{paired(by_churn['kill'], by_churn['pause'])}"
                + (
                    f"; pause − uninterrupted (what the lost samples cost) {paired(by_churn['pause'], whole)}"
                    if whole is not None
                    else ""
                ),
                "",
            ]
    parts += ["Per seed (final test accuracy, mean of the run's peers):", ""]
    parts += [
        f"- {e['variant']}: " + ", ".join(f"seed {seed} {acc:.4f}" for seed, acc in e.get("per_seed", {}).items())
        for e in summaries
    ]
    commits = sorted(
        {
            f"{run['commit']['head'][:10]}{' (dirty)' if run['commit']['dirty'] else ''}"
            for run in result["runs"]
            if run.get("commit")
        }
    )
    commands = result.get("commands", [result["command"]])
    parts += [
        "",
        f"Runs measured at commit(s) {', '.join(commits) or '—'}; command(s): "
        + "; ".join("`" + " ".join(command) + "`" for command in commands),
    ]
    errors = [run for run in result["runs"] if run["error"]]
    if errors:
        parts += [
            "",
            "Failed runs:",
            *(f"- {run['variant']} seed {run['seed']}: {run['error'][:300]}" for run in errors),
        ]
    return "\n".join(parts) + "\n"


def paired(a: dict, b: dict) -> str:
    """a − b over the seeds both have: mean ± std of the per-seed differences (n)."""
    seeds = sorted(set(a.get("per_seed", {})) & set(b.get("per_seed", {})), key=int)
    diffs = [a["per_seed"][seed] - b["per_seed"][seed] for seed in seeds]
    if not diffs:
        return "—"
    mean_diff, std = spread(diffs)
    return f"{mean_diff:+.4f}" + (f" ± {std:.4f}" if std is not None else "") + f" (n={len(diffs)})"


def gap_decomposition(summaries: list[dict]) -> list[str]:
    """Per swarm variant with an ideal of the same regime, LR rule and outer optimizer: what the system costs
    (swarm − ideal, per seed) and what periodic averaging costs (ideal − ddp); and what the outer step adds."""
    ddp = next((e for e in summaries if e["variant"] == "ddp"), None)
    swarms = [  # not the churn runs: paced, they average at another period than their regime's ideal
        e
        for e in summaries
        if e["mode"] == "swarm" and not (e["unequal"] or e["churn"] or e["pace_s"]) and e.get("final_mean") is not None
    ]
    rows = []
    for swarm in swarms:
        ideal = next(
            (
                e
                for e in summaries
                if e["mode"] == "ideal"
                and (e["regime"], e["swarm_lr"], e["outer"]) == (swarm["regime"], swarm["swarm_lr"], swarm["outer"])
            ),
            None,
        )
        plain = next(
            (
                e
                for e in swarms
                if e is not swarm
                and e["outer"][:2] == [0.0, 1.0]
                and (e["regime"], e["swarm_lr"]) == (swarm["regime"], swarm["swarm_lr"])
            ),
            None,
        )
        if ideal is None:
            continue
        rows.append(
            [
                swarm["variant"],
                mean_std(swarm),
                f"{ideal['variant']}: {mean_std(ideal)}",
                paired(swarm, ideal),
                fmt(ideal["final_mean"] - ddp["final_mean"], signed=True) if ddp is not None else "—",
                paired(swarm, plain) if plain is not None and swarm["outer"][:2] != [0.0, 1.0] else "—",
            ]
        )
    ideals = [e for e in summaries if e["mode"] == "ideal" and e["outer"][:2] != [0.0, 1.0]]
    for ideal in ideals:
        plain = next(
            (
                e
                for e in summaries
                if e["mode"] == "ideal" and e["outer"][:2] == [0.0, 1.0] and e["period"] == ideal["period"]
            ),
            None,
        )
        if plain is not None:
            rows.append(
                [
                    ideal["variant"],
                    mean_std(ideal),
                    "—",
                    "—",
                    fmt(ideal["final_mean"] - ddp["final_mean"], signed=True) if ddp is not None else "—",
                    paired(ideal, plain),
                ]
            )
    if not rows:
        return []
    header = [
        "variant",
        "final test acc",
        "the ideal at its period (same LR rule, same outer step)",
        "system gap: swarm − ideal (per seed)",
        "algorithm gap: ideal − ddp",
        "outer step: variant − the same without it (per seed)",
    ]
    return ["### Where the gap to ddp goes", "", table(header, rows), ""]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_samples, by_steps) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab20").colors  # a color per variant (the default cycle repeats after 10)
    for index, entry in enumerate(result["summary"]):
        if "curve" not in entry:
            continue
        color = colors[(2 * index) % 20 + (2 * index) // 20 % 2]
        other_regime = entry["unequal"] or entry["regime"] != "loopback"
        style = "--" if entry["mode"] in ("alone", "ddp") else ("-." if other_regime else "-")
        samples = [point["swarm_samples"] for point in entry["curve"]]
        steps = [point["step"] for point in entry["curve"]]
        accuracy = [point["accuracy"] for point in entry["curve"]]
        label = f"{entry['variant']} (n={len(entry['seeds'])})"
        by_samples.plot(samples, accuracy, style, marker=".", label=label, color=color)
        by_steps.plot(steps, accuracy, style, marker=".", label=label, color=color)
    low = min((p["accuracy"] for e in result["summary"] for p in e.get("curve", [])[1:]), default=0.0)
    for axis, xlabel in ((by_samples, "samples the whole swarm processed"), (by_steps, "steps per peer")):
        axis.set_xlabel(xlabel)
        axis.set_ylabel("test accuracy (10k Fashion-MNIST test images)")
        axis.set_ylim(max(0.0, low - 0.02), None)
        axis.grid(alpha=0.3)
    by_steps.legend(fontsize=7, loc="lower right")
    figure.suptitle(
        f"bench_optimizer: S = {result['settings']['samples']}, B = {result['settings']['batch']}; mean over seeds"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


HEADLINE = ("alone", "swarm [sqrt]", "ddp", "hivemind_optimizer [sqrt]")  # what a user compares first


def plot_headline(result: dict, path: Path, variants: tuple[str, ...] = HEADLINE) -> None:
    """The README's picture: test accuracy against steps per box for one box, the swarm, DDP and hivemind.Optimizer
    (mean over seeds, ± 1 std shaded); a box of the swarm takes a third of one box's steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_name = {entry["variant"]: entry for entry in result["summary"] if "curve" in entry}
    labels = {
        "alone": "one box alone",
        "swarm [sqrt]": "3 boxes: this DecentralizedSGD",
        "ddp": "3 boxes: DDP (a cluster)",
        "hivemind_optimizer [sqrt]": "3 boxes: hivemind.Optimizer(use_local_updates=True)",
    }
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name in variants:
        entry = by_name.get(name)
        if entry is None:
            continue
        steps = [point["step"] for point in entry["curve"]]
        accuracy = [point["accuracy"] for point in entry["curve"]]
        std = [point.get("std") or 0.0 for point in entry["curve"]]
        line = axis.plot(steps, accuracy, marker=".", label=f"{labels.get(name, name)} (n={len(entry['seeds'])})")
        low = [a - s for a, s in zip(accuracy, std, strict=True)]
        high = [a + s for a, s in zip(accuracy, std, strict=True)]
        axis.fill_between(steps, low, high, color=line[0].get_color(), alpha=0.15)
    axis.set_xlabel("steps per box (batch 32 each)")
    axis.set_ylabel("Fashion-MNIST test accuracy")
    axis.set_ylim(0.8, None)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    axis.set_title(
        f"Same total samples ({result['settings']['samples']}): plain PyTorch, bench_optimizer.py", fontsize=9
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def git_commit() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()

    return {"head": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def write_outputs(args: argparse.Namespace, result: dict, final: bool = True) -> None:
    result["summary"] = summarize(result["runs"])
    result["complete"] = final
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot)
    if args.headline_plot:
        args.headline_plot.parent.mkdir(parents=True, exist_ok=True)
        plot_headline(result, args.headline_plot)
    if final:
        print(text)


# ----------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    defaults = Settings()
    parser.add_argument("--quick", action="store_true", help="a tiny budget, 1 seed, experiment main with --modes")
    parser.add_argument("--experiments", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=None,
        help="modes of experiment main (default: all; --quick: alone swarm)",
    )
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 of experiments main and lr")
    parser.add_argument("--weighting_seeds", type=int, default=3)
    parser.add_argument("--slowed_seeds", type=int, default=3)
    parser.add_argument(
        "--slowed_lr_rules",
        nargs="+",
        choices=LR_RULES,
        default=list(LR_RULES),
        help="experiment slowed: does the LR rule's ranking carry over to rounds far apart?",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a JSON this script wrote with the same settings: keep its runs, run only the rest "
        "(a setting of one mode only, e.g. --hivemind_target_batch_size, may differ: that "
        "mode's runs are redone)",
    )
    parser.add_argument(
        "--swarm_lr",
        choices=LR_RULES,
        default="sqrt",
        help="how a swarm peer's LR scales with the swarm's total batch (main, weighting, slowed)",
    )
    parser.add_argument("--lr_rules", nargs="+", choices=LR_RULES, default=list(LR_RULES), help="experiment lr")
    parser.add_argument("--samples", type=int, default=defaults.samples, help="S, the budget (the swarm's total)")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="B, a peer's batch")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak LR at batch B")
    parser.add_argument("--curve_points", type=int, default=defaults.curve_points)
    parser.add_argument(
        "--min_matchmaking_time",
        type=float,
        default=defaults.min_matchmaking_time,
        help="the main regime's (hivemind_optimizer: its matchmaking_time)",
    )
    parser.add_argument("--slowed_min_matchmaking_time", type=float, default=defaults.slowed_min_matchmaking_time)
    parser.add_argument(
        "--ideal_period",
        type=int,
        default=25,
        help="experiments ideal, outer: the ideal's local steps per round in the main regime (the swarm's median)",
    )
    parser.add_argument(
        "--slowed_ideal_period", type=int, default=179, help="the same for the slowed regime (the swarm's median)"
    )
    parser.add_argument(
        "--churn_pace_s",
        type=float,
        default=0.05,
        help="experiment churn: every step of its runs lasts at least this long (a restarted peer needs ~20 s)",
    )
    parser.add_argument("--outer_momentum", type=float, default=0.5, help="experiment outer: the variant's b")
    parser.add_argument("--outer_lr", type=float, default=0.7, help="experiment outer: the variant's a")
    parser.add_argument(
        "--outer_nesterov", action=argparse.BooleanOptionalAction, default=True, help="experiment outer: its form"
    )
    parser.add_argument("--hivemind_target_batch_size", type=int, default=defaults.hivemind_target_batch_size)
    parser.add_argument(
        "--min_step_s",
        type=float,
        default=defaults.min_step_s,
        help="an averaging peer's step lasts at least this long (the rest is a sleep)",
    )
    parser.add_argument("--data_dir", type=Path, default=DATA_DIR, help="the Fashion-MNIST IDX files (.gz)")
    parser.add_argument(
        "--out", type=Path, default=None, help="peer configs and logs; default benchmarks/out/optimizer/<time>"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument(
        "--headline_plot", type=Path, default=None, help="the README's plot: alone, swarm, ddp, hivemind_optimizer"
    )
    parser.add_argument("--peer", type=Path, default=None, help=argparse.SUPPRESS)  # internal: run one process
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.peer is not None:
        return peer_main(args.peer)
    missing = [name for name in IDX_FILES.values() if not (args.data_dir / name).exists()]
    if missing:
        print(f"error: {args.data_dir} lacks {missing} (apt-get install dataset-fashion-mnist)", file=sys.stderr)
        return 2
    if args.quick:
        args.experiments, args.seeds = ["main"], 1
        args.modes = args.modes or ["alone", "swarm"]
        settings = Settings(
            samples=24_000,
            curve_points=4,
            min_step_s=0.1,
            data_dir=str(args.data_dir),
            batch=args.batch,
            lr=args.lr,
            min_matchmaking_time=args.min_matchmaking_time,
            hivemind_target_batch_size=min(args.hivemind_target_batch_size, 4 * 3 * args.batch),
        )
    else:
        args.modes = args.modes or list(MODES)
        settings = Settings(
            samples=args.samples,
            batch=args.batch,
            lr=args.lr,
            curve_points=args.curve_points,
            min_matchmaking_time=args.min_matchmaking_time,
            slowed_min_matchmaking_time=args.slowed_min_matchmaking_time,
            hivemind_target_batch_size=args.hivemind_target_batch_size,
            data_dir=str(args.data_dir),
            min_step_s=args.min_step_s,
        )
    runs = plan(args, settings)
    out = args.out or REPO / "benchmarks/out/optimizer" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "commit": git_commit(),
        "command": [sys.argv[0], *(argv or sys.argv[1:])],
        "dataset": {
            "name": "Fashion-MNIST" if args.data_dir == DATA_DIR else "IDX files",
            "dir": str(args.data_dir),
            "files": list(IDX_FILES.values()),
        },
        "settings": asdict(settings),
        "swarm_lr": args.swarm_lr,
        "quick": args.quick,
        "experiments": args.experiments,
        "cpus": os.cpu_count(),
        "runs": [],
    }
    if args.resume is not None:
        previous = json.loads(args.resume.read_text())
        changed = {key for key, value in previous["settings"].items() if result["settings"].get(key) != value}
        redo = {MODE_SETTINGS[key] for key in changed if key in MODE_SETTINGS}  # modes whose own settings changed
        if changed - set(MODE_SETTINGS) or previous["swarm_lr"] != args.swarm_lr:
            print(
                f"error: --resume {args.resume} was measured with other settings ({sorted(changed)})", file=sys.stderr
            )
            return 2
        result["commands"] = [*previous.get("commands", [previous["command"]]), result["command"]]
        result["previous_commits"] = [*previous.get("previous_commits", []), previous["commit"]]
        result["runs"] = [run for run in previous["runs"] if run["error"] is None and run["mode"] not in redo]
        done = {json.dumps(asdict(spec_of(run)), sort_keys=True) for run in result["runs"]}
        runs = [spec for spec in runs if json.dumps(asdict(spec), sort_keys=True) not in done]
        print(f"resuming {args.resume}: {len(result['runs'])} runs kept, {len(runs)} to run", flush=True)
    expected = sum(estimated_seconds(spec, settings) for spec in runs)
    print(
        f"bench_optimizer: {len(runs)} runs ({', '.join(sorted({spec.variant for spec in runs}))}), S = "
        f"{settings.samples}, B = {settings.batch}; expected about {expected / 60:.1f} min on a quiet 2-core machine "
        f"(a busy one takes 2-3x); logs in {out}",
        flush=True,
    )
    if not runs:
        write_outputs(args, result)
        return 0
    install_sigterm()
    t0 = time.time()
    try:
        for index, spec in enumerate(runs):
            run = run_one(spec, settings, out, index)
            result["runs"].append(run)
            status = run["error"] or (
                f"final {run['final_accuracy']:.4f}, steps/round "
                f"{fmt(run['steps_per_round'], 0)}, rounds/peer "
                f"{run['rounds_applied_per_peer']:.1f}"
            )
            print(
                f"[{index + 1}/{len(runs)}] {spec.variant} seed {spec.seed}: {status} ({run['wall_s']:.0f} s; "
                f"load {run['loadavg_before']:.1f})",
                flush=True,
            )
            result["wall_s"] = time.time() - t0
            write_outputs(args, result, final=index == len(runs) - 1)  # after every run: a cut-short run keeps data
    except KeyboardInterrupt:  # run_one's finally has killed that run's processes; the outputs hold the runs done
        print(f"interrupted after {len(result['runs'])} of {len(runs)} runs", file=sys.stderr)
        return 130
    return 1 if any(run["error"] for run in result["runs"]) else 0


def spec_of(run: dict) -> RunSpec:
    """The RunSpec a run record was made from (the record holds its fields; older records lack newer ones)."""
    return RunSpec(**{name: run[name] for name in RunSpec.__dataclass_fields__ if name in run})


def install_sigterm() -> None:
    """SIGTERM (a test's timeout, a CI cancel) ends the benchmark like Ctrl-C: run_one's finally kills the peers."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


if __name__ == "__main__":
    sys.exit(main())
