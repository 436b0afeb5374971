#!/usr/bin/env python
"""Side-by-side benchmark of decentralized parameter averaging designs.

Why: the old design (TrainingAverager driven one round at a time from a background thread) spends much of its wall
time between rounds and averages a snapshot taken *before* matchmaking, so its results are stale by the time they land.
`decentralized_sgd.DecentralizedSGD` claims to fix that (delta rule, refresh right before AllReduce, pipelined
matchmaking). This script measures each design, and each improvement switched off, on the same workloads, and what
an uneven swarm (one overloaded or slow peer) and bandwidth-limited links do to them. Beside them runs the arm a
user would pick instead of us: hivemind's own `hivemind.Optimizer(use_local_updates=True)`.

Every peer is a separate OS process (fork) with its own DHT on 127.0.0.1 (peer 0 bootstraps the others), so GIL and
CPU contention are realistic. Each (regime, mode) gets fresh processes; their process groups are killed afterwards.

Usage:
    python benchmarks/bench_averaging.py [--quick] [--regimes R ...] [--modes M ...] [--compressions C ...]
        [--seconds S] [--peers N] [--warmup W] [--sim-params P] [--min-matchmaking-time T] [--json PATH [--json-peers]]
        [--markdown PATH] [--plot PATH] [--verbose] [--hivemind-target-scale S] [--extend-until-round S]

Regimes (default: the first four):
    sim_full, sim_not_full (simulated GPU: a step is sleep(0.3 s); 25M fp32 params really averaged),
    cpu_full, cpu_not_full (real CPU training of a ~0.5M-param CNN on sklearn digits).
        "full": 3 peers, target_group_size 3; "not_full": 3 peers, target_group_size 4 (groups never fill up).
    straggler: 5 peers, target 4, 0.05 s simulated steps, a 100k-param model, the test suite's fast timeouts. After a
        reference window, the last peer's whole process group (trainer, averager, DHT, p2pd) is stopped 80% of the
        time (SIGSTOP 0.4 s / SIGCONT 0.1 s, as a box whose CPUs are saturated); the healthy peers' rounds/min in
        that window against the reference window of the same swarm.
    slow_step: 3 peers, target 3 (full groups), 0.05 s steps; after the reference window the last peer steps 20x
        slower; the fast peers' time from group formed to round end and their rounds/min against the reference.
    wan_100mbit, wan_1gbit: 3 peers, target 4, 0.3 s simulated steps, ResNet-50-sized tensors (25.6M params), each
        peer in its own network namespace behind a link shaped to 100 Mbit/s or 1 Gbit/s each way (benchmarks/netns.py;
        the script re-executes itself inside `unshare -rn`); compression fp16 and uint8. Reported against the cap
        min(60 / min_matchmaking_time, 60 / AllReduce s) rounds/min and staleness against AllReduce steps + 1.
Modes:   none, old, improved, no_delta, no_refresh, no_pipeline, fill_at_boundary (improved, but a round is filled
         at the first trainer step boundary after its group formed: the earlier behaviour),
         no_slow_peer_fixes (improved without the fixes for an overloaded groupmate),
         fill_at_once (improved, but a formed round never waits for a step boundary due within boundary_wait_share
         of an AllReduce: wan_100mbit only),
         hivemind_optimizer (hivemind.Optimizer(use_local_updates=True), set up as a knowledgeable user would:
         matchmaking_time = our min_matchmaking_time, averaging_timeout = our allreduce_timeout, the same compression,
         average_state_every=1, and target_batch_size = the swarm's samples in one min_matchmaking_time, so that a
         global epoch, hence a chance to average, comes about as often as our rounds can; the rate is the one the
         `improved` run of the same regime trained at, else `none`'s, else the nominal one; see
         hivemind_target_batch_size). Each regime runs the modes that make sense for it (REGIMES[...].modes);
         --modes picks among them.
Each run trains for a warm-up (10 s; --quick 3 s; 1 s for `none`; hivemind_optimizer at least its start-up,
hivemind_startup_s: 10 s + 2 x min_matchmaking_time) in which averaging already runs, then measures a
window (60 s; --quick 6 s, 4 s for `none`): steady state, not start-up. Regimes with a perturbation measure a second
window of the same length after a settling pause, with the last peer perturbed.
--quick: 5M params, min_matchmaking_time 2 s in the sim/cpu regimes, shorter windows in all; every regime and mode
still runs.

Metrics (per run; rounds count if they finished inside the measured window):
    samples_per_s_per_peer, throughput_ratio (vs `none` of the same regime), rounds_per_min (applied rounds per
    peer per minute of window), rounds_per_min_steady (60 / mean interval between a peer's applied rounds: no
    start-up bias in short windows), staleness_steps (local steps between the snapshot that went into AllReduce and
    the apply), duty_cycle (union over time of matchmaking / awaiting trigger / AllReduce spans per peer, / window),
    group_size_mean, rounds_failed, formed_to_end_s_mean (group formed to round end). Perturbed regimes: the same
    for the healthy peers in the perturbed window, `reference` (the healthy peers in the reference window),
    `perturbed_peer` (the perturbed one), with_perturbed_peer_share (healthy rounds whose group held it).
    hold_s_total / hold_ms_per_step / hold_s_max / hold_share: how long averaging held the trainer, per peer over the
    steps that ended in the window (whole steps, as for the rate; share: of those steps' time): the time its
    optimizer-step call took beyond the inner torch optimizer's step (timed by the inner optimizer's own step hooks,
    in whatever thread runs it); for `old`, the wait for the data lock. epochs_per_min
    (hivemind_optimizer): global epochs the peer went through, i.e. chances to average.
    Staleness of hivemind_optimizer: the inner optimizer's updates between TrainingStateAverager copying the
    parameters into the averager (_load_local_tensors_into_averager_, the delta rule's "before") and adding the
    round's delta to them (_apply_averaging_results_), seen from a subclass of TrainingStateAverager that the
    optimizer builds through its own _make_state_averager.
    Peer logs go to $TMPDIR/bench_averaging_logs/.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
BASE_MODES: tuple[str, ...] = (
    "none",
    "old",
    "improved",
    "hivemind_optimizer",
    "no_delta",
    "no_refresh",
    "no_pipeline",
    "fill_at_boundary",
    "no_slow_peer_fixes",
)
MODES: tuple[str, ...] = (*BASE_MODES, "fill_at_once")
IMPROVED_OVERRIDES: dict[str, dict[str, Any]] = {  # the RoundSettings that define each mode
    "improved": {},
    "no_delta": {"delta_rule": False},
    "no_refresh": {"refresh_before_allreduce": False},
    "no_pipeline": {"pipeline": False},
    "fill_at_boundary": {"fill_when_formed": False},
    "fill_at_once": {"boundary_wait_share": 0.0},
    "no_slow_peer_fixes": {"slow_peer_fixes": False},
}
# the test suite's FAST settings (tests/dsgd_swarm.py) with a tiny model and quick steps: many rounds per minute, so
# that what one uneven peer costs the others shows in a short window
FAST_SWARM: dict[str, Any] = dict(
    sim_params=100_000,
    sim_step_s=0.05,
    min_matchmaking_time=1.0,
    request_timeout=0.5,
    next_chunk_timeout=2.0,
    allreduce_timeout=15.0,
)
WAN: dict[str, Any] = dict(
    sim_params=25_600_000,
    sim_step_s=0.3,
    min_matchmaking_time=5.0,
    request_timeout=3.0,
    allreduce_timeout=60.0,
    setup_timeout=120.0,
)


@dataclass(frozen=True)
class Regime:
    """A workload: how peers train, how groups form, what is uneven about the swarm and its links."""

    trainer: str  # "sim" (a step is a sleep) or "cpu" (real training on the CPU)
    target_group_size: int
    peers: int | None = None  # None: --peers
    modes: tuple[str, ...] = BASE_MODES
    perturbation: str | None = None  # "straggler" | "slow_step": a reference window, then the last peer perturbed
    link_mbit: float | None = None  # every peer in its own network namespace behind a link of this rate
    compressions: tuple[str, ...] = ("none",)
    nominal: dict[str, Any] = field(default_factory=dict)  # RunConfig settings of this regime
    quick: dict[str, Any] = field(default_factory=dict)  # and in --quick (applied over `nominal`)


REGIMES: dict[str, Regime] = {
    "sim_full": Regime("sim", 3),
    "sim_not_full": Regime("sim", 4),
    "cpu_full": Regime("cpu", 3),
    "cpu_not_full": Regime("cpu", 4),
    "straggler": Regime(
        "sim",
        4,
        peers=5,
        modes=("old", "improved", "hivemind_optimizer", "no_slow_peer_fixes"),
        perturbation="straggler",
        nominal=FAST_SWARM,
        quick=dict(seconds=15.0, settle_s=3.0),
    ),
    "slow_step": Regime(
        "sim",
        3,
        peers=3,
        modes=("old", "improved", "hivemind_optimizer", "fill_at_boundary"),
        perturbation="slow_step",
        nominal=FAST_SWARM,
        quick=dict(seconds=10.0, settle_s=2.0),
    ),
    "wan_100mbit": Regime(
        "sim",
        4,
        peers=3,
        modes=("old", "improved", "hivemind_optimizer", "fill_at_once"),
        link_mbit=100.0,
        compressions=("fp16", "uint8"),
        nominal=dict(WAN, warmup_s=20.0),
        quick=dict(seconds=20.0, warmup_s=10.0),
    ),
    "wan_1gbit": Regime(
        "sim",
        4,
        peers=3,
        modes=("old", "improved", "hivemind_optimizer"),
        link_mbit=1000.0,
        compressions=("fp16", "uint8"),
        nominal=dict(WAN, warmup_s=20.0),
        quick=dict(seconds=20.0, warmup_s=10.0),
    ),
}
DEFAULT_REGIMES = ("sim_full", "sim_not_full", "cpu_full", "cpu_not_full")
STRAGGLER_STOP_S, STRAGGLER_RUN_S = 0.4, 0.1  # the straggler's process group: stopped 80% of the time
SLOW_STEP_FACTOR = 20.0
LOG_DIR = Path(tempfile.gettempdir()) / "bench_averaging_logs"
SPAN_COLORS = {"matchmaking": "tab:blue", "awaiting": "tab:orange", "allreduce": "tab:green", "copy": "tab:gray"}


@dataclass(frozen=True)
class RunConfig:
    """Everything a peer process needs to run one (regime, mode) pair; plain data so it survives fork/pickle."""

    regime: str
    mode: str
    compression: str = "none"
    seconds: float = 60.0
    warmup_s: float = 10.0  # trained (and averaged) before the measured window: steady state, not start-up
    settle_s: float = 5.0  # perturbed regimes: between the reference window and the perturbed one
    peers: int = 3
    sim_params: int = 25_000_000
    sim_step_s: float = 0.3
    sim_batch_size: int = 32
    cpu_batch_size: int = 64
    min_matchmaking_time: float = 5.0
    request_timeout: float = 3.0
    allreduce_timeout: float = 60.0
    next_chunk_timeout: float = 10.0
    setup_timeout: float = 90.0
    shutdown_grace: float = 5.0
    verbose: bool = False
    # > 0: a window that ends with no round applied inside it goes on until one is, for at most this many seconds
    # (a smoke test on a loaded machine, where a first round can fail and take allreduce_timeout); 0: fixed window
    extend_until_round_s: float = 0.0
    trace_dir: str | None = None  # time hivemind's matchmaking / DHT / AllReduce calls (benchmarks/hivemind_trace.py)
    hivemind_target_batch_size: int | None = None  # hivemind_optimizer: set by the orchestrator per regime

    @property
    def spec(self) -> Regime:
        return REGIMES[self.regime]

    @property
    def trainer_kind(self) -> str:
        return self.spec.trainer

    @property
    def target_group_size(self) -> int:
        return self.spec.target_group_size

    @property
    def perturbed_rank(self) -> int | None:
        """The last peer (never the bootstrap, rank 0) is the uneven one."""
        return self.peers - 1 if self.spec.perturbation else None

    def windows(self, t_train: float) -> tuple[float, float, float | None, float | None]:
        """(t0, t1): the measured (reference) window; (t2, t3): the perturbed window, None without perturbation.
        The perturbation starts at t1 and lasts until t3 (t1..t2 lets the swarm settle)."""
        t0 = t_train + self.warmup_s
        t1 = t0 + self.seconds
        if not self.spec.perturbation:
            return t0, t1, None, None
        return t0, t1, t1 + self.settle_s, t1 + self.settle_s + self.seconds


# ----------------------------------------------------------------------------------------------------- trainers


class SimModel(nn.Module):
    """Stand-in for a GPU model: only its size matters (it is what gets averaged), the compute is a sleep."""

    def __init__(self, num_params: int, num_tensors: int = 20):
        super().__init__()
        sizes = [num_params // num_tensors] * num_tensors
        sizes[-1] += num_params - sum(sizes)
        init = torch.Generator().manual_seed(0)  # the same weights on every peer, spread like trained ones: 8-bit
        # quantization scales by each tensor's spread, and a constant tensor would quantize without error
        self.weights = nn.ParameterList(nn.Parameter(0.02 * torch.randn(size, generator=init)) for size in sizes)
        self.register_buffer("running_stat", torch.zeros(1024))


BATCH_STAT_MOMENTUM = 0.1  # BatchNorm's default. (A step counter here, as before, differed between peers by up to
# a step's worth, 32 per step in norm, far more than a round's update of the weights: some rounds were refused as
# "update larger than expected", as a real peer with such a buffer would be.)


class SimTrainer:
    """Simulated accelerator: a local step is `sleep(step_s)`; gradients are fixed so optimizer.step stays cheap.
    slow_from: from that time on (time.time()), a step takes SLOW_STEP_FACTOR times longer (regime slow_step)."""

    def __init__(self, cfg: RunConfig, rank: int):
        self.model, self.batch_size, self.step_s = SimModel(cfg.sim_params), cfg.sim_batch_size, cfg.sim_step_s
        drift = torch.Generator().manual_seed(1000 + rank)
        for param in self.model.parameters():  # peers drift apart, so averaging matters
            param.grad = 1e-4 * torch.randn(param.shape, generator=drift)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        # a BatchNorm-like running statistic: an average of this peer's batches, which differ a little between peers
        self.batch_stat = 1.0 + 0.1 * torch.randn(self.model.running_stat.shape, generator=drift)
        self.last_loss: float | None = None
        self.needs_lock_for_compute = False  # the simulated compute never reads the parameters
        self.slow_from: float | None = None

    def compute(self) -> None:
        slow = self.slow_from is not None and time.time() >= self.slow_from
        time.sleep(self.step_s * (SLOW_STEP_FACTOR if slow else 1.0))
        self.model.running_stat.lerp_(self.batch_stat, BATCH_STAT_MOMENTUM)


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's bundled digits (no download): small, real, and fast enough to train on a shared CPU."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(digits.target)


class CpuTrainer:
    """Real CPU training of a ~0.5M-parameter CNN with BatchNorm (so buffers are averaged too)."""

    def __init__(self, cfg: RunConfig, rank: int, data: tuple[torch.Tensor, torch.Tensor]):
        torch.manual_seed(0)  # identical initialization on every peer, as in real data-parallel training
        self.model = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(64 * 8 * 8, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.images, self.labels = data
        self.batch_size = cfg.cpu_batch_size
        self.generator = torch.Generator().manual_seed(1000 + rank)  # each peer sees different batches
        self.last_loss: float | None = None
        self.needs_lock_for_compute = True  # autograd saves parameters between forward and backward

    def compute(self) -> None:
        index = torch.randint(0, len(self.images), (self.batch_size,), generator=self.generator)
        loss = nn.functional.cross_entropy(self.model(self.images[index]), self.labels[index])
        self.opt.zero_grad()
        loss.backward()
        self.last_loss = loss.item()


def make_trainer(cfg: RunConfig, rank: int, data: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
    return SimTrainer(cfg, rank) if cfg.trainer_kind == "sim" else CpuTrainer(cfg, rank, data or _digits())


# ----------------------------------------------------------------------------------------------------- drivers


class StepTimer:
    """Times the inner torch optimizer's steps with its own step hooks, in whatever thread runs them, and counts them.

    Why: how long averaging holds the trainer is the time a driver's optimizer-step call takes beyond the inner
    step, the same measure for every mode; hivemind.Optimizer runs the inner step in its executor thread, where only
    a hook on the optimizer itself sees it. The count is a step clock that moves exactly when the parameters take a
    local update, which is what staleness counts (updates between the snapshot and the apply).
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.updates, self.inner_s, self._started = 0, 0.0, 0.0
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.inner_s += time.perf_counter() - self._started
        self.updates += 1

    def hold(self, call: Callable[[], Any]) -> float:
        """Run call(); return the seconds it took beyond the inner optimizer steps that ran meanwhile."""
        inner_before, started = self.inner_s, time.perf_counter()
        call()
        return time.perf_counter() - started - (self.inner_s - inner_before)


