#!/usr/bin/env python3
"""Train SwAV with the stock VISSL trainer on one box (one peer).

    python run_trainer.py --config swav_tiny --data_path data/digits --checkpoint_dir checkpoints/peer0
    python run_trainer.py --config swav_resnet50 --data_path /datasets/imagenet config.OPTIMIZER.num_epochs=100

Any number of VISSL overrides ``config.SECTION.KEY=VALUE`` may follow the flags.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import vissl_compat
from config_loading import ConfigError, available_configs, check_overrides, config_path

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp"}

logger = logging.getLogger("run_trainer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--config", required=True, help=f"config name in configs/ (available: {', '.join(available_configs())})"
    )
    parser.add_argument(
        "--data_path", type=Path, default=None,
        help="dataset root in ImageFolder layout: DATA_PATH/train/<class>/<image>; default: the config's own",
    )
    parser.add_argument(
        "--checkpoint_dir", type=Path, default=None,
        help="where VISSL writes checkpoints, logs and metrics; a restarted peer resumes from here",
    )
    parser.add_argument("overrides", nargs="*", help="VISSL overrides such as config.OPTIMIZER.num_epochs=10")
    return parser


def check_data_path(data_path: Path) -> Path:
    """Fail before training starts if VISSL's disk_folder source would find no images."""
    train_dir = data_path / "train"
    if not train_dir.is_dir():
        raise ConfigError(
            f"--data_path {data_path}: no folder {train_dir}. Expected ImageFolder layout "
            f"{data_path}/train/<class>/<image>; `python scripts/export_digits.py --out {data_path}` makes a small one"
        )
    class_dirs = [path for path in train_dir.iterdir() if path.is_dir()]
    has_images = any(
        file.suffix.lower() in IMAGE_SUFFIXES for class_dir in class_dirs for file in class_dir.iterdir()
    )
    if not has_images:
        raise ConfigError(
            f"--data_path {data_path}: {train_dir} has no images in class sub-folders "
            f"(expected {train_dir}/<class>/<image> with one of {sorted(IMAGE_SUFFIXES)})"
        )
    return train_dir


def trainer_overrides(args: argparse.Namespace) -> list[str]:
    """The user's overrides plus those our own flags stand for (ours last, so the flags win)."""
    overrides = list(args.overrides)
    if args.data_path is not None:
        train_dir = check_data_path(args.data_path).resolve()
        overrides += [f"config.DATA.TRAIN.DATA_PATHS=[{train_dir}]", f"config.DATA.TRAIN.LABEL_PATHS=[{train_dir}]"]
    if args.checkpoint_dir is not None:
        overrides.append(f"config.CHECKPOINT.DIR={args.checkpoint_dir.resolve()}")
    return overrides


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config_path(args.config)
        check_overrides(args.overrides)
        overrides = trainer_overrides(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    vissl_compat.apply()
    import torch
    from vissl.hooks import default_hook_generator
    from vissl.utils.distributed_launcher import launch_distributed

    from config_loading import compose_config

    try:
        config, changes = compose_config(
            args.config, overrides, has_gpu=torch.cuda.is_available(), dump_config=True
        )
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for change in changes:
        print(f"[compat] {change}", file=sys.stderr)
    vissl_compat.fork_start_method()
    launch_distributed(config, node_id=0, engine_name="train", hook_generator=default_hook_generator)
    return 0


if __name__ == "__main__":
    sys.exit(main())
