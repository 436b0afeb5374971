"""Export Fashion-MNIST (Zalando's 28x28 grey clothing photos, 10 classes) from its IDX files as an image folder.

Why this dataset: the exported digits are too easy and too small to show whether more training keeps helping
(1,437 images, kNN saturates within a few hundred steps); Fashion-MNIST has 60,000 train / 10,000 test images of
real objects and is still cheap on CPU. Why IDX parsed here: the four ``*-idx?-ubyte.gz`` files are the dataset's
only distribution format (Debian's ``dataset-fashion-mnist`` ships them in /usr/share/datasets/fashion-mnist, the
Fashion-MNIST GitHub in data/fashion/), the format is a 4-byte magic number, big-endian sizes and raw bytes, and
torchvision's reader would pull in a download path we do not want.

Layout, as scripts/export_digits.py: ``OUT/train/<class>/<index>.png`` (the 60,000 training images, or the first
``--limit_train``) and ``OUT/val/<class>/<index>.png`` (the 10,000 test images), classes named by their label
``0``..``9`` (:data:`CLASS_NAMES` says what each is), ``<index>`` the image's position in its IDX file. Images stay
28x28 single-channel ("L") PNGs: VISSL's ``disk_folder`` source and ``run_eval.py``'s ImageFolder both convert to RGB
on load, so three equal channels on disk would only triple the export. Each split gets a ``.complete`` marker
holding its image count once fully written; ``val`` is written first, so ``train/.complete`` (the Makefile's
target) means the whole export is done, and a complete split is left untouched on the next run.
"""

from __future__ import annotations

import argparse
import gzip
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

DEBIAN_IDX_DIR = Path("/usr/share/datasets/fashion-mnist")
GITHUB_URL = "https://github.com/zalandoresearch/fashion-mnist/tree/master/data/fashion"
SPLITS = {  # export split -> (images file, labels file), the names both Debian and the GitHub use
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
}
CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
IDX_UBYTE = 0x08  # the IDX type code of unsigned bytes, the only one Fashion-MNIST uses


class IdxError(ValueError):
    """A missing, truncated or malformed IDX file; the message names the file and what to do."""


def how_to_get_idx(idx_dir: Path) -> str:
    """The fix for missing IDX files, said the same way by the script and the Makefile."""
    return (
        f"install Debian's package (`sudo apt-get install dataset-fashion-mnist`, files in {DEBIAN_IDX_DIR}), or "
        f"download the four IDX .gz files from {GITHUB_URL} into a folder and pass it as --idx_dir "
        f"(looked in {idx_dir})"
    )


