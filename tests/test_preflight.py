"""The pre-flight: two real swav_tiny boxes on 127.0.0.1 (run_trainer.py --preflight), the advice as a function of
measured numbers, and the traffic count against the tensors a real averager sends."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hooks.preflight_on_step_hook import WAIT_FOR_A_GROUP_S, PreflightOnStepHook
from tests.conftest import run_trainer
from vissl_swarm import preflight
from vissl_swarm.local_swarm import LocalPeer, start_swarm_together, wait_until
from vissl_swarm.preflight import Advice, Measured, Settings, advise

FLAGS = [
    "--run_id",
    "pftest",
    "--preflight",
    "20",
    "--target_group_size",
    "2",
    "--min_matchmaking_time",
    "1",
    "--averaging_timeout",
    "20",
    "--next_chunk_timeout",
    "4",
    "--load_state_timeout",
    "0",
]


def measured(**changes) -> Measured:
    """A measured box: swav_tiny numbers of a loopback pre-flight on the loaded 2-core machine."""
    numbers = dict(
        boxes=2,
        rounds_applied=14,
        rounds_failed=0,
        rounds_no_group=1,
        group_sizes=(2,) * 14,
        allreduce_s=0.6,
        allreduce_max_s=1.2,
        bytes_per_round=130_000.0,
        link_mbit=1.7,
        matchmaking_s=1.1,
        staleness_steps=3.0,
        staleness_max_steps=6,
        steps=150,
        seconds=60.0,
        values=130_000,
        compression="fp16",
    )
    return Measured(**{**numbers, **changes})


def load_traffic():
    """benchmarks/traffic.py as a module (benchmarks/ is a folder of scripts, not a package)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import traffic

    return traffic


def by_flag(advice: list[Advice]) -> dict[str, str]:
    return {a.flag: a.value for a in advice}


def test_allreduce_bytes_is_the_butterfly_share() -> None:
    assert preflight.allreduce_bytes(1000, 2.0, 2) == 2000  # half sent, the reduced half sent back
    assert preflight.allreduce_bytes(1000, 2.0, 4) == 3000  # 2 (n-1)/n = 1.5
    assert preflight.allreduce_bytes(1000, 4.0, 1) == 0
    with pytest.raises(preflight.PreflightError):
        preflight.allreduce_bytes(1000, 2.0, 0)
    with pytest.raises(preflight.PreflightError):
        preflight.bytes_per_value("uint4")


def test_a_fast_link_and_a_slow_link_get_different_advice() -> None:
    current = Settings()
    # a fast link: ResNet-50-sized rounds (25.6M values, fp16, group 3) in 1.06 s, 0.31 s steps (1 Gbit/s bench)
    fast = measured(
        boxes=3,
        group_sizes=(3,) * 20,
        allreduce_s=1.06,
        allreduce_max_s=1.4,
        values=25_600_000,
        bytes_per_round=68_000_000.0,
        link_mbit=515.0,
        steps=600,
        seconds=186.0,
        staleness_steps=4.1,
    )
    # a slow one: the same rounds in 7.56 s (100 Mbit/s bench)
    slow = measured(
        boxes=3,
        group_sizes=(3,) * 20,
        allreduce_s=7.56,
        allreduce_max_s=9.0,
        values=25_600_000,
        bytes_per_round=68_000_000.0,
        link_mbit=72.0,
        steps=600,
        seconds=186.0,
        staleness_steps=25.0,
    )
    fast_advice, slow_advice = by_flag(advise(fast, current)), by_flag(advise(slow, current))
    assert fast_advice != slow_advice
    assert float(slow_advice["--min_matchmaking_time"]) > float(fast_advice["--min_matchmaking_time"])
    assert fast_advice["--target_group_size"] == slow_advice["--target_group_size"] == "3"  # 3 boxes took part
    assert slow_advice["--compression"] == fast_advice["--compression"] == "fp16"  # 25.6M values in fp32: > a step
    assert fast_advice["--averaging_timeout"] == slow_advice["--averaging_timeout"] == "60"  # 3 x 9 s < 60 s
    # a very slow link: the AllReduce alone needs a longer timeout, and groups of 2
    crawl = by_flag(
        advise(
            measured(
                boxes=4, group_sizes=(4,) * 5, allreduce_max_s=40.0, allreduce_s=35.0, values=25_600_000, link_mbit=15.0
            ),
            current,
        )
    )
    assert crawl["--averaging_timeout"] == "120"
    assert crawl["--target_group_size"] == "2"


