"""The Fashion-MNIST export reads real IDX files, writes the right image under the right class, and refuses bad files.

The IDX files are built here from scikit-learn's digits (real images, always installed) upscaled to 28x28 uint8,
written in the IDX format exactly as Fashion-MNIST distributes it: CI machines have no Debian
``dataset-fashion-mnist`` package, and a test that skipped without it would prove nothing there.
"""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from scripts.export_fashion_mnist import SPLITS, IdxError, export_fashion_mnist, read_idx

REPO = Path(__file__).resolve().parent.parent
NUM_TRAIN, NUM_VAL = 300, 120  # images per split in the test IDX files


def write_idx(path: Path, array: np.ndarray, compress: bool = True) -> Path:
    """``array`` (uint8) as an IDX file: magic 0x0000 08 <ndim>, big-endian uint32 sizes, the bytes."""
    raw = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)
    return path


def digits_28() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's 1,797 8x8 digits as 28x28 uint8 images (bilinear upscale) and their labels 0-9."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = (digits.images / digits.images.max() * 255.0).astype(np.uint8)
    images = np.stack(
        [np.asarray(Image.fromarray(image, mode="L").resize((28, 28), Image.BILINEAR)) for image in small]
    )
    return images, digits.target.astype(np.uint8)


@pytest.fixture(scope="module")
def idx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four IDX .gz files named as Fashion-MNIST's: the first 300 digits as train, the next 120 as test."""
    images, labels = digits_28()
    folder = tmp_path_factory.mktemp("idx")
    parts = {"train": slice(0, NUM_TRAIN), "val": slice(NUM_TRAIN, NUM_TRAIN + NUM_VAL)}
    for split, (images_stem, labels_stem) in SPLITS.items():
        write_idx(folder / f"{images_stem}.gz", images[parts[split]])
        write_idx(folder / f"{labels_stem}.gz", labels[parts[split]])
    return folder


def exported(out: Path, split: str) -> dict[int, list[Path]]:
    return {label: sorted((out / split / str(label)).glob("*.png")) for label in range(10)}


def test_export_layout_counts_and_labels(idx_dir: Path, tmp_path: Path) -> None:
    images, labels = digits_28()
    assert export_fashion_mnist(tmp_path, idx_dir) == {"val": NUM_VAL, "train": NUM_TRAIN}
    offsets = {"train": 0, "val": NUM_TRAIN}
    for split, count in (("train", NUM_TRAIN), ("val", NUM_VAL)):
        assert sorted(p.name for p in (tmp_path / split).iterdir() if p.is_dir()) == [str(c) for c in range(10)]
        files = exported(tmp_path, split)
        source_labels = labels[offsets[split] : offsets[split] + count]
        assert {label: len(paths) for label, paths in files.items()} == {
            label: int((source_labels == label).sum()) for label in range(10)
        }
        assert (tmp_path / split / ".complete").read_text() == f"{count}\n"
        for label, paths in files.items():
            for path in paths:  # each PNG is its IDX image, pixel for pixel, under its own label
                index = int(path.stem)
                assert source_labels[index] == label
                with Image.open(path) as image:
                    assert image.mode == "L" and image.size == (28, 28)
                    assert np.array_equal(np.asarray(image), images[offsets[split] + index])


def test_limit_train_and_idempotence(idx_dir: Path, tmp_path: Path) -> None:
    assert export_fashion_mnist(tmp_path, idx_dir, limit_train=50) == {"val": NUM_VAL, "train": 50}
    assert sorted(int(p.stem) for p in (tmp_path / "train").glob("*/*.png")) == list(range(50))
    before = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*/*.png")}
    assert export_fashion_mnist(tmp_path, idx_dir, limit_train=50) == {"val": NUM_VAL, "train": 50}
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*/*.png")} == before  # complete: left untouched
    with pytest.raises(ValueError, match="complete export of 50 images, not the 300"):
        export_fashion_mnist(tmp_path, idx_dir)
    with pytest.raises(ValueError, match="--limit_train must be at least 1"):
        export_fashion_mnist(tmp_path / "other", idx_dir, limit_train=0)


