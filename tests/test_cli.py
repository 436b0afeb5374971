"""Bad input to run_trainer.py fails before training starts, exit code != 0, with a message that says what to do."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO, run_trainer, trainer_env


def test_unknown_config_lists_the_available_ones() -> None:
    result = run_trainer("--config", "nosuch")
    assert result.returncode != 0
    assert "unknown config 'nosuch'" in result.stderr
    for name in ("swav_tiny", "swav_resnet50", "swav_vit_small"):
        assert name in result.stderr


def test_missing_data_folder(tmp_path: Path) -> None:
    result = run_trainer("--config", "swav_tiny", "--data_path", str(tmp_path / "absent"))
    assert result.returncode != 0
    assert "no folder" in result.stderr and "export_digits.py" in result.stderr


def test_empty_data_folder(tmp_path: Path) -> None:
    (tmp_path / "train" / "cat").mkdir(parents=True)
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    result = run_trainer("--config", "swav_tiny", "--data_path", str(tmp_path))
    assert result.returncode != 0
    assert "has no images" in result.stderr


def test_malformed_override(digits_dir: Path) -> None:
    result = run_trainer("--config", "swav_tiny", "--data_path", str(digits_dir), "OPTIMIZER.num_epochs=3")
    assert result.returncode != 0
    assert "malformed override 'OPTIMIZER.num_epochs=3'" in result.stderr
    assert "config.SECTION.KEY=VALUE" in result.stderr


def test_override_of_an_unknown_key(digits_dir: Path) -> None:
    result = run_trainer("--config", "swav_tiny", "--data_path", str(digits_dir), "config.OPTIMIZER.no_such_key=3")
    assert result.returncode != 0
    assert "config.OPTIMIZER.no_such_key" in result.stderr and "Traceback" not in result.stderr


def test_a_misspelled_flag_names_the_right_one_in_one_line() -> None:
    result = run_trainer("--config", "swav_tiny", "--checkpoint-dir", "x")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: unknown flag --checkpoint-dir; did you mean --checkpoint_dir?"


def test_help_documents_every_flag() -> None:
    result = run_trainer("--help")
    assert result.returncode == 0
    for flag in ("--config", "--data_path", "--checkpoint_dir"):
        assert flag in result.stdout


def test_a_native_crash_prints_every_threads_python_stack_to_the_log() -> None:
    """``run_trainer.report_fatal_errors`` (``main`` calls it before VISSL starts): a trainer that dies of SIGABRT, as
    glibc kills a process whose heap is corrupted, leaves the Python stack of each of its threads in its log, and
    the processes it spawns inherit that through PYTHONFAULTHANDLER."""
    code = textwrap.dedent(
        """
        import os, threading, time
        import run_trainer
        run_trainer.report_fatal_errors()
        print("spawned ranks get PYTHONFAULTHANDLER =", os.environ["PYTHONFAULTHANDLER"], flush=True)
        def serving_the_state():
            time.sleep(60)
        threading.Thread(target=serving_the_state, daemon=True).start()
        time.sleep(0.5)
        os.abort()
        """
    )
    env = {key: value for key, value in trainer_env().items() if key != "PYTHONFAULTHANDLER"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == -signal.SIGABRT, result.stderr[-3000:]
    assert "spawned ranks get PYTHONFAULTHANDLER = 1" in result.stdout
    assert "Fatal Python error: Aborted" in result.stderr, result.stderr[-3000:]
    assert "in serving_the_state" in result.stderr, result.stderr[-3000:]  # the other thread's stack, too