class NoAveraging:
    """Baseline: every peer trains alone."""

    def __init__(self, trainer: Any):
        self.trainer, self.local_step = trainer, 0
        self.timer, self.holds = StepTimer(trainer.opt), []

    def begin(self) -> None:
        pass

    def train_step(self) -> None:
        self.trainer.compute()
        self.holds.append(self.timer.hold(self.trainer.opt.step))
        self.local_step += 1

    def records(self) -> list[dict]:
        return []

    def in_flight(self) -> list[dict]:
        return []

    def counters(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


def _compression(name: str) -> Any:
    """The same hivemind compression for `name` in every mode (uint8: benchmarks/uint8_compression.py)."""
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.uint8_compression import compression

    return compression(name)


def _old_averager_class() -> type:
    """TrainingAverager with a stage timer slotted *under* it in the MRO.

    Why: TrainingAverager.step blocks inside DecentralizedAverager.step, so we cannot see when matchmaking ends.
    The timer sits between them, runs the same step with wait=False and polls StepControl.stage.
    """
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage
    from hivemind.optim.training_averager import TrainingAverager

    class StageTimer(DecentralizedAverager):
        stage_times: dict[str, float] = {}

        def step(self, *args: Any, wait: bool = True, **kwargs: Any) -> Any:
            times: dict[str, float] = {"looking": time.time()}
            self.stage_times = times  # live: the driver reads it to see a round that is still in flight
            control = super().step(*args, wait=False, **kwargs)
            while not control.done():
                stage = control.stage
                if stage == AveragingStage.AWAITING_TRIGGER:
                    times.setdefault("group_formed", time.time())
                elif stage == AveragingStage.RUNNING_ALLREDUCE:
                    times.setdefault("group_formed", time.time())
                    times.setdefault("allreduce", time.time())
                time.sleep(0.01)  # same order as DecentralizedSGD's own 20 ms watcher; cheap on the GIL
            times["finished"] = time.time()
            return control.result()

    class TimedTrainingAverager(TrainingAverager, StageTimer):
        pass

    return TimedTrainingAverager


class StampedLock:
    """The data_lock handed to TrainingAverager: records (time, local step) whenever the averager takes it.

    The first acquisition in a round is the snapshot, the second one is the apply, which gives exact staleness.
    """

    def __init__(self, lock: threading.Lock, current_step: Callable[[], int]):
        self.lock, self.current_step, self.stamps = lock, current_step, []

    def __enter__(self) -> StampedLock:
        self.lock.acquire()
        self.stamps.append((time.time(), self.current_step()))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()


class OldDesign:
    """The pre-DecentralizedSGD way: a background thread loops `TrainingAverager.step(data_lock=lock)`.

    One round at a time, snapshot before matchmaking, delta rule through data_lock; the trainer holds the same lock
    for every optimizer step.
    """

    def __init__(self, trainer: Any, dht: Any, cfg: RunConfig, prefix: str):
        self.trainer, self.local_step, self.round = trainer, 0, 0
        self.lock, self.stop_event = threading.Lock(), threading.Event()
        self.holds: list[float] = []  # per step: the wait for the data lock (the averager's snapshot or apply)
        self._records: list[dict] = []
        self._current: dict | None = None
        buffers = [buf for buf in trainer.model.buffers() if buf.is_floating_point()]
        from benchmarks.uint8_compression import fixed_8bit_decoding

        with fixed_8bit_decoding():  # its averager process forks here and keeps hivemind's 8-bit decoding fixed
            self.averager = _old_averager_class()(
                trainer.opt,
                average_parameters=True,
                average_gradients=False,
                extra_tensors=buffers,
                initialize_optimizer=False,
                dht=dht,
                prefix=prefix,
                start=True,
                target_group_size=cfg.target_group_size,
                min_group_size=2,
                min_matchmaking_time=cfg.min_matchmaking_time,
                request_timeout=cfg.request_timeout,
                allreduce_timeout=cfg.allreduce_timeout,
                next_chunk_timeout=cfg.next_chunk_timeout,
                compression=_compression(cfg.compression),
            )
        self.thread = threading.Thread(target=self._loop, name="old-averaging", daemon=True)

    def begin(self) -> None:
        self.thread.start()

    def train_step(self) -> None:
        """The trainer holds the lock for its optimizer step. With real autograd it must also hold it through
        forward/backward: an in-place apply between them breaks backward ("modified by an inplace operation")."""
        if self.trainer.needs_lock_for_compute:
            asked = time.perf_counter()
            with self.lock:
                self.holds.append(time.perf_counter() - asked)
                self.trainer.compute()
                self.trainer.opt.step()
                self.local_step += 1
            time.sleep(0)  # let a waiting averager thread take the lock (a real loop would fetch data here)
            return
        self.trainer.compute()
        asked = time.perf_counter()
        with self.lock:
            self.holds.append(time.perf_counter() - asked)
            self.trainer.opt.step()
            self.local_step += 1

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            stamped = StampedLock(self.lock, lambda: self.local_step)
            record: dict[str, Any] = {"round": self.round, "t_start": time.time(), "error": None}
            self.averager.stage_times = {}
            self._current = record
            gathered = None
            try:
                gathered = self.averager.step(data_lock=stamped)
            except Exception as e:  # a failed round is data, not a crash
                record["error"] = repr(e)
            self._records.append(self._finish_record(record, stamped, gathered))
            self._current = None
            self.round += 1

    def _finish_record(self, record: dict, stamped: StampedLock, gathered: dict | None) -> dict:
        times = self.averager.stage_times
        record["t_end"] = time.time()
        record["applied"] = gathered is not None and len(stamped.stamps) >= 2
        record["group_size"] = len(gathered) if gathered else 0
        record["group"] = [str(peer) for peer in gathered] if gathered else None
        if stamped.stamps:
            record["step_at_snapshot"] = stamped.stamps[0][1]
        if record["applied"]:
            record["step_at_apply"] = stamped.stamps[1][1]
            record["staleness_steps"] = record["step_at_apply"] - record["step_at_snapshot"]
            # the averager copies while the trainer is inside its next step (0-based index == steps done so far)
            record["copy_step_indices"] = [record["step_at_snapshot"], record["step_at_apply"]]
        t_mm = times.get("looking", record["t_start"])
        t_group = times.get("group_formed", times.get("finished", record["t_end"]))
        t_ar = times.get("allreduce", t_group)
        t_fin = times.get("finished", record["t_end"])
        record.update(
            t_matchmaking_start=t_mm,
            t_group_formed=t_group,
            t_allreduce_start=t_ar,
            matchmaking_s=t_group - t_mm,
            awaiting_trigger_s=t_ar - t_group,
            allreduce_s=t_fin - t_ar,
        )
        return record

    def records(self) -> list[dict]:
        return list(self._records)

    def in_flight(self) -> list[dict]:
        """The round running right now (stages seen so far), so duty cycle counts it too."""
        current, times = self._current, dict(self.averager.stage_times)
        if current is None:
            return []
        return [
            {
                "round": current["round"],
                "t_start": current["t_start"],
                "t_group_formed": times.get("group_formed"),
                "t_allreduce_start": times.get("allreduce"),
                "in_flight": True,
            }
        ]

    def counters(self) -> dict:
        return {"rounds": self.round}

    def shutdown(self) -> None:
        self.stop_event.set()
        self.averager.shutdown()


class ImprovedDesign:
    """decentralized_sgd.DecentralizedSGD with one set of switches; imported lazily so `none`/`old` never need it."""

    def __init__(self, trainer: Any, dht: Any, cfg: RunConfig, prefix: str):
        sys.path.insert(0, str(REPO_ROOT))
        from decentralized_sgd import DecentralizedSGD
        from decentralized_sgd.scheduler import RoundSettings

        self.trainer, self.timer, self.holds = trainer, StepTimer(trainer.opt), []
        self.opt = DecentralizedSGD(
            trainer.opt,
            dht,
            prefix=prefix,
            model=trainer.model,
            target_group_size=cfg.target_group_size,
            min_matchmaking_time=cfg.min_matchmaking_time,
            request_timeout=cfg.request_timeout,
            allreduce_timeout=cfg.allreduce_timeout,
            next_chunk_timeout=cfg.next_chunk_timeout,
            compression=_compression(cfg.compression),
            settings=RoundSettings(min_group_size=2, verbose=cfg.verbose, **IMPROVED_OVERRIDES[cfg.mode]),
        )

    @property
    def local_step(self) -> int:
        return int(self.opt.local_step)

    def begin(self) -> None:
        pass

    def train_step(self) -> None:
        self.trainer.compute()
        self.holds.append(self.timer.hold(lambda: self.opt.step(batch_size=self.trainer.batch_size)))

    def records(self) -> list[dict]:
        return [dict(record) for record in list(self.opt.records)]

    def in_flight(self) -> list[dict]:
        """Rounds not resolved yet (their spans count towards the duty cycle up to the end of the window)."""
        return [dict(record, in_flight=True) for record in self.opt.in_flight_rounds()]

    def counters(self) -> dict:
        return dict(getattr(self.opt, "counters", {}) or {})

    def shutdown(self) -> None:
        self.opt.shutdown()


class RoundTap:
    """hivemind_optimizer's rounds as its TrainingStateAverager runs them, seen from inside (see
    _hivemind_optimizer_class): when each round's matchmaking began, when its group formed and its AllReduce began
    and ended (its StepControl's stage, polled), when the parameters went into it and when its result was applied,
    and how many local updates the parameters took in between.

    Why from inside: hivemind.Optimizer logs a round's outcome, not its times, and it copies and applies in
    background threads that a driver cannot see. The state averager runs one round at a time (its lock_averaging),
    and the optimizer applies a finished round before it starts the next, so the round that a copy or an apply
    belongs to is the one its _do took up last.
    """

    POLL_S = 0.02  # the order of DecentralizedSGD's own watcher and the old design's stage timer

    def __init__(self, updates: Callable[[], int], steps: Callable[[], int]):
        self.updates, self.steps = updates, steps  # the inner optimizer's updates; the trainer's completed steps
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.rounds: list[dict] = []  # "_control" (the live StepControl) is dropped when a record is read out
        self.active: dict | None = None
        self._adopt_in_thread: int | None = None  # _do had no usable pre-scheduled round: it starts one itself
        self.watcher = threading.Thread(target=self._watch, name="hivemind-round-watcher", daemon=True)

    def started(self, control: Any, t_start: float) -> None:
        """A round began matchmaking: pre-scheduled (schedule_step) or started by _do itself."""
        with self.lock:
            record = {
                "round": len(self.rounds),
                "t_start": t_start,
                "error": None,
                "applied": False,
                "prescheduled": True,
                "_control": control,
            }
            if self._adopt_in_thread == threading.get_ident():
                record["prescheduled"], self.active, self._adopt_in_thread = False, record, None
            self.rounds.append(record)

    def taken_up(self, control: Any) -> None:
        """_do is about to average: with this pre-scheduled round if it is still usable, else with a new one."""
        with self.lock:
            usable = control is not None and not (control.triggered or control.done())
            found = [r for r in self.rounds if usable and r.get("_control") is control]
            self.active = found[0] if found else None
            self._adopt_in_thread = None if found else threading.get_ident()

    def snapshot(self) -> None:
        """The parameters were copied into the averager: the delta rule's "before"."""
        with self.lock:
            if self.active is not None:
                self.active.update(
                    t_snapshot=time.time(), step_at_snapshot=self.updates(), snapshot_step_index=self.steps()
                )

    def applied(self) -> None:
        """The round's delta was added to the parameters (in the trainer's opt.step). It counts as applied if the
        round had finished by then with a group of two or more; a failed round applies a zero delta."""
        with self.lock:
            record = self.active
            if record is None or "t_snapshot" not in record or "t_applied" in record:
                return
            record.update(t_applied=time.time(), step_at_apply=self.updates(), apply_step_index=self.steps())
            control = record["_control"]
            if not control.done():
                record["error"] = "applied before the round ended (averaging_timeout)"
                return
            self._resolve(record, control)
            record["applied"] = record["error"] is None and record["group_size"] >= 2

    def _resolve(self, record: dict, control: Any) -> None:
        """A finished round's end time and outcome (group, or why none)."""
        record.setdefault("t_end", time.time())
        if "group_size" in record or record["error"]:
            return
        try:
            gathered = None if control.cancelled() else control.result(timeout=0)
        except BaseException as e:  # a failed round is data
            record["error"], gathered = repr(e), None
        record["group_size"] = len(gathered) if gathered else 0
        record["group"] = [str(peer) for peer in gathered] if gathered else None
        if not gathered and record["error"] is None:
            record["cancelled"] = bool(control.cancelled())
            record["error"] = "cancelled" if control.cancelled() else "no group"

    def _watch(self) -> None:
        from hivemind.averaging.control import AveragingStage

        while not self.stopped.wait(self.POLL_S):
            with self.lock:
                for record in self.rounds:
                    control = record.get("_control")
                    if control is None or "t_end" in record:
                        continue
                    now, stage = time.time(), control.stage
                    if stage.value >= AveragingStage.AWAITING_TRIGGER.value:
                        record.setdefault("t_group_formed", now)
                    if stage.value >= AveragingStage.RUNNING_ALLREDUCE.value:
                        record.setdefault("t_allreduce_start", now)
                    if control.done():
                        self._resolve(record, control)

    @staticmethod
    def _view(record: dict) -> dict:
        """A plain record in the shape the metrics read (spans, staleness, the steps that paid for copies)."""
        out = {k: v for k, v in record.items() if k != "_control"}
        t_start, t_end = out["t_start"], out.get("t_end")
        t_group, t_ar = out.get("t_group_formed"), out.get("t_allreduce_start")
        if t_end is not None and out.get("group_size", 0) >= 2:  # an AllReduce shorter than a poll: formed at end
            t_group = out["t_group_formed"] = t_group or t_end
            t_ar = out["t_allreduce_start"] = t_ar or t_end
        out["t_matchmaking_start"] = t_start
        if t_group is not None:
            out["matchmaking_s"] = t_group - t_start
        if t_group is not None and t_ar is not None:
            out["awaiting_trigger_s"] = t_ar - t_group
        if t_ar is not None and t_end is not None:
            out["allreduce_s"] = t_end - t_ar
        if out.get("step_at_apply") is not None and out.get("step_at_snapshot") is not None:
            out["staleness_steps"] = out["step_at_apply"] - out["step_at_snapshot"]
        out["copy_step_indices"] = [out[k] for k in ("snapshot_step_index", "apply_step_index") if k in out]
        return out

    def records(self) -> list[dict]:
        with self.lock:
            for record in self.rounds:  # a round that ended since the last poll
                if "t_end" not in record and record["_control"].done():
                    self._resolve(record, record["_control"])
            return [self._view(r) for r in self.rounds if "t_end" in r]

    def in_flight(self) -> list[dict]:
        with self.lock:
            return [
                {
                    "round": r["round"],
                    "t_start": r["t_start"],
                    "t_group_formed": r.get("t_group_formed"),
                    "t_allreduce_start": r.get("t_allreduce_start"),
                    "in_flight": True,
                }
                for r in self.rounds
                if "t_end" not in r
            ]


def _hivemind_optimizer_class() -> type:
    """hivemind.Optimizer, unchanged in what it does, whose TrainingStateAverager reports to a RoundTap.

    The optimizer builds its state averager in _make_state_averager; this subclass lets it, with the module's
    TrainingStateAverager swapped for a subclass for that one call. The subclass puts a tap *under*
    TrainingStateAverager in the MRO (as the old design's StageTimer does): schedule_step and _do both start rounds
    with super().step, i.e. DecentralizedAverager.step, which returns the round's StepControl.
    """
    import hivemind
    from hivemind.averaging import DecentralizedAverager
    from hivemind.optim import optimizer as optimizer_module
    from hivemind.optim.state_averager import TrainingStateAverager

    class ControlTap(DecentralizedAverager):
        tap: RoundTap | None = None

        def step(self, *args: Any, **kwargs: Any) -> Any:
            started = time.time()
            control = super().step(*args, **kwargs)
            if self.tap is not None:
                self.tap.started(control, started)
            return control

    class TappedStateAverager(TrainingStateAverager, ControlTap):
        def _do(
            self,
            wait_for_trigger: Any,
            optimizer_step: bool,
            zero_grad: bool,
            averaging_round: bool,
            averaging_control: Any,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            if averaging_round and self.tap is not None:
                self.tap.taken_up(averaging_control)
            return super()._do(
                wait_for_trigger, optimizer_step, zero_grad, averaging_round, averaging_control, *args, **kwargs
            )

        def _load_local_tensors_into_averager_(self) -> None:
            super()._load_local_tensors_into_averager_()
            if self.tap is not None:
                self.tap.snapshot()

        def _apply_averaging_results_(self) -> None:
            super()._apply_averaging_results_()
            if self.tap is not None:
                self.tap.applied()

    class TappedOptimizer(hivemind.Optimizer):
        state_loads = 0  # times it found itself out of sync and downloaded the state from a peer

        def _make_state_averager(self, **kwargs: Any) -> Any:
            with mock.patch.object(optimizer_module, "TrainingStateAverager", TappedStateAverager):
                return super()._make_state_averager(**kwargs)

        def load_state_from_peers(self, **kwargs: Any) -> None:
            self.state_loads += 1
            super().load_state_from_peers(**kwargs)

    return TappedOptimizer


def nominal_rate(cfg: RunConfig) -> float | None:
    """Samples/s per peer a simulated step allows (None for real training, whose rate is only known by timing)."""
    return cfg.sim_batch_size / cfg.sim_step_s if cfg.trainer_kind == "sim" else None


def hivemind_target_batch_size(
    cfg: RunConfig, runs: Sequence[dict], data: tuple | None, scale: float = 1.0
) -> tuple[int, dict]:
    """target_batch_size for hivemind_optimizer: the swarm's samples in one min_matchmaking_time (times `scale`,
    --hivemind-target-scale: longer epochs, to see what fewer rounds buy back).

    Why: a global epoch is hivemind.Optimizer's only chance to average (average_state_every=1), and a group that
    cannot fill forms no sooner than matchmaking_time, so this many samples per epoch lets it average about as often
    as our rounds can. The rate is what a user would read off the swarm: the `improved` run of the same regime (the
    same averaging load on the same CPUs; in perturbed regimes its reference window), else `none`'s, else the
    nominal rate of a simulated step or, for real training, a second of it timed here.
    """
    done = {
        r["mode"]: r
        for r in runs
        if r["regime"] == cfg.regime
        and r.get("compression") == cfg.compression
        and not r.get("error")
        and not r.get("skipped")
    }
    rate, source = None, None
    for mode in ("improved", "none"):
        run = done.get(mode, {})
        rate = (run.get("reference") or {}).get("samples_per_s_per_peer") or run.get("samples_per_s_per_peer")
        if rate:
            source = f"{mode} run"
            break
    if not rate:
        rate, source = nominal_rate(cfg), "nominal"
    if not rate:
        rate, source = _timed_rate(cfg, data), "timed here"
    target = max(1, round(rate * cfg.peers * cfg.min_matchmaking_time * scale))
    return target, {
        "target_batch_size": target,
        "rate_samples_per_s_per_peer": rate,
        "rate_source": source,
        "scale": scale,
        "matchmaking_time": cfg.min_matchmaking_time,
        "averaging_timeout": cfg.allreduce_timeout,
        "average_state_every": 1,
        "compression": cfg.compression,
    }


def _timed_rate(cfg: RunConfig, data: tuple | None, seconds: float = 1.0) -> float:
    """One peer's samples/s training alone on one thread (as peers do), when no run of the regime measured it."""
    trainer, threads = make_trainer(cfg, 0, data), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            trainer.compute()
            trainer.opt.step()
            steps += 1
        return steps * trainer.batch_size / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)


class HivemindOptimizerDesign:
    """hivemind.Optimizer(use_local_updates=True): local steps, parameters averaged in the background once every
    global epoch (average_state_every=1) with the delta rule. What a user of hivemind would run instead of us.

    Set up as a knowledgeable user would: matchmaking_time = our min_matchmaking_time, averaging_timeout (and so
    allreduce_timeout) = our allreduce_timeout, our next_chunk_timeout, request_timeout and group sizes, the same
    compression, float buffers averaged as extra_tensors, target_batch_size from hivemind_target_batch_size.
    """

    def __init__(self, trainer: Any, dht: Any, cfg: RunConfig, prefix: str):
        sys.path.insert(0, str(REPO_ROOT))
        from benchmarks.uint8_compression import fixed_8bit_decoding

        self.trainer, self.local_step, self.holds = trainer, 0, []
        self.epoch_times: list[float] = []  # when this peer entered each new global epoch
        self.tap = RoundTap(lambda: self.timer.updates, lambda: self.local_step)
        target = cfg.hivemind_target_batch_size or max(
            1, round((nominal_rate(cfg) or 1000.0) * cfg.peers * cfg.min_matchmaking_time)
        )
        buffers = [buf for buf in trainer.model.buffers() if buf.is_floating_point()]
        with fixed_8bit_decoding():  # as for the old design: its averager process forks here and keeps the fix
            self.opt = _hivemind_optimizer_class()(
                dht=dht,
                run_id=prefix,
                target_batch_size=target,
                batch_size_per_step=trainer.batch_size,
                optimizer=trainer.opt,
                use_local_updates=True,
                matchmaking_time=cfg.min_matchmaking_time,
                averaging_timeout=cfg.allreduce_timeout,
                next_chunk_timeout=cfg.next_chunk_timeout,
                average_state_every=1,
                state_averaging_compression=_compression(cfg.compression),
                extra_tensors=buffers,
                load_state_timeout=cfg.allreduce_timeout,
                averager_opts=dict(
                    target_group_size=cfg.target_group_size, min_group_size=2, request_timeout=cfg.request_timeout
                ),
                shutdown_timeout=max(1.0, cfg.shutdown_grace),
                verbose=cfg.verbose,
            )
        self.timer = StepTimer(trainer.opt)  # after hivemind's zero-gradient step that creates optimizer state
        self.opt.state_averager.tap = self.tap
        self.epoch = self.opt.local_epoch

    def begin(self) -> None:
        self.tap.watcher.start()

    def train_step(self) -> None:
        self.trainer.compute()
        self.holds.append(self.timer.hold(lambda: self.opt.step(batch_size=self.trainer.batch_size)))
        self.local_step += 1
        if self.opt.local_epoch != self.epoch:
            self.epoch = self.opt.local_epoch
            self.epoch_times.append(time.time())

    def records(self) -> list[dict]:
        return self.tap.records()

    def in_flight(self) -> list[dict]:
        return self.tap.in_flight()

    def counters(self) -> dict:
        prescheduled = sum(1 for r in self.tap.records() if r.get("prescheduled"))
        return {
            "rounds": len(self.tap.rounds),
            "prescheduled_rounds": prescheduled,
            "epochs": self.opt.local_epoch,
            "state_loads": self.opt.state_loads,
        }

    def shutdown(self) -> None:
        self.tap.stopped.set()
        self.opt.shutdown()


def make_driver(cfg: RunConfig, trainer: Any, dht: Any) -> Any:
    prefix = f"bench_{cfg.regime}_{cfg.mode}"
    if cfg.mode == "none":
        return NoAveraging(trainer)
    if cfg.mode == "old":
        return OldDesign(trainer, dht, cfg, prefix)
    if cfg.mode == "hivemind_optimizer":
        return HivemindOptimizerDesign(trainer, dht, cfg, prefix)
    return ImprovedDesign(trainer, dht, cfg, prefix)


# ----------------------------------------------------------------------------------------------------- peer process


@dataclass
class Channels:
    """IPC between the orchestrator and peers: one message queue each way plus a shared start time; `net_ready`:
    every peer's link is plugged in (regimes with links)."""

    to_parent: Any
    maddrs: Any
    start_at: Any
    go: Any
    net_ready: Any


def _start_dht(rank: int, cfg: RunConfig, channels: Channels) -> Any:
    """Peer 0 is the bootstrap; the others join it. Loopback, or the peer's own link in the link regimes."""
    import hivemind

    host = [f"/ip4/{netns.host_address(rank) if cfg.spec.link_mbit else '127.0.0.1'}/tcp/0"]
    if rank == 0:
        dht = hivemind.DHT(start=True, host_maddrs=host)
        addrs = [str(addr) for addr in dht.get_visible_maddrs()]
        for _ in range(cfg.peers - 1):
            channels.maddrs.put(addrs)
        return dht
    addrs = channels.maddrs.get(timeout=cfg.setup_timeout)
    return hivemind.DHT(start=True, initial_peers=addrs, host_maddrs=host)


def _train_window(cfg: RunConfig, trainer: Any, driver: Any, t_train: float) -> dict:
    """Train for warmup_s + seconds from t_train (the measured window [t0, t1] is the last `seconds`), and in the
    perturbed regimes on until t3. Remember when every local step ended (for throughput and the timeline)."""
    step_times: list[float] = []
    losses: list[float] = []
    t0, t1, t2, t3 = cfg.windows(t_train)
    end = t1 if t3 is None else t3
    extend = cfg.extend_until_round_s if t3 is None and cfg.mode != "none" else 0.0
    extended, last_look = False, 0.0
    while True:
        now = time.time()
        if now >= end:
            if now >= t1 + extend or (now - last_look >= 0.2 and _window_has_round(driver, t0)):
                break
            extended, last_look = True, now
        driver.train_step()
        step_times.append(time.time())
        if trainer.last_loss is not None:
            losses.append(trainer.last_loss)
    if extended:  # an extended window ends with its last step; a fixed one stays [t0, t1]
        t1 = step_times[-1]
    tail = losses[-20:]
    return {
        "t_train": t_train,
        "t0": t0,
        "t1": t1,
        "t2": t2,
        "t3": t3,
        "step_times": step_times,
        "hold_s": list(driver.holds),
        "epoch_times": getattr(driver, "epoch_times", None),
        "batch_size": trainer.batch_size,
        "loss_tail": sum(tail) / len(tail) if tail else None,
    }


def _window_has_round(driver: Any, t0: float) -> bool:
    """Whether a round was applied inside the window that began at t0 and, for hivemind.Optimizer, a global epoch
    began inside it too (its rounds start at an epoch's end): what the window's metrics need to be defined."""
    offset = time.time() - time.monotonic()
    applied = any(r.get("applied") and (_to_wall(r.get("t_end"), offset) or 0.0) >= t0 for r in driver.records())
    epochs = getattr(driver, "epoch_times", None)
    return applied and (epochs is None or any(t > t0 for t in epochs))


def _suffix(cfg: RunConfig) -> str:
    return "" if cfg.compression == "none" else f"_{cfg.compression}"


def log_path(cfg: RunConfig, rank: int) -> Path:
    return LOG_DIR / f"{cfg.regime}_{cfg.mode}{_suffix(cfg)}_peer{rank}.log"


def _all_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in [*model.parameters(), *model.buffers()] if t.is_floating_point())


