"""The training recipe: one initial model per run, and what run_trainer.py derives from the box and the dataset."""

from __future__ import annotations

import torch

import swarm
from config_loading import compose_config
from initial_model import weights_fingerprint


def build_task_model(run_id: str, seed_value: int) -> torch.nn.Module:
    """The model exactly as a peer's DecentralizedSelfSupervisionTask builds it (swav_tiny, on the CPU)."""
    from decentralized_task import DecentralizedSelfSupervisionTask

    config, _ = compose_config("swav_tiny", [f"config.SEED_VALUE={seed_value}"], has_gpu=False)
    config.SWARM = swarm.SwarmSettings(run_id=run_id, config_name="swav_tiny").to_config()
    torch.manual_seed(seed_value)  # what VISSL's set_seeds does with the peer's own seed before building the task
    return DecentralizedSelfSupervisionTask(config)._build_model()


def test_peers_of_a_run_build_the_same_initial_model_and_keep_their_own_randomness() -> None:
    torch.manual_seed(1)
    first = build_task_model("runA", seed_value=1)
    after_first = torch.rand(4)  # the peer's own stream continues after the build: its data order
    second = build_task_model("runA", seed_value=2)
    after_second = torch.rand(4)
    other_run = build_task_model("runB", seed_value=1)

    assert weights_fingerprint(first) == weights_fingerprint(second)  # trunk and heads
    assert weights_fingerprint(first.trunk) != weights_fingerprint(other_run.trunk)
    assert not torch.equal(after_first, after_second)  # seeds 1 and 2 still give two different peers
    torch.manual_seed(1)
    assert torch.equal(after_first, torch.rand(4)), "building the model must not consume the peer's random stream"