def idx_file(idx_dir: Path, stem: str) -> Path:
    """``stem.gz`` (as distributed) or ``stem`` (already gunzipped) in ``idx_dir``."""
    for path in (idx_dir / f"{stem}.gz", idx_dir / stem):
        if path.is_file():
            return path
    raise IdxError(f"no {stem}.gz (or {stem}) in {idx_dir}: {how_to_get_idx(idx_dir)}")


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """The uint8 array of an IDX file (gzipped or not) with ``ndim`` dimensions: 1 for labels, 3 for images.

    IDX: two zero bytes, a type byte (0x08 = unsigned byte), a byte with the number of dimensions, one big-endian
    uint32 per dimension, then the values in C order. Every check names the file, since a wrong or half-downloaded
    one is the usual cause."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as error:  # BadGzipFile is an OSError; a cut-off stream an EOFError
        raise IdxError(
            f"{path}: not a readable gzip file ({type(error).__name__}: {error}); it is corrupt or "
            f"truncated, fetch it again ({GITHUB_URL})"
        ) from error
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise IdxError(
            f"{path}: not an IDX file (its magic number {raw[:4].hex() or 'is missing'} should be "
            f"0000{IDX_UBYTE:02x}{ndim:02x}); fetch it again ({GITHUB_URL})"
        )
    if raw[2] != IDX_UBYTE or raw[3] != ndim:
        raise IdxError(
            f"{path}: IDX magic number {raw[:4].hex()}, expected 0000{IDX_UBYTE:02x}{ndim:02x} (unsigned "
            f"bytes, {ndim} dimension(s)); is it the {'labels' if ndim == 1 else 'images'} file?"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxError(f"{path}: truncated IDX header ({len(raw)} bytes, the header alone is {header})")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + int(np.prod(shape, dtype=np.int64))
    if len(raw) != expected:
        raise IdxError(
            f"{path}: {len(raw)} bytes, but its header {shape} says {expected}; the file is truncated "
            f"or padded, fetch it again ({GITHUB_URL})"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def read_split(idx_dir: Path, images_stem: str, labels_stem: str) -> tuple[np.ndarray, np.ndarray]:
    """Images (N x H x W uint8) and labels (N) of one split, checked against each other."""
    images_path, labels_path = idx_file(idx_dir, images_stem), idx_file(idx_dir, labels_stem)
    images, labels = read_idx(images_path, ndim=3), read_idx(labels_path, ndim=1)
    if len(images) != len(labels):
        raise IdxError(
            f"{images_path} holds {len(images)} images but {labels_path} {len(labels)} labels: the two "
            "files are from different datasets or splits"
        )
    if len(labels) and labels.max() >= len(CLASS_NAMES):
        raise IdxError(
            f"{labels_path}: label {int(labels.max())} found, Fashion-MNIST has {len(CLASS_NAMES)} "
            "classes (0-9); is it another dataset's file?"
        )
    return images, labels


def export_fashion_mnist(
    out_dir: Path, idx_dir: Path = DEBIAN_IDX_DIR, limit_train: int | None = None
) -> dict[str, int]:
    """Write ``out_dir/val`` then ``out_dir/train``; return how many images each holds. A split whose
    ``.complete`` marker exists is left untouched, unless it holds another count than asked (then an error: a
    different ``--limit_train`` needs another ``--out`` or the old folder removed)."""
    if limit_train is not None and limit_train < 1:
        raise ValueError(f"--limit_train must be at least 1 (or left out for all 60,000 images), got {limit_train}")
    if not idx_dir.is_dir():
        raise IdxError(f"--idx_dir {idx_dir} is not a folder: {how_to_get_idx(idx_dir)}")
    counts = {}
    for split, (images_stem, labels_stem) in SPLITS.items():
        marker = out_dir / split / ".complete"
        images, labels = read_split(idx_dir, images_stem, labels_stem)
        if split == "train" and limit_train is not None:
            images, labels = images[:limit_train], labels[:limit_train]
        if marker.exists():
            done = marker.read_text().strip()
            if done != str(len(labels)):
                raise ValueError(
                    f"{out_dir / split} is a complete export of {done} images, not the {len(labels)} "
                    f"asked for: remove {out_dir} or pass another --out"
                )
            counts[split] = len(labels)
            continue
        for label in range(len(CLASS_NAMES)):
            (out_dir / split / str(label)).mkdir(parents=True, exist_ok=True)
        for index, (image, label) in enumerate(zip(images, labels, strict=True)):
            Image.fromarray(image, mode="L").save(out_dir / split / str(label) / f"{index:05d}.png")
        marker.write_text(f"{len(labels)}\n")
        counts[split] = len(labels)
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--idx_dir",
        type=Path,
        default=DEBIAN_IDX_DIR,
        help="folder with the four Fashion-MNIST IDX files (*-idx?-ubyte.gz)",
    )
    parser.add_argument("--out", type=Path, default=Path("data/fashion"), help="output folder (train/ and val/)")
    parser.add_argument(
        "--limit_train",
        type=int,
        default=None,
        help="export only the first N training images (in IDX order, which mixes the classes)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        counts = export_fashion_mnist(args.out, args.idx_dir, args.limit_train)
    except ValueError as error:  # IdxError included
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"Fashion-MNIST exported to {args.out}: " + ", ".join(f"{split}={n}" for split, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
