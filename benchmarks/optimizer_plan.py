"""bench_optimizer's task and plan, shared by the orchestrator and the peers: data, model, LR schedule, ``RunSpec``."""

from __future__ import annotations

import argparse
import gzip
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

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
# rough costs on a quiet 2-core machine, for the estimate and the deadlines: start-up, CPU seconds per sample of a run
STARTUP_S = {"alone": 6.0, "ddp": 10.0, "swarm": 25.0, "old": 20.0, "hivemind_optimizer": 25.0, "ideal": 5.0}
CPU_S_PER_SAMPLE = {"alone": 70e-6, "ddp": 60e-6, "swarm": 60e-6, "old": 60e-6, "hivemind_optimizer": 70e-6}
CPU_S_PER_SAMPLE["ideal"] = 180e-6  # 3 replicas in one thread
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
    """2 strided convs + 2 fc, seeded. No BatchNorm on purpose: every mode then averages the same tensors
    (hivemind.Optimizer averages parameters only, DDP broadcasts rank 0's buffers)."""
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
    hivemind_target_batch_size: int = 6_144  # 64 steps of the 3 peers
    hivemind_averaging_timeout: float = 15.0
    min_step_s: float = 0.015  # every averaging peer's step lasts at least this long (a sleep), as on an accelerator
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
    """Warm-up over the first ``warmup`` share of S samples, then a cosine to 0 at S (``position``: swarm samples)."""
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
                unequal = dict(unequal=True, weight_by_samples=by_samples)
                add(RunSpec("swarm", seed, swarm_lr=args.swarm_lr, **unequal, **loopback))
    slowed = dict(
        regime="slowed", target_group_size=settings.peers + 1, min_matchmaking_time=settings.slowed_min_matchmaking_time
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
                add(RunSpec("swarm", seed, swarm_lr=rule, **slowed))
    return sorted(runs, key=lambda spec: spec.seed)  # seed by seed: a run cut short still compares every variant


def estimated_seconds(spec: RunSpec, settings: Settings) -> float:
    """Seconds on a quiet 2-core machine: start-up, the run's training (or its pacing) and its evaluations."""
    processes = spec.processes(settings)
    cpu = CPU_S_PER_SAMPLE[spec.mode] * settings.samples / min(2, processes)
    if spec.unequal:
        cpu *= 1.5
    evals = 0.25 * (settings.curve_points + 1) * (1 if spec.mode == "ddp" else processes) / min(2, processes)
    paced = spec.steps(settings) * (spec.pace_s or settings.min_step_s) if spec.mode in SWARM_MODES else 0.0
    if spec.mode == "ideal":
        evals *= settings.peers
    return STARTUP_S[spec.mode] + max(cpu, paced) + evals
