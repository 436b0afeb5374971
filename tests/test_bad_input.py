"""Bad input gets a clear error or a clean rejection, and nothing is lost."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import run_trainer
from vissl_swarm import vissl_compat


class _FailsWhenSaved:
    """Pickling this raises, as a full disk would in the middle of torch.save."""

    def __reduce__(self):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_failed_checkpoint_write_leaves_previous_checkpoints_intact(tmp_path: Path) -> None:
    import vissl.utils.checkpoint

    assert vissl.utils.checkpoint.save_checkpoint is vissl_compat.atomic_save_checkpoint
    good = {"iteration": 10, "weights": torch.arange(1000.0)}
    vissl.utils.checkpoint.save_checkpoint(str(tmp_path), good, "model_iteration10.torch")
    before = (tmp_path / "model_iteration10.torch").read_bytes()

    with pytest.raises(OSError, match="No space left"):
        vissl.utils.checkpoint.save_checkpoint(
            str(tmp_path),
            {"iteration": 20, "weights": torch.zeros(1000), "x": _FailsWhenSaved()},
            "model_iteration20.torch",
        )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model_iteration10.torch"]  # no partial file
    assert (tmp_path / "model_iteration10.torch").read_bytes() == before
    assert torch.load(tmp_path / "model_iteration10.torch")["iteration"] == 10


def test_truncated_newest_checkpoint_is_named_in_a_clear_error(digits_dir: Path, tmp_path: Path) -> None:
    checkpoint_dir = tmp_path / "peer"
    checkpoint_dir.mkdir()
    torch.save({"iteration": 8}, checkpoint_dir / "model_iteration8.torch")
    torch.save({"iteration": 16, "weights": torch.zeros(10_000)}, checkpoint_dir / "model_iteration16.torch")
    data = (checkpoint_dir / "model_iteration16.torch").read_bytes()
    (checkpoint_dir / "model_iteration16.torch").write_bytes(data[: len(data) // 2])  # a crash mid-write

    result = run_trainer(
        "--config",
        "swav_tiny",
        "--data_path",
        str(digits_dir),
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--isolated",
    )
    assert result.returncode != 0
    assert "model_iteration16.torch" in result.stderr and "corrupt or truncated" in result.stderr
    assert "Traceback" not in result.stderr
    assert (checkpoint_dir / "model_iteration8.torch").exists()  # nothing was deleted or overwritten


def test_unreadable_image_is_skipped_with_a_warning_naming_it(digits_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    for digit in ("0", "1"):
        (data / "train" / digit).mkdir(parents=True)
        for image in sorted((digits_dir / "train" / digit).glob("*.png"))[:16]:
            shutil.copy(image, data / "train" / digit / image.name)
    broken = data / "train" / "1" / "0000_broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")

    result = run_trainer(
        "--config",
        "swav_tiny",
        "--data_path",
        str(data),
        "--checkpoint_dir",
        str(tmp_path / "ck"),
        "--isolated",
        "config.OPTIMIZER.num_epochs=2",
        "config.LOG_FREQUENCY=1",
        "config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP=[]",
        timeout=300,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert "Couldn't load" in log and "0000_broken.png" in log
    assert (tmp_path / "ck" / "model_final_checkpoint_phase1.torch").exists()