def test_advice_for_a_larger_model_at_the_measured_rate_and_at_a_known_one() -> None:
    tiny = measured()
    own, resnet = by_flag(advise(tiny, Settings())), by_flag(advise(tiny, Settings(), values=25_600_000))
    assert float(resnet["--averaging_timeout"]) > float(own["--averaging_timeout"])  # 200x the bytes at 1.7 Mbit/s
    assert resnet["--target_group_size"] == "2"
    # at a known link rate instead: 51 MB more per round is 0.41 s at 1 Gbit/s, 4.07 s at 100 Mbit/s (+0.6 s measured)
    gigabit = by_flag(advise(tiny, Settings(), values=25_600_000, link_mbit=1000.0))
    wan = by_flag(advise(tiny, Settings(), values=25_600_000, link_mbit=100.0))
    assert gigabit["--averaging_timeout"] == wan["--averaging_timeout"] == "60"
    assert float(gigabit["--min_matchmaking_time"]) < float(wan["--min_matchmaking_time"]) == 5.0
    with pytest.raises(preflight.PreflightError):
        advise(tiny, Settings(), link_mbit=0.0)


def test_a_box_that_never_averaged_is_told_why_and_bad_numbers_are_refused() -> None:
    alone = measured(
        boxes=1,
        rounds_applied=0,
        group_sizes=(),
        allreduce_s=None,
        allreduce_max_s=None,
        bytes_per_round=None,
        link_mbit=None,
        rounds_no_group=12,
    )
    advice = advise(alone, Settings())
    assert {a.flag for a in advice} == {
        "--target_group_size",
        "--min_matchmaking_time",
        "--averaging_timeout",
        "--compression",
    }
    assert all("no averaging round was applied" in a.reason for a in advice)
    with pytest.raises(preflight.PreflightError):
        advise(measured(steps=0), Settings())
    with pytest.raises(preflight.PreflightError, match="lacks 'values'"):
        preflight.measure([], {"compression": "fp16", "steps": 1, "seconds": 1.0, "peer": "x"})


def test_measure_reads_round_records() -> None:
    rounds = [
        {
            "applied": True,
            "group_size": 2,
            "group": ["me", "you"],
            "allreduce_s": 0.5,
            "matchmaking_s": 1.0,
            "staleness_steps": 2,
            "state": "APPLIED",
            "t_group_formed": 1.0,
        },
        {
            "applied": True,
            "group_size": 2,
            "group": ["me", "you"],
            "allreduce_s": 1.5,
            "matchmaking_s": 2.0,
            "staleness_steps": 4,
            "state": "APPLIED",
            "t_group_formed": 2.0,
        },
        {"applied": False, "state": "FAILED", "t_group_formed": None, "group_size": None},
        {"applied": False, "state": "FAILED", "t_group_formed": 3.0, "group_size": 2},
    ]
    m = preflight.measure(
        rounds, {"values": 1_000_000, "compression": "fp16", "steps": 40, "seconds": 20.0, "peer": "me"}
    )
    assert (m.boxes, m.rounds_applied, m.rounds_failed, m.rounds_no_group) == (2, 2, 1, 1)
    assert m.bytes_per_round == 2_000_000  # fp16, group of 2
    assert m.link_mbit == pytest.approx(2 * 2_000_000 * 8 / 2.0 / 1e6)
    assert m.steps_per_round == 20 and m.step_s == 0.5
    text = preflight.format_report(m, advise(m, Settings()))
    assert "rounds applied / failed / no group" in text and "--compression" in text
    waited = {"applied": False, "state": "FAILED", "t_group_formed": None, "t_end": 9.0}  # before anyone came
    later = {"applied": False, "state": "FAILED", "t_group_formed": None, "t_end": 11.0}
    first = {**rounds[0], "t_end": 9.5}  # the first round with a group, before the window it started
    run = {"values": 1, "compression": "fp16", "steps": 40, "seconds": 20.0, "peer": "me", "since": 10.0}
    m = preflight.measure([first, *rounds[1:], waited, later], run)
    assert (m.rounds_applied, m.rounds_failed, m.rounds_no_group) == (2, 1, 2)


def test_the_preflight_measures_from_the_first_round_with_another_box() -> None:
    now = [0.0]
    counters = {"rounds_applied": 0, "rounds_failed": 0, "rounds_no_group": 0}

    def started_box() -> tuple[PreflightOnStepHook, SimpleNamespace]:
        hook = PreflightOnStepHook(20.0, clock=lambda: now[0])
        task = SimpleNamespace(train=True, iteration=0, decentralized_sgd=SimpleNamespace(counters=counters))
        task.phases, task.phase_idx, task.train_phase_idx = [0, 1], 0, 0
        now[0] = 0.0
        hook.on_start(task)
        return hook, task

    def ends_at(hook: PreflightOnStepHook, task: SimpleNamespace, seconds: float) -> bool:
        now[0] = seconds
        try:
            hook.on_step(task)
        except StopIteration:
            return True
        return False

    hook, task = started_box()  # alone for 50 s, then a round with another box that failed: a group all the same
    counters["rounds_no_group"] = 10
    assert not ends_at(hook, task, 49.0)
    counters["rounds_failed"] = 1
    assert not ends_at(hook, task, 50.0) and not ends_at(hook, task, 69.0)
    assert ends_at(hook, task, 70.0) and task.phases == [0]
    counters.update(rounds_failed=0, rounds_no_group=30)
    hook, task = started_box()  # nobody came: it ends after the wait
    assert not ends_at(hook, task, WAIT_FOR_A_GROUP_S - 1)
    assert ends_at(hook, task, WAIT_FOR_A_GROUP_S)


