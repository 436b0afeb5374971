"""A box that averages with nobody says so: one WARNING after a minute without an applied round,
again every 5 minutes while it lasts, naming the likely causes; a round resets it. The hook on a real run (a box
alone, the warning in its log) is in test_single_peer_training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hooks.warn_when_alone_on_step_hook import ALONE_AFTER_S, REPEAT_EVERY_S, WarnWhenAloneOnStepHook, alone_message


def test_warns_after_a_minute_alone_then_every_five_minutes(caplog: pytest.LogCaptureFixture) -> None:
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
    assert "--run_id lonely" in caplog.text and "--config swav_tiny" in caplog.text
    assert step_at(ALONE_AFTER_S + REPEAT_EVERY_S - 1) == 1  # not every step
    assert step_at(ALONE_AFTER_S + REPEAT_EVERY_S) == 2
    counters["rounds_applied"] = 1  # a round: quiet again, and the minute counts from that round
    assert step_at(500) == 2
    assert step_at(500 + ALONE_AFTER_S - 1) == 2
    assert step_at(500 + ALONE_AFTER_S) == 3

    off = WarnWhenAloneOnStepHook(alone_after_s=0, clock=lambda: now[0])  # --alone_warning_after 0
    off.on_start(task)
    now[0] += 10_000
    off.on_step(task)
    assert off.warnings == 0


def test_the_message_says_what_the_dht_sees() -> None:
    assert "knows no other peer" in alone_message(61, 3, 0, "r", "c")
    assert "knows 2 other peer(s)" in alone_message(
        61, 3, 2, "r", "c"
    ) and "run id, config and secret" in alone_message(61, 3, 2, "r", "c")
    assert "did not answer" in alone_message(61, 3, None, "r", "c")