def _redirect_output(cfg: RunConfig, rank: int) -> None:
    """Send this peer's (and its children's) stdout/stderr to a log file: keeps the table readable, keeps evidence."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path(cfg, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _peer_main(rank: int, cfg: RunConfig, channels: Channels, data: tuple | None) -> None:
    """Entry point of one peer process. Reports exactly one result (or error) message, then cleans up."""
    os.setpgrp()  # own process group: the orchestrator can kill this peer's DHT/averager/p2pd children in one go
    torch.set_num_threads(1)
    if not cfg.verbose:
        _redirect_output(cfg, rank)
        logging.getLogger("hivemind").setLevel(logging.WARNING)
    dht = driver = None
    try:
        phases = {"start": time.time()}
        if cfg.spec.link_mbit:
            netns.enter_own_namespace()  # the orchestrator plugs our link in meanwhile
        trainer = make_trainer(cfg, rank, data)
        phases["trainer"] = time.time()
        if cfg.spec.link_mbit and not channels.net_ready.wait(cfg.setup_timeout):
            raise TimeoutError("the orchestrator never plugged in our network link")
        if cfg.trace_dir:  # before the DHT and the averager fork: they inherit the timers
            import hivemind_trace

            hivemind_trace.install(Path(cfg.trace_dir) / f"{cfg.mode}{_suffix(cfg)}" / f"peer{rank}")
        dht = None if cfg.mode == "none" else _start_dht(rank, cfg, channels)
        phases["dht"] = time.time()
        driver = make_driver(cfg, trainer, dht)
        phases["driver"] = time.time()
        channels.to_parent.put(("ready", rank, phases))
        if not channels.go.wait(cfg.setup_timeout):
            raise TimeoutError("orchestrator never said go")
        time.sleep(max(0.0, channels.start_at.value - time.time()))
        if cfg.spec.perturbation == "slow_step" and rank == cfg.perturbed_rank:
            trainer.slow_from = cfg.windows(channels.start_at.value)[1]
        driver.begin()
        result = _train_window(cfg, trainer, driver, channels.start_at.value)
        result.update(
            rank=rank,
            records=driver.records(),
            in_flight=driver.in_flight(),
            counters=driver.counters(),
            final_step=driver.local_step,
            clock_offset=time.time() - time.monotonic(),
            peer_id=None if dht is None else str(dht.peer_id),
            finite=_all_finite(trainer.model),
        )
        channels.to_parent.put(("result", rank, result))
    except BaseException:
        channels.to_parent.put(("error", rank, traceback.format_exc()))
    finally:
        for name, closer in (("driver", driver), ("dht", dht)):
            t_close = time.time()
            try:
                if closer is not None:
                    closer.shutdown()
            except Exception:
                traceback.print_exc()
            print(f"[bench peer {rank}] {name} shutdown took {time.time() - t_close:.2f}s", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------- orchestration


def _kill_group(pid: int | None) -> None:
    """Kill a peer and everything it spawned (DHT, averager, p2pd). Only the groups we created, by id."""
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(channels: Channels, cfg: RunConfig, kind: str, deadline: float) -> dict[int, Any]:
    """Wait for one `kind` message from every peer; an error message from any peer aborts the run."""
    got: dict[int, Any] = {}
    while len(got) < cfg.peers:
        try:
            msg_kind, rank, payload = channels.to_parent.get(timeout=max(0.1, deadline - time.time()))
        except queue.Empty:
            missing = sorted(set(range(cfg.peers)) - set(got))
            raise TimeoutError(f"peers {missing} did not report '{kind}' in time") from None
        if msg_kind == "error":
            raise RuntimeError(f"peer {rank} failed:\n{payload}")
        got[rank] = payload
        if time.time() > deadline and len(got) < cfg.peers:
            raise TimeoutError(f"timed out waiting for '{kind}'")
    return got


class Throttle(threading.Thread):
    """Orchestrator: between `start` and `stop` (time.time()), stop process group `pgid` for STRAGGLER_STOP_S out of
    every STRAGGLER_STOP_S + STRAGGLER_RUN_S seconds, as a box whose CPUs other work saturates. Leaves it running."""

    def __init__(self, pgid: int, start: float, stop: float):
        super().__init__(name="straggler-throttle", daemon=True)
        self.pgid, self.start_at, self.stop_at = pgid, start, stop
        self.cancelled = threading.Event()
        self.stopped_s = self.throttled_s = 0.0

    def run(self) -> None:
        self.cancelled.wait(max(0.0, self.start_at - time.time()))
        began = time.time()
        try:
            while not self.cancelled.is_set() and time.time() < self.stop_at:
                t_stop = time.time()
                os.killpg(self.pgid, signal.SIGSTOP)
                self.cancelled.wait(STRAGGLER_STOP_S)
                os.killpg(self.pgid, signal.SIGCONT)
                self.stopped_s += time.time() - t_stop
                self.cancelled.wait(STRAGGLER_RUN_S)
        except ProcessLookupError:  # the peer is gone: its own error message says why
            pass
        finally:
            self.throttled_s = time.time() - began
            self._resume()

    def _resume(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self.cancelled.set()
        if self.is_alive():
            self.join()
        self._resume()


def _unavailable(cfg: RunConfig) -> str | None:
    """Why this run cannot run with the code at hand (it is then reported as skipped), or None."""
    overrides = IMPROVED_OVERRIDES.get(cfg.mode, {})
    if overrides:
        sys.path.insert(0, str(REPO_ROOT))
        from decentralized_sgd.scheduler import RoundSettings

        missing = [key for key in overrides if key not in RoundSettings.__dataclass_fields__]
        if missing:
            return f"RoundSettings has no {', '.join(missing)} flag"
    return None


def _plug_in_links(cfg: RunConfig, procs: Sequence[Any], channels: Channels) -> None:
    """Link regimes: once each peer process is in its own network namespace, give it its shaped link."""
    for rank, proc in enumerate(procs):
        netns.wait_for_own_namespace(proc.pid, cfg.setup_timeout)
        netns.plug_in(proc.pid, rank, cfg.spec.link_mbit)
    channels.net_ready.set()


def run_one(cfg: RunConfig, data: tuple | None = None) -> dict:
    """Run one (regime, mode) with fresh peer processes and fresh DHTs; always kill every process it started."""
    summary: dict[str, Any] = {
        "regime": cfg.regime,
        "mode": cfg.mode,
        "compression": cfg.compression,
        "error": None,
        "skipped": _unavailable(cfg),
    }
    if summary["skipped"]:
        return summary
    ctx = mp.get_context("fork")
    channels = Channels(ctx.Queue(), ctx.Queue(), ctx.Value("d", 0.0), ctx.Event(), ctx.Event())
    procs = [ctx.Process(target=_peer_main, args=(rank, cfg, channels, data)) for rank in range(cfg.peers)]
    started = time.time()
    summary["loadavg_1m_before"] = os.getloadavg()[0]
    peers: dict[int, dict] = {}
    throttle = None
    try:
        for proc in procs:
            proc.start()
        if cfg.spec.link_mbit:
            _plug_in_links(cfg, procs, channels)
        ready = _collect(channels, cfg, "ready", time.time() + cfg.setup_timeout)
        summary["setup_s"] = max(p["driver"] for p in ready.values()) - started
        summary["setup_phases_s"] = {  # slowest peer per phase: where setup time goes
            name: max(p[name] - p[prev] for p in ready.values())
            for prev, name in pairwise(("start", "trainer", "dht", "driver"))
        }
        channels.start_at.value = time.time() + 0.2  # every peer starts its window at the same instant
        _, t1, _, t3 = cfg.windows(channels.start_at.value)
        if cfg.spec.perturbation == "straggler":
            throttle = Throttle(procs[cfg.perturbed_rank].pid, start=t1, stop=t3)
            throttle.start()
        channels.go.set()
        last_end = (t1 if t3 is None else t3) + cfg.extend_until_round_s
        peers = _collect(channels, cfg, "result", last_end + cfg.setup_timeout)
    except Exception as e:
        summary["error"] = f"{type(e).__name__}: {e}"[-2000:]
        summary["logs"] = [str(log_path(cfg, rank)) for rank in range(cfg.peers)]
    finally:
        if throttle is not None:
            throttle.close()
            summary["straggler_stopped_share"] = _ratio(throttle.stopped_s, throttle.throttled_s)
        deadline = time.time() + cfg.shutdown_grace
        for proc in procs:
            proc.join(max(0.0, deadline - time.time()))
        summary["clean_exit"] = all(proc.exitcode == 0 for proc in procs)
        for proc in procs:
            _kill_group(proc.pid)
        for proc in procs:
            proc.join(1.0)
        if cfg.spec.link_mbit:
            for rank in range(cfg.peers):
                netns.unplug(rank)
    summary["wall_s"] = time.time() - started
    summary["loadavg_1m_after"] = os.getloadavg()[0]  # others share these 2 cores: keep the evidence with the number
    summary.update(summarize_run(cfg, [peers[rank] for rank in sorted(peers)]))
    return summary


# ----------------------------------------------------------------------------------------------------- metrics


def _to_wall(value: float | None, offset: float) -> float | None:
    """Records may use time.time() or time.monotonic(); bring both to wall time (monotonic values are small)."""
    if value is None:
        return None
    return float(value) + offset if value < 1e9 else float(value)


def round_spans(record: dict, offset: float, t_open: float | None = None) -> list[tuple[str, float, float]]:
    """(stage, start, end) spans of one round: matchmaking, awaiting trigger, AllReduce (wall clock).

    Prefers absolute stage times; falls back to chaining durations. Stages of an in-flight round end at `t_open`.
    """
    t_start = _to_wall(record.get("t_matchmaking_start", record.get("t_start")), offset)
    if t_start is None:
        return []
    end = _to_wall(record.get("t_end"), offset) or t_open or t_start
    mm, aw, ar = (record.get(k) for k in ("matchmaking_s", "awaiting_trigger_s", "allreduce_s"))
    t_group = _to_wall(record.get("t_group_formed"), offset) or (t_start + mm if mm is not None else None)
    t_allreduce = _to_wall(record.get("t_allreduce_start"), offset) or (
        t_group + aw if t_group is not None and aw is not None else None
    )
    spans = [("matchmaking", t_start, t_group if t_group is not None else end)]
    if t_group is not None:
        spans.append(("awaiting", t_group, t_allreduce if t_allreduce is not None else end))
    if t_allreduce is not None:
        spans.append(("allreduce", t_allreduce, t_allreduce + ar if ar is not None else end))
    return [(name, a, b) for name, a, b in spans if b > a]


def _union_length(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of intervals clipped to [lo, hi] (pipelined rounds overlap; count wall time once)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            total += (cur_b - cur_a) if cur_b is not None else 0.0
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + ((cur_b - cur_a) if cur_b is not None else 0.0)


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _staleness(record: dict) -> float | None:
    if record.get("staleness_steps") is not None:
        return float(record["staleness_steps"])
    if record.get("step_at_apply") is not None and record.get("step_at_snapshot") is not None:
        return float(record["step_at_apply"] - record["step_at_snapshot"])
    return None


def _copy_step_indices(record: dict) -> list[int]:
    """0-based indices of the local steps that paid for this round's copies (snapshot/fill and apply).

    DecentralizedSGD copies inside on_step_end of step number `step_at_*` (1-based), i.e. index step_at_* - 1.
    """
    if "copy_step_indices" in record:
        return list(record["copy_step_indices"])
    return [record[k] - 1 for k in ("step_at_snapshot", "step_at_apply") if record.get(k) is not None]


def _peer_metrics(peer: dict, window: tuple[str, str] = ("t0", "t1"), others: frozenset[str] = frozenset()) -> dict:
    """One peer's numbers over its window [peer[window[0]], peer[window[1]]]; rounds count if they finished inside it.
    with_others: of its applied rounds, how many had a peer of `others` in the group."""
    t0, t1, offset = peer[window[0]], peer[window[1]], peer["clock_offset"]
    window = t1 - t0
    step_times = peer["step_times"]
    # duration of every local step since training began; those that ended inside the window are measured
    all_durations = [b - a for a, b in pairwise([peer.get("t_train", t0)] + step_times)]
    measured = [i for i, t in enumerate(step_times) if t0 < t <= t1]
    in_window = [r for r in peer["records"] if t0 <= (_to_wall(r.get("t_end"), offset) or math.inf) <= t1]
    applied = [r for r in in_window if r.get("applied")]
    ends = sorted(_to_wall(r["t_end"], offset) for r in applied)
    busy = [(a, b) for r in peer["records"] + peer.get("in_flight", []) for _, a, b in round_spans(r, offset, t1)]

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in applied if r.get(key) is not None]

    durations = [all_durations[i] for i in measured]
    measured_set = set(measured)
    formed_to_end = [
        r["awaiting_trigger_s"] + r["allreduce_s"]
        for r in applied
        if r.get("awaiting_trigger_s") is not None and r.get("allreduce_s") is not None
    ]
    copy_steps = {i for r in applied for i in _copy_step_indices(r) if i in measured_set}
    holds = peer.get("hold_s") or []
    held = [holds[i] for i in measured if i < len(holds)]
    epoch_times = peer.get("epoch_times")

    return {
        # whole steps over the time they took: no error from a step cut in half by the window's edges
        "rate": len(durations) * peer["batch_size"] / sum(durations) if durations else 0.0,
        "rounds_per_min": len(applied) / (window / 60.0),
        "round_interval": _mean([b - a for a, b in pairwise(ends)]),
        "duty": _union_length(busy, t0, t1) / window,
        "applied": len(applied),
        "failed": sum(1 for r in in_window if r.get("error")),
        "skipped": sum(1 for r in in_window if not r.get("applied") and not r.get("error")),
        "step_durations": durations,
        "copy_step_durations": [all_durations[i] for i in sorted(copy_steps)],
        "other_step_durations": [all_durations[i] for i in measured if i not in copy_steps],
        "staleness": [s for s in map(_staleness, applied) if s is not None],
        "group_size": [float(r["group_size"]) for r in applied if r.get("group_size")],
        "allreduce_s": values("allreduce_s"),
        "matchmaking_s": values("matchmaking_s"),
        "awaiting_s": values("awaiting_trigger_s"),
        "formed_to_end_s": formed_to_end,
        "with_others": sum(1 for r in applied if others & set(r.get("group") or ())),
        "hold": held,
        "hold_total": sum(held),
        "hold_share": sum(held) / sum(durations) if durations else None,
        "epochs_per_min": (
            None if epoch_times is None else sum(1 for t in epoch_times if t0 < t <= t1) / (window / 60.0)
        ),
    }


def summarize_peers(
    peers: list[dict], window: tuple[str, str] = ("t0", "t1"), others: frozenset[str] = frozenset()
) -> dict:
    """Per-run metrics over one window: rates and duty cycle averaged over peers, per-round values pooled over peers.
    with_perturbed_peer_share: the share of applied rounds whose group held one of `others`."""
    if not peers:
        return {}
    per_peer = [_peer_metrics(peer, window, others) for peer in peers]

    def pooled(key: str) -> list[float]:
        return [v for m in per_peer for v in m[key]]

    step_mean, allreduce_mean = _mean(pooled("step_durations")), _mean(pooled("allreduce_s"))
    applied_total = sum(m["applied"] for m in per_peer)
    counters: dict[str, float] = {}
    for peer in peers:
        for key, value in (peer.get("counters") or {}).items():
            if isinstance(value, (int, float)):
                counters[key] = counters.get(key, 0) + value
    return {
        "window_s": _mean([peer[window[1]] - peer[window[0]] for peer in peers]),  # longer if a window was extended
        "samples_per_s_per_peer": _mean([m["rate"] for m in per_peer]),
        "rounds_per_min": _mean([m["rounds_per_min"] for m in per_peer]),
        "staleness_steps_mean": _mean(pooled("staleness")),
        "staleness_steps_p95": _percentile(pooled("staleness"), 0.95),
        "duty_cycle": _mean([m["duty"] for m in per_peer]),
        "group_size_mean": _mean(pooled("group_size")),
        "rounds_applied": sum(m["applied"] for m in per_peer),
        "rounds_failed": sum(m["failed"] for m in per_peer),
        "rounds_skipped": sum(m["skipped"] for m in per_peer),
        "round_interval_s": _mean([m["round_interval"] for m in per_peer if m["round_interval"] is not None]),
        "rounds_per_min_steady": _mean([60 / m["round_interval"] for m in per_peer if m["round_interval"]]),
        "step_s_mean": step_mean,
        "step_s_p95": _percentile(pooled("step_durations"), 0.95),
        "allreduce_s_mean": allreduce_mean,
        "matchmaking_s_mean": _mean(pooled("matchmaking_s")),
        "awaiting_s_mean": _mean(pooled("awaiting_s")),
        "formed_to_end_s_mean": _mean(pooled("formed_to_end_s")),
        "with_perturbed_peer_share": (
            sum(m["with_others"] for m in per_peer) / applied_total if others and applied_total else None
        ),
        "all_finite": all(peer.get("finite", True) for peer in peers),
        "allreduce_steps_mean": allreduce_mean / step_mean if allreduce_mean is not None and step_mean else None,
        # trainer-side cost of averaging: steps that did (or waited for) a snapshot/fill or apply vs the others
        "copy_step_s_mean": _mean(pooled("copy_step_durations")),
        "other_step_s_median": _percentile(pooled("other_step_durations"), 0.5),
        "loss_tail": _mean([p["loss_tail"] for p in peers if p.get("loss_tail") is not None]),
        # how long averaging held the trainer, over the steps that ended in the window (whole steps, as for the rate):
        # per peer in all, per step, the longest, and as a share of those steps' time
        "hold_s_total": _mean([m["hold_total"] for m in per_peer]),
        "hold_ms_per_step": None if not pooled("hold") else 1000 * _mean(pooled("hold")),
        "hold_s_max": max(pooled("hold"), default=None),
        "hold_share": _mean([m["hold_share"] for m in per_peer if m["hold_share"] is not None]),
        "epochs_per_min": _mean([m["epochs_per_min"] for m in per_peer if m["epochs_per_min"] is not None]),
        "counters": counters or None,
        "peers": peers,
    }


COMPACT_KEYS = (
    "samples_per_s_per_peer",
    "rounds_per_min",
    "rounds_per_min_steady",
    "staleness_steps_mean",
    "group_size_mean",
    "rounds_applied",
    "rounds_failed",
    "formed_to_end_s_mean",
    "allreduce_s_mean",
    "matchmaking_s_mean",
    "awaiting_s_mean",
    "with_perturbed_peer_share",
    "all_finite",
    "hold_s_total",
    "hold_ms_per_step",
    "epochs_per_min",
    "counters",
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_run(cfg: RunConfig, peers: list[dict]) -> dict:
    """summarize_peers, plus what each regime is about: in perturbed regimes the healthy peers' perturbed window
    (the main numbers) against their reference window and the perturbed peer; with links, the cap on rounds/min."""
    if not peers:
        return {}
    if not cfg.spec.perturbation:
        summary = summarize_peers(peers)
    else:
        slow = [p for p in peers if p["rank"] == cfg.perturbed_rank]
        healthy = [p for p in peers if p["rank"] != cfg.perturbed_rank]
        slow_ids = frozenset(p["peer_id"] for p in slow if p.get("peer_id"))
        reference = summarize_peers(healthy, ("t0", "t1"), slow_ids)
        summary = summarize_peers(healthy, ("t2", "t3"), slow_ids)
        summary["reference"] = {key: reference.get(key) for key in COMPACT_KEYS}
        summary["perturbed_peer"] = {
            key: value for key, value in summarize_peers(slow, ("t2", "t3")).items() if key in COMPACT_KEYS
        }
        summary["rounds_per_min_vs_reference"] = _ratio(summary["rounds_per_min"], reference["rounds_per_min"])
        summary["rounds_per_min_steady_vs_reference"] = _ratio(
            summary["rounds_per_min_steady"], reference["rounds_per_min_steady"]
        )
        summary["all_finite"] = all(p.get("finite", True) for p in peers)
        summary["peers"] = peers
    if cfg.spec.link_mbit and summary.get("allreduce_s_mean"):
        # one AllReduce at a time, and a group that cannot fill forms no sooner than min_matchmaking_time
        summary["rounds_per_min_cap"] = min(60 / cfg.min_matchmaking_time, 60 / summary["allreduce_s_mean"])
        for key in ("rounds_per_min", "rounds_per_min_steady"):
            summary[f"{key}_vs_cap"] = _ratio(summary[key], summary["rounds_per_min_cap"])
    if summary.get("allreduce_steps_mean") is not None:
        summary["staleness_bound"] = summary["allreduce_steps_mean"] + 1
    return summary


def add_throughput_ratios(runs: list[dict]) -> None:
    """throughput_ratio = samples/s of a mode divided by `none` of the same regime (None if no baseline ran)."""
    baseline = {r["regime"]: r.get("samples_per_s_per_peer") for r in runs if r["mode"] == "none"}
    for run in runs:
        base, rate = baseline.get(run["regime"]), run.get("samples_per_s_per_peer")
        run["throughput_ratio"] = rate / base if base and rate is not None else None


def _check(regime: str, text: str, value: float | None, threshold: float | None, at_most: bool) -> dict:
    met = None if value is None or threshold is None else (value <= threshold if at_most else value >= threshold)
    return {"regime": regime, "target": text, "value": value, "threshold": threshold, "met": met}


def uneven_targets(runs: list[dict]) -> list[dict]:
    """Issue 11's goals for `improved` in the regimes that ran: an uneven peer does not slow the others, and on a
    100 Mbit/s link the rounds keep up with the cap."""
    results = []
    for run in runs:
        if run["mode"] != "improved" or run.get("skipped") or run.get("error"):
            continue
        regime = run["regime"]
        label = regime if run["compression"] == "none" else f"{regime}/{run['compression']}"
        if regime == "straggler":
            results += [
                _check(
                    label, "healthy rounds/min >= 0.7 x unthrottled", run.get("rounds_per_min_vs_reference"), 0.7, False
                ),
                _check(label, "no failed round among the healthy peers", run.get("rounds_failed"), 0, True),
                _check(label, "every peer's tensors finite", float(bool(run.get("all_finite"))), 1.0, False),
            ]
        elif regime == "slow_step":
            reference = (run.get("reference") or {}).get("formed_to_end_s_mean")
            results.append(
                _check(
                    label,
                    "fast peers' group formed -> round end <= all-fast + 0.1 s",
                    run.get("formed_to_end_s_mean"),
                    None if reference is None else reference + 0.1,
                    True,
                )
            )
        elif regime == "wan_100mbit":
            results += [
                _check(label, "steady rounds/min >= 0.95 x cap", run.get("rounds_per_min_steady_vs_cap"), 0.95, False),
                _check(
                    label,
                    "staleness mean <= AllReduce steps + 1",
                    run.get("staleness_steps_mean"),
                    run.get("staleness_bound"),
                    True,
                ),
            ]
    return results


def evaluate_targets(runs: list[dict], regime: str = "sim_not_full") -> list[dict]:
    """The team's goals for `improved` vs `old` (brief); None where a needed run is missing."""
    cells = {(r["regime"], r["mode"]): r for r in runs if r.get("compression", "none") == "none"}
    if (regime, "improved") not in cells and (regime, "old") not in cells:
        return uneven_targets(runs)
    new, old = cells.get((regime, "improved"), {}), cells.get((regime, "old"), {})

    def get(run: dict, key: str) -> float | None:
        return run.get(key)

    def scaled(value: float | None, factor: float, offset: float = 0.0) -> float | None:
        return None if value is None else value * factor + offset

    checks = [  # (description, value, threshold, value must be <= threshold)
        (
            "staleness mean <= AllReduce steps + 1",
            get(new, "staleness_steps_mean"),
            scaled(get(new, "allreduce_steps_mean"), 1.0, 1.0),
            True,
        ),
        (
            "staleness mean <= 0.5 x old",
            get(new, "staleness_steps_mean"),
            scaled(get(old, "staleness_steps_mean"), 0.5),
            True,
        ),
        ("rounds/min >= 1.8 x old", get(new, "rounds_per_min"), scaled(get(old, "rounds_per_min"), 1.8), False),
        (
            "steady-state rounds/min (60 / interval between applied rounds) >= 1.8 x old",
            get(new, "rounds_per_min_steady"),
            scaled(get(old, "rounds_per_min_steady"), 1.8),
            False,
        ),
        ("throughput ratio >= 0.97", get(new, "throughput_ratio"), 0.97, False),
        ("duty cycle >= 0.95", get(new, "duty_cycle"), 0.95, False),
    ]
    results = [_check(regime, *check) for check in checks]
    return results + uneven_targets(runs)