def test_the_traffic_count_is_what_a_real_averager_averages() -> None:
    """benchmarks/traffic.py's count for swav_tiny against the tensors DecentralizedSGD selects from the model and
    the optimizer VISSL builds (the pre-flight test below checks it against a running trainer too)."""
    import torch

    from decentralized_sgd.tensors import AveragedTensors
    from tests.test_recipe import build_task_model

    traffic = load_traffic()
    counted = traffic.averaged_values("swav_tiny")
    model = build_task_model("traffic", seed_value=0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    tensors = AveragedTensors(optimizer, model, average_buffers=True, average_optimizer_state=False).local()
    assert counted["values"] == sum(t.numel() for t in tensors)
    row = traffic.config_row("swav_tiny", counted)
    assert row["sent_per_round_mb_group2"] == pytest.approx(counted["values"] * 2 / 1e6)  # fp16, half out + back


def test_bad_preflight_flags_fail_with_a_clear_error_before_training() -> None:
    import run_trainer as trainer
    from vissl_swarm.swarm import SwarmError

    result = run_trainer("--config", "swav_tiny", "--preflight", "0")  # as a user meets it
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--preflight takes a positive number of seconds, got 0.0" in result.stderr
    assert "Traceback" not in result.stderr
    for flags, message in (
        (["--preflight", "nan"], "--preflight takes a positive number"),
        (["--preflight", "--isolated"], "it runs neither with --isolated"),
        (["--preflight", "30", "--averager", "old"], "nor with --averager old"),
    ):
        with pytest.raises(SwarmError, match=re.escape(message)):
            trainer.swarm_settings(trainer.parse_args(["--config", "swav_tiny", *flags]))
    settings = trainer.swarm_settings(trainer.parse_args(["--config", "swav_tiny", "--run_id", "r", "--preflight"]))
    assert (settings.run_id, settings.preflight_s) == ("r-preflight", preflight.DEFAULT_SECONDS)


def table_value(log: str, name: str) -> str:
    match = re.search(rf"^\s+{re.escape(name)}\s+(.+)$", log, flags=re.MULTILINE)
    assert match, f"no {name!r} in the pre-flight table:\n{log[-3000:]}"
    return match.group(1).strip()


@pytest.mark.timeout(420)
def test_two_boxes_run_a_preflight_and_print_the_table_and_advice(digits_dir: Path, tmp_path: Path) -> None:
    peers = [LocalPeer(f"box{index}", tmp_path) for index in range(2)]
    try:  # box1 comes after box0's 20 s, as a box started by hand later does: both still measure 20 s together
        start_swarm_together(peers, digits_dir, FLAGS, [], stagger=25.0)
        for peer in peers:
            wait_until(lambda peer=peer: not peer.is_running(), 300, f"{peer.name}'s pre-flight to end", poll=1.0)
    finally:
        for peer in peers:
            peer.stop()
    tiny_values = load_traffic().averaged_values("swav_tiny")["values"]
    for peer in peers:
        log = peer.log_text()
        assert peer.process.returncode == 0, peer.exit_message()
        assert "Traceback" not in log, log[-3000:]
        assert "pre-flight of this box" in log and "pre-flight: a first round with another box after" in log
        applied = int(table_value(log, "rounds applied / failed / no group").split("/")[0])
        assert applied >= 1, log[-3000:]
        assert "advised settings for these links:" in log
        for flag in ("--target_group_size", "--min_matchmaking_time", "--averaging_timeout", "--compression"):
            assert re.search(rf"^  {flag} \S+: ", log, flags=re.MULTILINE), f"no advice for {flag}"
        reports = list(peer.checkpoint_dir.glob(f"{preflight.FOLDER}/*/{preflight.REPORT_FILE}"))
        assert len(reports) == 1, reports
        assert not list(reports[0].parent.glob("*.torch")), "the pre-flight's checkpoints were left behind"
        assert "the pre-flight's checkpoints" in log and (reports[0].parent / "averaging_rounds.jsonl").is_file()
        document = json.loads(reports[0].read_text())
        assert document["measured"]["values"] == tiny_values  # what the running averager sent, as counted
        assert document["measured"]["boxes"] == 2 and document["measured"]["seconds"] >= 20  # from the first group
        assert "--run_id pftest --preflight 20" in log  # the join line passes the pre-flight on, with the run id
