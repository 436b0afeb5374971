"""Bad input to run_trainer.py fails before training starts, exit code != 0, with a message that says what to do."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_trainer


def test_unknown_config_lists_the_available_ones() -> None:
    result = run_trainer("--config", "nosuch", timeout=120)
    assert result.returncode != 0
    assert "unknown config 'nosuch'" in result.stderr
    for name in ("swav_tiny", "swav_resnet50", "swav_vit_small"):
        assert name in result.stderr


def test_missing_data_folder(tmp_path: Path) -> None:
    result = run_trainer("--config", "swav_tiny", "--data_path", str(tmp_path / "absent"), timeout=120)
    assert result.returncode != 0
    assert "no folder" in result.stderr and "export_digits.py" in result.stderr


def test_empty_data_folder(tmp_path: Path) -> None:
    (tmp_path / "train" / "cat").mkdir(parents=True)
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    result = run_trainer("--config", "swav_tiny", "--data_path", str(tmp_path), timeout=120)
    assert result.returncode != 0
    assert "has no images" in result.stderr


def test_malformed_override(digits_dir: Path) -> None:
    result = run_trainer("--config", "swav_tiny", "--data_path", str(digits_dir), "OPTIMIZER.num_epochs=3", timeout=120)
    assert result.returncode != 0
    assert "malformed override 'OPTIMIZER.num_epochs=3'" in result.stderr
    assert "config.SECTION.KEY=VALUE" in result.stderr


def test_override_of_an_unknown_key(digits_dir: Path) -> None:
    result = run_trainer(
        "--config", "swav_tiny", "--data_path", str(digits_dir), "config.OPTIMIZER.no_such_key=3", timeout=180
    )
    assert result.returncode != 0
    assert "config.OPTIMIZER.no_such_key" in result.stderr and "Traceback" not in result.stderr


def test_help_documents_every_flag() -> None:
    result = run_trainer("--help", timeout=60)
    assert result.returncode == 0
    for flag in ("--config", "--data_path", "--checkpoint_dir"):
        assert flag in result.stdout
