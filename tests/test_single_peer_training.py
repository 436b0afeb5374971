"""One peer trains SwAV with the stock VISSL trainer on real images, checkpoints, resumes after a crash, and ends
quietly (no traceback at the end of a normal run: see decentralized_sgd/hivemind_fixes.py)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.conftest import REPO, trainer_env

# 24 batches of 16 images: enough for LARC, the schedule, prototype freezing (10 iterations) and checkpoints
SMALL_RUN = [
    "config.DATA.TRAIN.DATA_LIMIT=384",
    "config.OPTIMIZER.num_epochs=1",
    "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=8",
    "config.LOG_FREQUENCY=1",
]


def trainer_command(digits_dir: Path, checkpoint_dir: Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        str(REPO / "run_trainer.py"),
        "--config",
        "swav_tiny",
        "--data_path",
        str(digits_dir),
        "--checkpoint_dir",
        str(checkpoint_dir),
        *flags,
        *SMALL_RUN,
    ]


def logged_iterations(checkpoint_dir: Path) -> list[dict]:
    lines = (checkpoint_dir / "stdout.json").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


OUTER = ("--outer_momentum", "0.5", "--outer_lr", "0.7", "--outer_nesterov")


def test_train_checkpoint_crash_and_resume(digits_dir: Path, tmp_path: Path) -> None:
    """With the outer optimizer on: its anchor and buffer go into the checkpoints and come back on resume."""
    checkpoint_dir = tmp_path / "peer"
    # first run: killed (SIGKILL, as a crash would) right after its first iteration checkpoint is on disk (with 16
    # iterations to go: a fast machine must not finish the run before the kill)
    process = subprocess.Popen(
        trainer_command(digits_dir, checkpoint_dir, *OUTER),
        cwd=REPO,
        env=trainer_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    try:
        while not (checkpoint_dir / "model_iteration8.torch").exists():  # written atomically: complete once seen
            assert process.poll() is None, "the trainer exited before writing its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    first_run = logged_iterations(checkpoint_dir)
    assert all(math.isfinite(entry["loss"]) for entry in first_run)
    assert not (checkpoint_dir / "model_final_checkpoint_phase0.torch").exists()

    # checkpoints load with torch's default weights_only=True: nothing in them needs unpickling of code
    state = torch.load(checkpoint_dir / "model_iteration8.torch", map_location="cpu")
    assert state["iteration"] == 8
    saved_outer = state["classy_state_dict"]["outer_optimizer"]
    trunk_at_8 = state["classy_state_dict"]["base_model"]["model"]["trunk"]
    assert saved_outer["settings"] == {"momentum": 0.5, "lr": 0.7, "nesterov": True}
    # alone, no round moved the anchor: it is still the initial model, which 8 local steps have left
    assert len(saved_outer["anchor"]) == len(saved_outer["buffer"]) > len(trunk_at_8) / 2
    weights_at_8 = [weight for weight in trunk_at_8.values() if weight.is_floating_point()]
    assert not any(torch.equal(a, w) for a in saved_outer["anchor"] for w in weights_at_8 if a.shape == w.shape)

    # resumed alone, and told to say so after half a second (default: a minute) without an averaging round
    resumed = subprocess.run(
        trainer_command(digits_dir, checkpoint_dir, "--alone_warning_after", "0.5", *OUTER),
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stdout + resumed.stderr
    assert "Traceback" not in log, log[max(0, log.index("Traceback") - 500) :][
        :4000
    ]  # a normal end prints no traceback
    assert "This box has averaged with nobody for" in log and "our DHT knows no other peer" in log
    resume_line = next(line for line in log.splitlines() if "Resume from file" in line)
    resumed_from = int(resume_line.rsplit("model_iteration", 1)[1].split(".")[0])
    assert resumed_from >= 8
    second_run = logged_iterations(checkpoint_dir)[len(first_run) :]
    assert second_run[0]["iter"] == resumed_from  # continues where the checkpoint left off, not from 0
    assert second_run[-1]["iter"] == 23
    assert all(math.isfinite(entry["loss"]) for entry in second_run)
    assert (checkpoint_dir / "model_final_checkpoint_phase0.torch").exists()
    final = torch.load(checkpoint_dir / "model_final_checkpoint_phase0.torch", map_location="cpu")
    trunk = final["classy_state_dict"]["base_model"]["model"]["trunk"]
    assert all(torch.isfinite(tensor).all() for tensor in trunk.values() if tensor.is_floating_point())
    # the resumed run restored the checkpoint's anchor (reset, it would be the weights at the resumed iteration)
    final_outer = final["classy_state_dict"]["outer_optimizer"]
    assert all(torch.equal(a, b) for a, b in zip(final_outer["anchor"], saved_outer["anchor"], strict=True))
