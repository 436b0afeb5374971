"""The exported dataset is real, split, in ImageFolder layout, and readable by VISSL's disk_folder source."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from scripts.export_digits import export_digits


def test_export_layout_and_split(digits_dir: Path) -> None:
    for split in ("train", "val"):
        classes = sorted(path.name for path in (digits_dir / split).iterdir() if path.is_dir())
        assert classes == [str(digit) for digit in range(10)]
    train = {p.name for p in (digits_dir / "train").glob("*/*.png")}
    val = {p.name for p in (digits_dir / "val").glob("*/*.png")}
    assert len(train) + len(val) == 1797 and not train & val  # all of sklearn's digits, disjoint splits
    image = Image.open(next((digits_dir / "train" / "3").glob("*.png")))
    assert image.mode == "RGB" and image.size == (32, 32)
    assert len(set(image.getdata())) > 2  # a real upscaled digit, not a blank


def test_export_is_idempotent(digits_dir: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in digits_dir.glob("train/*/*.png")}
    assert export_digits(digits_dir, size=32) == {"train": 1437, "val": 360}
    assert {p: p.stat().st_mtime_ns for p in digits_dir.glob("train/*/*.png")} == before


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--size"):
        export_digits(tmp_path, size=4)
    with pytest.raises(ValueError, match="--val_fraction"):
        export_digits(tmp_path, val_fraction=1.5)


def test_vissl_disk_folder_reads_the_export(digits_dir: Path) -> None:
    from vissl_swarm import vissl_compat

    vissl_compat.apply()
    from vissl.data.disk_dataset import DiskImageDataset

    from vissl_swarm.config_loading import compose_config

    config, _ = compose_config("swav_tiny", [], has_gpu=False)
    dataset = DiskImageDataset(config, "disk_folder", str(digits_dir / "train"), split="TRAIN", dataset_name="digits")
    assert len(dataset) == 1437
    image, is_success = dataset[0]
    assert is_success and image.size == (32, 32)