def targets_markdown(targets: list[dict]) -> str:
    lines = ["", "Targets (improved):"]
    for t in targets:
        mark = {True: "MET", False: "MISSED", None: "n/a"}[t["met"]]
        value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        threshold = "n/a" if t["threshold"] is None else f"{t['threshold']:.3g}"
        lines.append(f"- {mark}: [{t['regime']}] {t['target']} (observed {value}, threshold {threshold})")
    return "\n".join(lines)


def run_metadata(args: argparse.Namespace, started: float) -> dict:
    """What the numbers depend on: versions, the exact optimizer file, and how busy the shared machine was."""
    import hivemind

    package = REPO_ROOT / "decentralized_sgd"
    sources = sorted(package.glob("*.py")) if package.is_dir() else [REPO_ROOT / "decentralized_sgd.py"]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources if path.exists())).hexdigest()[:16]
    return {
        "argv": sys.argv[1:],
        "quick": args.quick,
        "started": time.strftime("%F %T", time.localtime(started)),
        "total_s": time.time() - started,
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "torch": torch.__version__,
        "hivemind": hivemind.__version__,
        "decentralized_sgd_sha256": digest,
    }


# ----------------------------------------------------------------------------------------------------- reporting

TABLE_COLUMNS = [  # (header, key, format)
    ("regime", "regime", "{}"),
    ("mode", "mode", "{}"),
    ("samples/s/peer", "samples_per_s_per_peer", "{:.1f}"),
    ("thr ratio", "throughput_ratio", "{:.3f}"),
    ("rounds/min", "rounds_per_min", "{:.1f}"),
    ("steady r/min", "rounds_per_min_steady", "{:.1f}"),
    ("stale mean", "staleness_steps_mean", "{:.1f}"),
    ("stale p95", "staleness_steps_p95", "{:.1f}"),
    ("duty", "duty_cycle", "{:.2f}"),
    ("group", "group_size_mean", "{:.2f}"),
    ("failed", "rounds_failed", "{}"),
    ("AR s", "allreduce_s_mean", "{:.2f}"),
    ("AR steps", "allreduce_steps_mean", "{:.1f}"),
    ("MM s", "matchmaking_s_mean", "{:.2f}"),
    ("AW s", "awaiting_s_mean", "{:.2f}"),
    ("hold s", "hold_s_total", "{:.2f}"),
    ("hold ms/step", "hold_ms_per_step", "{:.1f}"),
    ("load", "loadavg_1m_after", "{:.1f}"),
    ("error", "error", "{}"),
]


