"""``--averager hivemind_optimizer``: hivemind.Optimizer(use_local_updates=True) inside VISSL's LARC.

1. The wiring, in-process (a DHT alone, no peers): VISSL's LR writes reach the SGD hivemind steps, LARC's inner
   optimizer is replaced, the Averaging interface is complete, the target batch comes from the environment.
2. Two real swav_tiny boxes (run_trainer.py processes on 127.0.0.1) average with it on the digits: each applies
   rounds in groups of 2, follows the swarm-wide schedule to its end and exits cleanly.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from baselines.hivemind_optimizer import (
    DEFAULT_STEPS_PER_EPOCH,
    TARGET_BATCH_ENV,
    HivemindOptimizerAverager,
    VisslHivemindOptimizer,
    _RetriedStateDownloadIsOneLine,
    target_batch_size,
)
from vissl_swarm.averaging_protocol import Averaging
from vissl_swarm.local_swarm import LocalPeer, start_swarm_together, stop_all, wait_until


def test_no_swarm_secret_with_hivemind_optimizer() -> None:
    import run_trainer
    from vissl_swarm import swarm

    with pytest.raises(swarm.SwarmError, match="need the improved averager .*hivemind_optimizer"):
        run_trainer.swarm_settings(
            run_trainer.parse_args(
                ["--config", "swav_tiny", "--averager", "hivemind_optimizer", "--swarm_secret", "s3cret"]
            )
        )


@pytest.mark.parametrize("averager", ["old", "hivemind_optimizer"])
def test_no_staleness_bound_with_a_baseline(averager: str) -> None:
    import run_trainer
    from vissl_swarm import swarm

    with pytest.raises(swarm.SwarmError, match=f"--max_staleness needs the improved averager .*{averager}"):
        run_trainer.swarm_settings(
            run_trainer.parse_args(["--config", "swav_tiny", "--averager", averager, "--max_staleness", "2"])
        )


def test_target_batch_size_default_and_environment() -> None:
    assert target_batch_size(16, 3, environ={}) == 16 * 3 * DEFAULT_STEPS_PER_EPOCH
    assert target_batch_size(16, 3, environ={TARGET_BATCH_ENV: "480"}) == 480
    with pytest.raises(ValueError, match=TARGET_BATCH_ENV):
        target_batch_size(16, 3, environ={TARGET_BATCH_ENV: "0"})


def test_a_retried_state_download_is_one_warning_line() -> None:
    """hivemind.Optimizer logs each failed state download with a traceback, then retries (hivemind#504): one line."""
    try:
        [][0]
    except IndexError:
        record = logging.getLogger("hivemind.optim.optimizer").makeRecord(
            "hivemind.optim.optimizer",
            logging.ERROR,
            __file__,
            1,
            "Failed to load state from peers: %s, retrying ...",
            ("list index out of range",),
            sys.exc_info(),
        )
    assert _RetriedStateDownloadIsOneLine().filter(record)
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert record.getMessage() == (
        "hivemind.Optimizer: Failed to load state from peers: list index out of range, retrying ... (hivemind#504)"
    )
    assert "Traceback" not in logging.Formatter().format(record)
    other = logging.LogRecord("hivemind.optim.optimizer", logging.ERROR, __file__, 1, "something else", (), None)
    assert _RetriedStateDownloadIsOneLine().filter(other) and other.levelno == logging.ERROR


class _Larc:
    """What install() needs of VISSL's LARC_FSDP: an ``optim`` it calls ``step()`` on, groups read through it."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.optim = optim

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups


@pytest.mark.timeout(120)
def test_installed_inside_larc_vissl_lr_reaches_the_sgd(tmp_path: Path) -> None:
    from decentralized_task import DecentralizedSelfSupervisionTask
    from vissl_swarm import swarm

    dht = swarm.start_dht(swarm.SwarmSettings(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.0)
    larc = _Larc(sgd)
    task = SimpleNamespace(
        optimizer=SimpleNamespace(optimizer=larc),
        dht=dht,
        run_prefix="unit_swav",
        base_model=model,
        get_global_batchsize=lambda: 8,
        training_progress=lambda: {},
    )
    settings = swarm.SwarmSettings(target_group_size=2, min_matchmaking_time=1.0, averaging_timeout=5.0)
    averager = None
    try:
        options = DecentralizedSelfSupervisionTask._averager_options(task, settings, tmp_path / "rounds.jsonl")
        averager = HivemindOptimizerAverager.install(task, settings, options)  # as HivemindOptimizerTask does
        assert isinstance(averager, Averaging)
        hivemind_optimizer_log = logging.getLogger("hivemind.optim.optimizer")
        assert [type(f) for f in hivemind_optimizer_log.filters].count(_RetriedStateDownloadIsOneLine) == 1
        assert isinstance(larc.optim, VisslHivemindOptimizer) and larc.optim.opt is sgd
        assert larc.param_groups is sgd.param_groups  # VISSL's writes land in the SGD's own groups, not copies
        assert averager.target_batch_size == 8 * 2 * DEFAULT_STEPS_PER_EPOCH
        for group in larc.param_groups:  # what ClassyOptimizer._update_schedule does before each step
            group["lr"] = 0.5
        weight = model[0].weight.detach().clone()
        model(torch.randn(8, 4)).pow(2).sum().backward()
        grad = model[0].weight.grad.clone()
        with averager.lock:
            larc.optim.step()
        averager.on_step_end(8)
        assert torch.allclose(model[0].weight.detach(), weight - 0.5 * grad, atol=1e-6)  # the step used VISSL's LR
        assert averager.local_step == 1 and averager.counters["rounds_applied"] == 0 and averager.records == []
        assert averager.last_applied_record() is None
        # alone in the swarm: nothing to download, our weights stay; no VISSL progress is ever shared (None)
        stepped = model[0].weight.detach().clone()
        assert averager.load_state_from_peers(timeout=2.0, accept=lambda progress: True) is None
        assert torch.equal(model[0].weight.detach(), stepped)
    finally:
        if averager is not None:
            averager.shutdown()
            averager.shutdown()  # idempotent
        dht.shutdown()


# 20 steps per epoch alone (320 images, batch 16), 8 epochs: 160 steps for the swarm, ~80 per box; a global epoch
# (a round) every 320 samples of the swarm: ~10 steps per box
BOXES, IMAGES, EPOCHS, BATCH, TARGET = 2, 320, 8, 16, 320
OVERRIDES = [
    f"config.DATA.TRAIN.DATA_LIMIT={IMAGES}",
    f"config.OPTIMIZER.num_epochs={EPOCHS}",
    "config.LOG_FREQUENCY=10",
    "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=1000",
]
FLAGS = [
    "--run_id",
    "hmotest",
    "--averager",
    "hivemind_optimizer",
    "--target_group_size",
    "2",
    "--min_matchmaking_time",
    "2",
    "--averaging_timeout",
    "20",
    "--next_chunk_timeout",
    "5",
    "--load_state_timeout",
    "0",
]
DONE = re.compile(r"the swarm's budget is done \((\d+) of (\d+) samples\); this box trained (\d+) iterations")


@pytest.mark.long
@pytest.mark.timeout(420)
def test_two_boxes_average_with_hivemind_optimizer_and_exit_cleanly(digits_dir: Path, tmp_path: Path) -> None:
    peers = [LocalPeer(f"box{index}", tmp_path, env={TARGET_BATCH_ENV: str(TARGET)}) for index in range(BOXES)]
    try:
        start_swarm_together(
            peers,
            digits_dir,
            FLAGS,
            OVERRIDES,
            per_peer_overrides=lambda peer: [f"config.SEED_VALUE={peers.index(peer)}"],
        )
        wait_until(lambda: not any(peer.is_running() for peer in peers), 300, "both boxes ending by themselves")
    finally:
        stop_all(peers)

    for peer in peers:
        log = peer.log_text()
        assert peer.process.returncode == 0, peer.exit_message()
        assert "Traceback" not in log, log[log.index("Traceback") - 500 :][:3000]
        assert f"a global epoch (an averaging round) every {TARGET} samples of the swarm" in log
        done = DONE.search(log)
        assert done, f"{peer.name} did not end at the swarm's budget: {peer.exit_message()}"
        assert int(done.group(3)) < EPOCHS * IMAGES // BATCH  # a share of the recipe, not all of it
        applied = peer.applied_rounds()
        assert applied and all(record["group_size"] == 2 for record in applied), peer.rounds()
        assert all(record["staleness_steps"] >= 0 and record["t_end"] >= record["t_start"] for record in applied)
        last = peer.progress()[-1]
        assert last["rounds_ok"] >= 1 and last["swarm_samples"] > 0, last
        assert list(peer.checkpoint_dir.glob("model_final_checkpoint_phase*.torch")), peer.name


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--outer_momentum", "1.2"], r"--outer_momentum must be in \[0, 1\)"),
        (["--outer_lr", "0"], "--outer_lr must be > 0"),
        (["--averager", "old", "--outer_momentum", "0.5"], "--outer_momentum / --outer_lr need the improved averager"),
    ],
)
def test_bad_outer_optimizer_flags_say_what_to_pass(flags: list[str], message: str) -> None:
    import run_trainer
    from vissl_swarm import swarm

    with pytest.raises(swarm.SwarmError, match=message):
        run_trainer.swarm_settings(run_trainer.parse_args(["--config", "swav_tiny", *flags]))
