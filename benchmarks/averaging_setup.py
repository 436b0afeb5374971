"""bench_averaging's workloads: the regimes (how groups form, what is uneven), the settings of one run, the
simulated accelerator."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

ABLATED = ("no_delta", "no_refresh", "no_pipeline", "fill_at_boundary", "no_slow_peer_fixes")  # improved, one off
BASE_MODES = ("none", "old", "improved", *ABLATED)
MODES = (*BASE_MODES, "fill_at_once")
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
FAST_SWARM = dict(sim_params=100_000, sim_step_s=0.05, min_matchmaking_time=1.0, request_timeout=0.5)
FAST_SWARM.update(next_chunk_timeout=2.0, allreduce_timeout=15.0)
WAN = dict(sim_params=25_600_000, sim_step_s=0.3, min_matchmaking_time=5.0, request_timeout=3.0)
WAN.update(allreduce_timeout=60.0, setup_timeout=120.0)


@dataclass(frozen=True)
class Regime:
    """A workload: how peers train, how groups form, what is uneven about the swarm and its links."""

    target_group_size: int
    peers: int | None = None  # None: --peers
    modes: tuple[str, ...] = BASE_MODES
    perturbation: str | None = None  # "straggler" | "slow_step": a reference window, then the last peer perturbed
    link_mbit: float | None = None  # every peer in its own network namespace behind a link of this rate
    compressions: tuple[str, ...] = ("none",)
    nominal: dict[str, Any] = field(default_factory=dict)  # RunConfig settings of this regime
    quick: dict[str, Any] = field(default_factory=dict)  # and in --quick (applied over `nominal`)


REGIMES: dict[str, Regime] = {
    "sim_full": Regime(3),
    "sim_not_full": Regime(4),
    "straggler": Regime(
        4,
        peers=5,
        modes=("old", "improved", "no_slow_peer_fixes"),
        perturbation="straggler",
        nominal=FAST_SWARM,
        quick=dict(seconds=15.0, settle_s=3.0),
    ),
    "slow_step": Regime(
        3,
        peers=3,
        modes=("old", "improved", "fill_at_boundary"),
        perturbation="slow_step",
        nominal=FAST_SWARM,
        quick=dict(seconds=10.0, settle_s=2.0),
    ),
    "wan_100mbit": Regime(
        4,
        peers=3,
        modes=("old", "improved", "fill_at_once"),
        link_mbit=100.0,
        compressions=("fp16", "uint8"),
        nominal=dict(WAN, warmup_s=20.0),
        quick=dict(seconds=20.0, warmup_s=10.0),
    ),
    "wan_1gbit": Regime(
        4,
        peers=3,
        modes=("old", "improved"),
        link_mbit=1000.0,
        compressions=("fp16", "uint8"),
        nominal=dict(WAN, warmup_s=20.0),
        quick=dict(seconds=20.0, warmup_s=10.0),
    ),
}
DEFAULT_REGIMES = ("sim_full", "sim_not_full")
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
        self.slow_from: float | None = None

    def compute(self) -> None:
        slow = self.slow_from is not None and time.time() >= self.slow_from
        time.sleep(self.step_s * (SLOW_STEP_FACTOR if slow else 1.0))
        self.model.running_stat.lerp_(self.batch_stat, BATCH_STAT_MOMENTUM)