UNEVEN_COLUMNS = [  # perturbed regimes: the healthy peers, reference window vs perturbed window
    ("regime", "regime", "{}"),
    ("mode", "mode", "{}"),
    ("r/min reference", "reference.rounds_per_min", "{:.1f}"),
    ("r/min perturbed", "rounds_per_min", "{:.1f}"),
    ("ratio", "rounds_per_min_vs_reference", "{:.2f}"),
    ("steady ratio", "rounds_per_min_steady_vs_reference", "{:.2f}"),
    ("formed->end s reference", "reference.formed_to_end_s_mean", "{:.3f}"),
    ("formed->end s perturbed", "formed_to_end_s_mean", "{:.3f}"),
    ("MM s", "matchmaking_s_mean", "{:.2f}"),
    ("group", "group_size_mean", "{:.2f}"),
    ("with slow peer", "with_perturbed_peer_share", "{:.2f}"),
    ("failed", "rounds_failed", "{}"),
    ("slow peer r/min", "perturbed_peer.rounds_per_min", "{:.1f}"),
    ("slow peer starved s", "perturbed_peer.counters.starved_s", "{:.0f}"),
    ("slow DHT node bans", "counters.slow_dht_node_bans", "{:.0f}"),
    ("finite", "all_finite", "{}"),
    ("stale mean", "staleness_steps_mean", "{:.1f}"),
    ("hold s", "hold_s_total", "{:.2f}"),
    ("hold ms/step", "hold_ms_per_step", "{:.1f}"),
    ("load", "loadavg_1m_after", "{:.1f}"),
    ("error", "error", "{}"),
]
LINK_COLUMNS = [  # bandwidth-limited links
    ("regime", "regime", "{}"),
    ("compression", "compression", "{}"),
    ("mode", "mode", "{}"),
    ("AR s", "allreduce_s_mean", "{:.2f}"),
    ("AR steps", "allreduce_steps_mean", "{:.1f}"),
    ("rounds/min", "rounds_per_min", "{:.1f}"),
    ("steady r/min", "rounds_per_min_steady", "{:.1f}"),
    ("cap", "rounds_per_min_cap", "{:.1f}"),
    ("steady / cap", "rounds_per_min_steady_vs_cap", "{:.2f}"),
    ("stale mean", "staleness_steps_mean", "{:.1f}"),
    ("AR steps + 1", "staleness_bound", "{:.1f}"),
    ("MM s", "matchmaking_s_mean", "{:.2f}"),
    ("group", "group_size_mean", "{:.2f}"),
    ("failed", "rounds_failed", "{}"),
    ("hold s", "hold_s_total", "{:.2f}"),
    ("hold ms/step", "hold_ms_per_step", "{:.1f}"),
    ("load", "loadavg_1m_after", "{:.1f}"),
    ("error", "error", "{}"),
]