def test_uncompressed_idx_is_read(tmp_path: Path) -> None:
    images, _ = digits_28()
    path = write_idx(tmp_path / "images-idx3-ubyte", images[:7], compress=False)
    assert np.array_equal(read_idx(path, ndim=3), images[:7])


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncate_gzip", "not a readable gzip file"),
        ("not_gzip", "not a readable gzip file"),
        ("short_payload", "the file is truncated"),
        ("bad_magic", "not an IDX file"),
        ("labels_as_images", "expected 00000803"),
    ],
)
def test_corrupt_idx_gives_clear_error(idx_dir: Path, tmp_path: Path, damage: str, message: str) -> None:
    bad = tmp_path / "idx"
    bad.mkdir()
    for path in idx_dir.iterdir():
        (bad / path.name).write_bytes(path.read_bytes())
    images_file = bad / f"{SPLITS['train'][0]}.gz"
    raw = gzip.decompress(images_file.read_bytes())
    if damage == "truncate_gzip":  # a half-finished download
        images_file.write_bytes(images_file.read_bytes()[: len(images_file.read_bytes()) // 2])
    elif damage == "not_gzip":
        images_file.write_bytes(b"<html>404 Not Found</html>")
    elif damage == "short_payload":  # a valid gzip stream of an IDX file missing its last image
        images_file.write_bytes(gzip.compress(raw[: -28 * 28]))
    elif damage == "bad_magic":
        images_file.write_bytes(gzip.compress(b"\x01\x02" + raw[2:]))
    elif damage == "labels_as_images":
        images_file.write_bytes((bad / f"{SPLITS['train'][1]}.gz").read_bytes())
    with pytest.raises(IdxError, match=message) as error:
        export_fashion_mnist(tmp_path / "out", bad)
    assert str(images_file) in str(error.value)  # the message names the bad file
    assert not (tmp_path / "out" / "train" / ".complete").exists()


def test_mismatched_counts_and_labels(idx_dir: Path, tmp_path: Path) -> None:
    images, labels = digits_28()
    bad = tmp_path / "idx"
    bad.mkdir()
    for path in idx_dir.iterdir():
        (bad / path.name).write_bytes(path.read_bytes())
    labels_file = bad / f"{SPLITS['val'][1]}.gz"
    write_idx(labels_file, labels[: NUM_VAL - 1])
    with pytest.raises(IdxError, match=f"holds {NUM_VAL} images but .* {NUM_VAL - 1} labels"):
        export_fashion_mnist(tmp_path / "out", bad)
    write_idx(labels_file, np.full(NUM_VAL, 12, dtype=np.uint8))
    with pytest.raises(IdxError, match="label 12 found"):
        export_fashion_mnist(tmp_path / "out", bad)


def test_missing_files_say_how_to_get_them(idx_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(IdxError, match="apt-get install dataset-fashion-mnist.*--idx_dir"):
        export_fashion_mnist(tmp_path / "out", tmp_path / "nowhere")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / f"{SPLITS['val'][0]}.gz").write_bytes((idx_dir / f"{SPLITS['val'][0]}.gz").read_bytes())
    with pytest.raises(IdxError, match=f"no {SPLITS['val'][1]}.gz .*github.com/zalandoresearch"):
        export_fashion_mnist(tmp_path / "out", partial)


def test_command_line(idx_dir: Path, tmp_path: Path) -> None:
    """As the Makefile runs it: exit 0 and a summary; a bad --idx_dir: exit 2 and one clear line, no traceback."""
    script = str(REPO / "scripts" / "export_fashion_mnist.py")
    done = subprocess.run(
        [sys.executable, script, "--idx_dir", str(idx_dir), "--out", str(tmp_path / "out"), "--limit_train", "40"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "train=40" in done.stdout and f"val={NUM_VAL}" in done.stdout
    failed = subprocess.run(
        [sys.executable, script, "--idx_dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out2")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode == 2 and failed.stderr.startswith("error: ") and "Traceback" not in failed.stderr


def test_vissl_disk_folder_reads_the_export(idx_dir: Path, tmp_path: Path) -> None:
    """swav_fashion's data source loads the grey PNGs as the RGB images its transforms expect."""
    from vissl_swarm import vissl_compat

    vissl_compat.apply()
    from vissl.data.disk_dataset import DiskImageDataset

    from vissl_swarm.config_loading import compose_config

    export_fashion_mnist(tmp_path, idx_dir)
    config, _ = compose_config("swav_fashion", [], has_gpu=False)
    assert config.DATA.TRAIN.DATA_PATHS == ["data/fashion/train"]
    dataset = DiskImageDataset(
        config, "disk_folder", str(tmp_path / "train"), split="TRAIN", dataset_name="fashion_mnist"
    )
    assert len(dataset) == NUM_TRAIN
    image, is_success = dataset[0]
    assert is_success and image.mode == "RGB" and image.size == (28, 28)
