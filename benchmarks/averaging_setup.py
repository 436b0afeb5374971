"""bench_averaging's workloads: the regimes (how peers train, how groups form, what is uneven), the settings of one
run, the trainers (a simulated accelerator, real CPU training on the digits) and hivemind.Optimizer's setup."""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

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
ABLATIONS: dict[str, dict[str, Any]] = {  # the DecentralizedSGD switches that define each mode
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
SLOW_STEP_FACTOR = 20.0


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

    def averager_options(self) -> dict[str, Any]:
        """The settings every arm's averager takes alike (DecentralizedSGD's names, which the baselines share)."""
        return dict(
            target_group_size=self.target_group_size,
            min_matchmaking_time=self.min_matchmaking_time,
            request_timeout=self.request_timeout,
            allreduce_timeout=self.allreduce_timeout,
            next_chunk_timeout=self.next_chunk_timeout,
            compression=self.compression,
        )

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