def _cell(run: dict, key: str, fmt: str) -> str:
    """A run's value under `key` ("a.b": run["a"]["b"]); an error or skip reason shortened to one line."""
    value: Any = run
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if key == "error" and value is None and run.get("skipped"):
        value = f"skipped: {run['skipped']}"
    text = "" if value is None else fmt.format(value)
    return text.splitlines()[0][:90] if key == "error" and text else text


def markdown_table(runs: list[dict], columns: Sequence[tuple[str, str, str]] = TABLE_COLUMNS) -> str:
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(run, key, fmt) for _, key, fmt in columns) + " |" for run in runs]
    return "\n".join(lines)


def report_tables(runs: list[dict]) -> str:
    """One table per kind of regime that ran: plain, uneven swarm (perturbed), bandwidth-limited links."""
    kinds = [
        (
            [r for r in runs if not REGIMES[r["regime"]].perturbation and not REGIMES[r["regime"]].link_mbit],
            TABLE_COLUMNS,
        ),
        ([r for r in runs if REGIMES[r["regime"]].perturbation], UNEVEN_COLUMNS),
        ([r for r in runs if REGIMES[r["regime"]].link_mbit], LINK_COLUMNS),
    ]
    return "\n\n".join(markdown_table(chosen, columns) for chosen, columns in kinds if chosen)


