"""The ideal swarm's round (benchmarks/ideal_swarm.py), exactly: what bench_optimizer's mode ``ideal`` measures
against. No DHT, no processes: three replicas of a small model in this process."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from benchmarks.ideal_swarm import IdealOptions, Replica, average_round
from decentralized_sgd.outer import OuterSettings


def replicas(values: list[float]) -> list[Replica]:
    """One replica per value: a linear layer of 300x300 (over 2^16 values: 8-bit on the uint8 wire) and its bias
    (fp16 there), the weights drawn around the value."""
    made = []
    for index, value in enumerate(values):
        torch.manual_seed(index)
        model = nn.Linear(300, 300)
        with torch.no_grad():
            model.weight.normal_(value, 0.05)
            model.bias.fill_(value)
        made.append(Replica(model, lr=0.1, momentum=0.9, batches=None, outer=OuterSettings()))
    return made


def weights(replica: Replica) -> torch.Tensor:
    return replica.model.weight.detach().clone()


def test_an_exact_round_gives_every_replica_the_mean() -> None:
    members = replicas([0.0, 1.0, 2.0])
    mean = torch.stack([weights(r) for r in members]).mean(0)
    average_round(members, IdealOptions(period=5))
    for replica in members:
        assert torch.allclose(weights(replica), mean, atol=1e-6)
        assert torch.allclose(replica.model.bias.detach(), torch.full((300,), 1.0))


def test_an_8bit_wire_rounds_as_hivemind_does_and_each_replica_keeps_its_own_error() -> None:
    """uint8: each part is quantized to the reducer, the delta back; a replica's error is its own, so the replicas
    do not agree exactly (what docs/design.md says keeps 8-bit out of the product's choices), but stay near the mean."""
    members = replicas([0.0, 1.0, 2.0])
    mean = torch.stack([weights(r) for r in members]).mean(0)
    average_round(members, IdealOptions(period=5, wire="uint8"))
    after = [weights(r) for r in members]
    for tensor in after:
        relative = ((tensor - mean).norm() / mean.norm()).item()
        assert 1e-4 < relative < 0.05, relative
    assert not torch.equal(after[0], after[1])
    for replica in members:  # the bias (300 values) travels as fp16: 1.0 exactly
        assert torch.allclose(replica.model.bias.detach(), torch.full((300,), 1.0))


def test_a_wire_that_is_not_offered_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown wire 'int4'"):
        IdealOptions(period=5, wire="int4")
