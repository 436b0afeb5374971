"""The ideal swarm of ``bench_optimizer.py`` (mode ``ideal``): the swarm's peers as replicas in one process, averaged
exactly, in lock-step, every ``period`` local steps: no hivemind, no timing, no lost rounds.

Why: ``swarm − ideal`` at the same period is what the system costs, ``ideal − ddp`` what periodic averaging costs;
``IdealOptions`` puts the system's factors back one at a time and tries the algorithm's levers.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import torch
import torch.nn as nn

from decentralized_sgd.outer import OuterOptimizer, OuterSettings

GROUPS = ("all", "pairs")  # pairs: each round averages one random pair of peers (the third trains on alone)
WIRES = ("exact", "fp16", "uint8")  # exact, or decentralized_sgd.compression's --compression by that name


@dataclass(frozen=True)
class IdealOptions:
    period: int  # H: local steps between rounds
    group: str = "all"
    staleness: int = 0  # the round's snapshot is taken this many steps before its update is applied (< period)
    momentum_buffers: str = "local"  # local | average (as --average_optimizer_state) | reset (zeroed after a round)
    outer: OuterSettings = OuterSettings()
    spacing: float = 1.0  # the rounds of a run at steps T·(k/K)^spacing (K = T / period): > 1 denser early (post-local)
    wire: str = "exact"  # what crosses hivemind's AllReduce: exact, or compressed as --compression fp16 / 8-bit would

    def __post_init__(self) -> None:
        if self.period < 1 or not 0 <= self.staleness < self.period:
            raise ValueError(f"need period >= 1 and 0 <= staleness < period, got {self.period}, {self.staleness}")
        if self.spacing <= 0:
            raise ValueError(f"spacing must be > 0, got {self.spacing}")
        if self.wire not in WIRES:
            raise ValueError(f"unknown wire {self.wire!r}: one of {sorted(WIRES)}")
        if self.group not in GROUPS or self.momentum_buffers not in ("local", "average", "reset"):
            raise ValueError(f"unknown group {self.group!r} or momentum_buffers {self.momentum_buffers!r}")


class Replica:
    """One peer: its model, optimizer, data order and outer optimizer; ``snapshot``: its values at the fill."""

    def __init__(self, model: nn.Module, lr: float, momentum: float, batches, outer: OuterSettings):
        self.model, self.batches = model, batches
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        self.params = list(model.parameters())
        self.outer = OuterOptimizer(outer, self.params) if outer.enabled else None
        self.snapshot: list[torch.Tensor] | None = None

    def momenta(self) -> list[torch.Tensor]:
        return [self.optimizer.state[p]["momentum_buffer"] for p in self.params if p in self.optimizer.state]

    def tensors(self, with_momenta: bool) -> list[torch.Tensor]:
        return self.params + (self.momenta() if with_momenta else [])


def through_the_wire(tensors: list[torch.Tensor], wire: str) -> list[torch.Tensor]:
    """The tensors as the other side of hivemind's AllReduce reads them: compressed as ``wire``, decoded by hivemind."""
    if wire == "exact":
        return tensors
    from hivemind.compression import CompressionInfo

    from benchmarks.uint8_compression import compression as make_compression
    from benchmarks.uint8_compression import fixed_8bit_decoding

    compression = make_compression(wire)
    with fixed_8bit_decoding():
        return [
            compression.extract(compression.compress(t, CompressionInfo.from_tensor(t))).to(t.dtype) for t in tensors
        ]