def hivemind_setup_markdown(runs: list[dict]) -> str:
    """How each hivemind_optimizer run was set up, and whether its epochs came as often as that setup meant."""
    lines = []
    for run in runs:
        setup = run.get("hivemind_setup")
        if not setup:
            continue
        label = run["regime"] if run.get("compression", "none") == "none" else f"{run['regime']}/{run['compression']}"
        counters, peers = run.get("counters") or {}, (run.get("config") or {}).get("peers")
        epochs = run.get("epochs_per_min")
        scale = setup.get("scale", 1.0)
        scaled, epoch_s = ("" if scale == 1.0 else f" x {scale:g}"), setup["matchmaking_time"] * scale
        lines.append(
            f"- {label}: target_batch_size {setup['target_batch_size']} = {peers} peers x "
            f"{setup['rate_samples_per_s_per_peer']:.1f} samples/s ({setup['rate_source']}) x "
            f"{setup['matchmaking_time']:g} s{scaled}; epochs/min {'n/a' if epochs is None else f'{epochs:.1f}'} "
            f"(one per {epoch_s:g} s: {60 / epoch_s:.1f}); rounds "
            f"pre-scheduled {counters.get('prescheduled_rounds', 0):.0f} of {counters.get('rounds', 0):.0f}; "
            f"state downloads {counters.get('state_loads', 0):.0f} (all peers, whole run)"
        )
    if not lines:
        return ""
    return (
        "\n\nhivemind_optimizer: hivemind.Optimizer(use_local_updates=True, average_state_every=1), "
        "matchmaking_time = min_matchmaking_time, averaging_timeout = our allreduce_timeout, same compression; "
        "hold = time in opt.step() beyond the inner optimizer step; staleness = inner updates between the copy "
        "into the averager and the apply\n" + "\n".join(lines)
    )


