"""A box that averages with nobody says so once, after ``--alone_warning_after`` seconds without an applied round,
with the cause its swarm's records show and the fix; a round ends the stretch. On real runs: a box alone in
test_single_peer_training, a box with another secret in test_one_recipe."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hooks.warn_when_alone_on_step_hook import ALONE_AFTER_S, WarnWhenAloneOnStepHook, alone_cause


def test_warns_once_after_a_minute_alone_and_again_after_a_round(caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    hook = WarnWhenAloneOnStepHook(clock=lambda: now[0])
    counters = {"rounds_applied": 0, "rounds_failed": 0, "rounds_no_group": 0}
    task = SimpleNamespace(
        decentralized_sgd=SimpleNamespace(counters=counters),
        dht=None,
        swarm_settings=SimpleNamespace(run_id="lonely", config_name="swav_tiny"),
    )
    hook.on_start(task)

    def step_at(seconds: float) -> int:
        now[0] = 1000.0 + seconds
        hook.on_step(task)
        return hook.warnings

    assert step_at(ALONE_AFTER_S - 1) == 0
    counters["rounds_no_group"], counters["rounds_failed"] = 7, 1  # a round that formed and failed found a group
    assert step_at(ALONE_AFTER_S) == 1
    assert "averaged with nobody for 60 s (7 rounds found no group)" in caplog.text
    assert step_at(ALONE_AFTER_S + 3600) == 1  # once
    counters["rounds_applied"] = 1  # a round: quiet again, and the minute counts from that round
    assert step_at(5000) == 1
    assert step_at(5000 + ALONE_AFTER_S - 1) == 1
    assert step_at(5000 + ALONE_AFTER_S) == 2

    off = WarnWhenAloneOnStepHook(alone_after_s=0, clock=lambda: now[0])  # --alone_warning_after 0
    off.on_start(task)
    now[0] += 10_000
    off.on_step(task)
    assert off.warnings == 0


def test_the_cause_is_what_the_swarm_shows_with_the_fix() -> None:
    wrong_secret = "no peer of this swarm accepts our secret: ..."
    assert alone_cause(wrong_secret, None, 2, "r", "swav_tiny").startswith("no peer of this swarm accepts our secret")
    other = {"peer_id": "QmOtherBox01", "config": "swav_tiny", "recipe": {"config.OPTIMIZER.num_epochs": "12"}}
    recipe = SimpleNamespace(others=[other], recipe={})
    assert "pass config.OPTIMIZER.num_epochs=12" in alone_cause(None, recipe, 2, "r", "swav_tiny")
    config = SimpleNamespace(others=[{**other, "config": "swav_resnet50"}], recipe={})
    assert "start this one with --config swav_resnet50" in alone_cause(None, config, 2, "r", "swav_tiny")
    nobody = SimpleNamespace(others=[], recipe={})
    assert "no other box is reachable" in alone_cause(None, nobody, 0, "r", "swav_tiny")
    assert "none of them trains --run_id r --config swav_tiny" in alone_cause(None, nobody, 2, "r", "swav_tiny")
    assert "did not answer" in alone_cause(None, nobody, None, "r", "swav_tiny")