@torch.no_grad()
def average_round(members: list[Replica], options: IdealOptions) -> None:
    """Average of the members' snapshots, applied with the delta rule (and the outer step), now; a compressed ``wire``
    as hivemind's AllReduce: an update is Q(mean(Q(s)) − Q(s_i)), each one's rounding error stays in its weights."""
    with_momenta = options.momentum_buffers == "average" and all(r.momenta() for r in members)
    snapshots = [r.snapshot or [t.clone() for t in r.tensors(with_momenta)] for r in members]
    sent = [through_the_wire(snapshot, options.wire) for snapshot in snapshots]
    mean = [torch.stack(parts).mean(0) for parts in zip(*sent, strict=True)]
    for replica, received in zip(members, sent, strict=True):
        update = through_the_wire(torch._foreach_sub(mean, received), options.wire)  # m − s (exact wire)
        if replica.outer is not None:
            replica.outer.step_(update, mean)
        torch._foreach_add_(replica.tensors(with_momenta), update)
        if options.momentum_buffers == "reset":
            torch._foreach_zero_(replica.momenta())
        replica.snapshot = None


def round_steps(steps: int, options: IdealOptions) -> set[int]:
    """After which local steps a round averages: every ``period`` steps, or as many rounds spaced by ``spacing``."""
    if options.spacing == 1.0:
        return set(range(options.period, steps, options.period))
    count = (steps - 1) // options.period
    return {max(1, round(steps * (k / (count + 1)) ** options.spacing)) for k in range(1, count + 1)}


def train_ideal(spec, settings, data, options: IdealOptions, helpers) -> list[dict]:
    """Every replica's result, in a bench_optimizer peer's shape; ``helpers``: the task's module (optimizer_plan)."""
    peers = settings.peers
    steps, total_batch = spec.steps(settings), spec.total_batch(settings)
    initial = helpers.make_model(spec.seed)
    replicas = [
        Replica(
            copy.deepcopy(initial),
            spec.peak_lr(settings, rank),
            settings.momentum,
            helpers.Batches(data, 1000 * spec.seed + rank),
            options.outer,
        )
        for rank in range(peers)
    ]
    pairs = random.Random(spec.seed)
    evaluates = set(helpers.checkpoint_steps(steps, settings.curve_points))
    curves: list[list[dict]] = [[] for _ in replicas]
    rounds = [0] * peers
    with_momenta = options.momentum_buffers == "average"
    averages_after = round_steps(steps, options)
    fills_after = {step - options.staleness for step in averages_after}

    def evaluate(step: int) -> None:
        for replica, curve in zip(replicas, curves, strict=True):
            curve.append(
                {
                    "step": step,
                    "swarm_samples": step * total_batch,
                    "local_samples": step * settings.batch,
                    "accuracy": helpers.test_accuracy(replica.model, data),
                }
            )

    if 0 in evaluates:
        evaluate(0)
    for step in range(steps):
        lr = None
        for rank, replica in enumerate(replicas):
            images, labels = replica.batches.next(settings.batch)
            lr = helpers.lr_at(step * total_batch, settings, spec.peak_lr(settings, rank))
            for group in replica.optimizer.param_groups:
                group["lr"] = lr
            loss = nn.functional.cross_entropy(replica.model(images), labels)
            replica.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            replica.optimizer.step()
        done = step + 1
        if options.staleness and done in fills_after:
            for replica in replicas:  # the fill, k steps before the apply
                replica.snapshot = [t.detach().clone() for t in replica.tensors(with_momenta)]
        if done in averages_after:
            members = replicas if options.group == "all" else pairs.sample(replicas, 2)
            average_round(members, options)
            for replica in members:
                rounds[replicas.index(replica)] += 1
            for replica in replicas:
                replica.snapshot = None
        if done in evaluates:
            evaluate(done)
    return [
        {
            "rank": rank,
            "batch": settings.batch,
            "steps": steps,
            "local_samples": steps * settings.batch,
            "peak_lr": spec.peak_lr(settings, rank),
            "curve": curve,
            "final_accuracy": curve[-1]["accuracy"],
            "rounds_applied": rounds[rank],
            "steps_per_round": steps / rounds[rank] if rounds[rank] else None,
            "outer_steps": replicas[rank].outer.steps if replicas[rank].outer is not None else 0,
        }
        for rank, curve in enumerate(curves)
    ]