def _old_copy_spans(record: dict) -> list[tuple[str, float, float]]:
    """Old design only: snapshot before matchmaking and apply after AllReduce, both under data_lock (not duty)."""
    if "t_matchmaking_start" not in record or record.get("allreduce_s") is None:
        return []
    allreduce_end = record["t_allreduce_start"] + record["allreduce_s"]
    spans = [("copy", record["t_start"], record["t_matchmaking_start"]), ("copy", allreduce_end, record["t_end"])]
    return [(name, a, b) for name, a, b in spans if b > a]


def plot_timeline(
    runs: list[dict], path: Path, regime: str = "sim_not_full", modes: Sequence[str] = ("old", "improved")
) -> None:
    """Per peer: matchmaking / awaiting / AllReduce spans as bars (two lanes so pipelined rounds stay visible),
    ticks at every local step, dots where a round's result was applied; gray: the old design's snapshot/apply."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    by_cell = {(r["regime"], r["mode"]): r for r in runs if r.get("peers")}
    chosen = [by_cell.get((regime, mode)) for mode in modes]
    if not any(chosen):
        print(f"[bench] no {regime} runs of {modes} to plot; skipping {path}", file=sys.stderr)
        return
    fig, axes = plt.subplots(len(modes), 1, figsize=(14, 2.2 + 1.3 * 3 * len(modes)), squeeze=False)
    for ax, mode, run in zip(axes[:, 0], modes, chosen, strict=True):
        ax.set_title(f"{regime} / {mode}" + ("" if run else " (not run)"))
        if not run:
            continue
        for row, peer in enumerate(run["peers"]):
            t0, offset, base = peer.get("t_train", peer["t0"]), peer["clock_offset"], row * 1.5
            for record in peer["records"] + peer.get("in_flight", []):
                lane = base + 0.5 * (int(record.get("round") or 0) % 2)
                for name, a, b in round_spans(record, offset, t_open=peer["t1"]) + _old_copy_spans(record):
                    ax.broken_barh([(a - t0, b - a)], (lane, 0.45), color=SPAN_COLORS[name], alpha=0.85)
                t_applied = _to_wall(record.get("t_applied", record.get("t_end")), offset)
                if record.get("applied") and t_applied is not None:
                    ax.plot(t_applied - t0, lane + 0.22, "k.", markersize=4)
            ticks = [t - t0 for t in peer["step_times"]]
            ax.vlines(ticks, base - 0.25, base - 0.05, color="black", linewidth=0.5)
        ax.set_yticks([row * 1.5 + 0.5 for row in range(len(run["peers"]))])
        ax.set_yticklabels([f"peer {p['rank']}" for p in run["peers"]])
        first = run["peers"][0]
        t_train = first.get("t_train", first["t0"])
        ax.axvspan(0, first["t0"] - t_train, color="0.9", zorder=0)
        ax.set_xlim(0, first["t1"] - t_train)
        ax.set_xlabel(
            "seconds since training began (shaded: warm-up, not measured; ticks: local steps, dots: result applied)"
        )
    handles = [Patch(color=c, label=n) for n, c in SPAN_COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _json_ready(run: dict, keep_peers: bool) -> dict:
    """Drop bulky per-step data from JSON unless it is needed to reproduce the plot."""
    out = {k: v for k, v in run.items() if k != "peers"}
    if keep_peers and run.get("peers"):
        out["peers"] = run["peers"]
    return out


# ----------------------------------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="shorter runs (the default regimes and modes in ~5 min on 2 cores), 5M-param sim model "
        "and min_matchmaking_time 2 s in the sim/cpu regimes",
    )
    parser.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=list(DEFAULT_REGIMES))
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES), help="among each regime's own modes"
    )
    parser.add_argument(
        "--compressions",
        nargs="+",
        choices=["none", "fp16", "uint8"],
        default=None,
        help="instead of each regime's own (none; fp16 and uint8 in the wan_* regimes)",
    )
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per run (and per window)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds trained before the measured window")
    parser.add_argument(
        "--extend-until-round",
        type=float,
        default=0.0,
        metavar="S",
        help="a measured window with no applied round goes on until one is, for at most S more "
        "seconds (smoke tests on a loaded machine; default 0: fixed windows)",
    )
    parser.add_argument("--peers", type=int, default=None, help="instead of each regime's own (3; straggler 5)")
    parser.add_argument("--sim-params", type=int, default=None, help="parameters of the simulated model")
    parser.add_argument("--min-matchmaking-time", type=float, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json-peers", action="store_true", help="also store per-peer step times and records")
    parser.add_argument("--verbose", action="store_true", help="keep hivemind / DecentralizedSGD logs")
    parser.add_argument(
        "--hivemind-target-scale",
        type=float,
        default=1.0,
        help="hivemind_optimizer: target_batch_size times this (default 1: the swarm's samples in "
        "one min_matchmaking_time)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="time every hivemind matchmaking / DHT / AllReduce call into this folder "
        "(summary: benchmarks/hivemind_trace.py)",
    )
    return parser.parse_args(argv)


def _regime_config(args: argparse.Namespace, name: str) -> RunConfig:
    """Defaults, then --quick's, then the regime's own settings (and their --quick variant), then the command line.
    Full runs use the nominal setting (25M params, 5 s matchmaking); --quick shrinks but never drops cells."""
    regime = REGIMES[name]
    base = RunConfig(
        regime=name,
        mode="none",
        peers=args.peers or regime.peers or 3,
        verbose=args.verbose,
        trace_dir=None if args.trace is None else str(args.trace.resolve() / name),
    )
    if args.quick:  # setup is not measured: its timeout only catches a hung start (p2pd alone took > 40 s at load 15)
        base = replace(
            base,
            seconds=6.0,
            warmup_s=3.0,
            sim_params=5_000_000,
            min_matchmaking_time=2.0,
            request_timeout=1.0,
            allreduce_timeout=20.0,
            setup_timeout=90.0,
            shutdown_grace=0.5,
        )
    base = replace(base, **{**regime.nominal, **(regime.quick if args.quick else {})})
    if args.seconds is not None:
        base = replace(base, seconds=args.seconds)
    if args.warmup is not None:
        base = replace(base, warmup_s=args.warmup)
    base = replace(base, extend_until_round_s=args.extend_until_round)
    if args.sim_params is not None:
        base = replace(base, sim_params=args.sim_params)
    if args.min_matchmaking_time is not None:
        mmt = args.min_matchmaking_time
        base = replace(base, min_matchmaking_time=mmt, request_timeout=min(base.request_timeout, 0.6 * mmt))
    return base


def build_configs(args: argparse.Namespace) -> list[RunConfig]:
    """Every chosen regime with each of its modes (among --modes) and compressions."""
    baseline_seconds = 4.0 if args.quick and args.seconds is None else None  # `none` has no rounds to wait for
    configs = []
    for name in (r for r in REGIMES if r in args.regimes):
        base, regime = _regime_config(args, name), REGIMES[name]
        for mode in (m for m in MODES if m in args.modes and m in regime.modes):
            for compression in args.compressions or regime.compressions:
                cfg = replace(base, mode=mode, compression=compression)
                if mode == "none":
                    cfg = replace(cfg, seconds=baseline_seconds or cfg.seconds, warmup_s=min(cfg.warmup_s, 1.0))
                if mode == "hivemind_optimizer":
                    cfg = replace(cfg, warmup_s=max(cfg.warmup_s, hivemind_startup_s(cfg)))
                configs.append(cfg)
    return configs


def hivemind_startup_s(cfg: RunConfig) -> float:
    """How long hivemind.Optimizer takes to reach its steady state: the warm-up it gets (at least).

    Why: its ProgressTracker starts with no rate estimate, so its first look at the swarm's progress is up to
    max_refresh_period (10 s by default) away; until then a peer counts only its own samples towards the first
    epoch. The first epoch, then its round (matchmaking_time and more), are start-up, which the other modes' shorter
    warm-ups do not have to cover.
    """
    from hivemind.optim.progress_tracker import ProgressTracker

    first_look = inspect.signature(ProgressTracker.__init__).parameters["max_refresh_period"].default
    return float(first_look) + 2 * cfg.min_matchmaking_time


def _prewarm(configs: Sequence[RunConfig]) -> None:
    """Pay one-time import costs (torch.optim takes ~2 s on first use) once, before forking peers."""
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    import hivemind  # noqa: F401
    from hivemind.optim.training_averager import TrainingAverager  # noqa: F401

    if any(cfg.mode in IMPROVED_OVERRIDES or cfg.mode == "hivemind_optimizer" for cfg in configs):
        sys.path.insert(0, str(REPO_ROOT))
        try:
            import decentralized_sgd  # noqa: F401
        except Exception as e:  # each run will report the failure in its own row
            print(f"[bench] cannot import decentralized_sgd: {e!r}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    warnings.filterwarnings("ignore")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the `finally` that kills peer process groups
    args = parse_args(argv)
    configs = build_configs(args)
    if any(cfg.spec.link_mbit for cfg in configs):
        if not netns.inside():  # peers need network namespaces: rerun this command inside a user namespace
            netns.reexec_inside([str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)])
        netns.create_bridge()
    data = _digits() if any(c.trainer_kind == "cpu" for c in configs) else None  # load once, share via fork
    _prewarm(configs)
    started, runs = time.time(), []
    for cfg in configs:
        setup = None
        if cfg.mode == "hivemind_optimizer":  # from the runs of its regime so far: improved's rate, else none's
            target, setup = hivemind_target_batch_size(cfg, runs, data, args.hivemind_target_scale)
            cfg = replace(cfg, hivemind_target_batch_size=target)
        print(
            f"[bench] {cfg.regime:>13} / {cfg.mode:<18} / {cfg.compression:<5} ...",
            end=" ",
            flush=True,
            file=sys.stderr,
        )
        run = run_one(cfg, data)
        if setup is not None:
            run["hivemind_setup"] = setup
        run["config"] = {k: v for k, v in asdict(cfg).items() if k not in ("regime", "mode", "verbose")}
        runs.append(run)
        status = (
            f"skipped: {run['skipped']}"
            if run["skipped"]
            else "ok"
            if not run["error"]
            else run["error"].splitlines()[0][:120]
        )
        print(f"{run.get('wall_s', 0.0):.1f}s {status}", flush=True, file=sys.stderr)
    add_throughput_ratios(runs)
    targets = evaluate_targets(runs)
    report = report_tables(runs) + hivemind_setup_markdown(runs) + "\n" + targets_markdown(targets)
    print(report)
    print(f"\n[bench] total {time.time() - started:.0f}s for {len(runs)} runs", file=sys.stderr)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(report + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "runs": [_json_ready(r, args.json_peers) for r in runs],
            "targets": targets,
            "meta": run_metadata(args, started),
        }
        args.json.write_text(json.dumps(payload, indent=1, default=str))
    if args.plot:
        plot_timeline(runs, args.plot)
    return runs


if __name__ == "__main__":
    main()
