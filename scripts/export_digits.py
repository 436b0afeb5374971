"""Export scikit-learn's digits (real handwritten digits, shipped inside the package) as an image folder.

VISSL's ``disk_folder`` source reads ``DIR/train/<class>/*.png``; the held-out split ``DIR/val`` is what the
evaluation of a trained trunk uses. Images are upscaled from 8x8 grey to RGB so that SwAV's multi-crop
augmentations have pixels to work with, and so that a CPU step stays about a second.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SPLITS = ("train", "val")


def export_digits(out_dir: Path, size: int = 64, val_fraction: float = 0.2, seed: int = 0) -> dict[str, int]:
    """Write the two splits and return how many images each got; a complete export is left untouched."""
    if size < 8:
        raise ValueError(f"--size must be at least 8 (the digits are 8x8), got {size}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val_fraction must be between 0 and 1, got {val_fraction}")
    digits = load_digits()
    images = (digits.images / digits.images.max() * 255.0).astype(np.uint8)
    train_idx, val_idx = train_test_split(
        np.arange(len(images)), test_size=val_fraction, random_state=seed, stratify=digits.target
    )
    counts = {}
    for split, indices in zip(SPLITS, (train_idx, val_idx), strict=True):
        done_marker = out_dir / split / ".complete"
        if done_marker.exists():
            counts[split] = len(indices)
            continue
        for index in indices:
            class_dir = out_dir / split / str(digits.target[index])
            class_dir.mkdir(parents=True, exist_ok=True)
            image = Image.fromarray(images[index], mode="L").resize((size, size), Image.BILINEAR).convert("RGB")
            image.save(class_dir / f"{index:04d}.png")
        done_marker.write_text(f"{len(indices)}\n")
        counts[split] = len(indices)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/digits"), help="output folder (train/ and val/)")
    parser.add_argument("--size", type=int, default=64, help="side of the exported square RGB images, in pixels")
    parser.add_argument("--val_fraction", type=float, default=0.2, help="share of images held out for evaluation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stratified train/val split")
    args = parser.parse_args()
    counts = export_digits(args.out, size=args.size, val_fraction=args.val_fraction, seed=args.seed)
    print(f"digits exported to {args.out}: " + ", ".join(f"{split}={n}" for split, n in counts.items()))


if __name__ == "__main__":
    main()
