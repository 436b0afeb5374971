#!/usr/bin/env python3
"""kNN top-1 accuracy of a trained trunk: how well frozen SwAV features separate the classes of a labelled set.

    python run_eval.py --checkpoint checkpoints/peer0 --data_path data/digits
    python run_eval.py --random_init --data_path data/digits          # the baseline: an untrained trunk
    python run_eval.py --random_init --adapt_bn --data_path data/digits   # the honest floor (see below)

Features are the trunk's own final output (global-pooled by its avgpool + flatten) on DATA_PATH/train and
DATA_PATH/val, resized to the config's first crop size and normalized like the training data. Each val image
votes among its k most cosine-similar train images, each vote weighted exp(similarity / T), T = VISSL's
``NEAREST_NEIGHBOR.SIGMA`` (0.1): the rule of VISSL's nearest_neighbor benchmark and of DINO's kNN.

``--adapt_bn`` first recomputes the trunk's BatchNorm running statistics on DATA_PATH/train (no gradient, no
labels). An untrained trunk's statistics are mean 0 / variance 1, not its activations' on the digits; any
training adapts them, whether or not it learns anything. The random-init trunk with adapted statistics is the floor
a trained trunk must beat for "it learned".

Why not VISSL's own benchmark engine: the vissl 0.1.6 wheel ships neither the benchmark configs
(configs/config/benchmark/nearest_neighbor) nor the kNN (tools/nearest_neighbor_test.py), both only in its source
repository, and its extract_features engine runs through launch_distributed (a torch.distributed process group,
per-rank feature files on disk), heavy for a function a benchmark calls in a loop. So VISSL composes the config
and builds the model, the checkpoint is VISSL's own format, and the kNN vote is written in torch (vissl_swarm.knn).

Scale (ImageNet: 1.28M train images, 2048-dim features): the vote streams the train features in chunks with a
running top-k per query (vissl_swarm.knn), its working memory bounded by ``--knn_memory_gb`` instead of a 50,000 x 1.28M
similarity matrix. Extraction runs on CUDA when there is one (AMP autocast, ``--num_workers`` loader processes), and
the features of each split are cached as .npy (default: ``eval_features/`` next to the checkpoint, or
``--feature_cache DIR``), keyed by checkpoint path + mtime, data folder, split, config and --adapt_bn, so a second
evaluation of the same checkpoint skips extraction; the cached train features are read memory-mapped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vissl_swarm.config_loading import ConfigError, available_configs, config_path
from vissl_swarm.knn import DEFAULT_MEMORY_GB, knn_predictions

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp"}
SPLITS = ("train", "val")


class EvalError(ValueError):
    """A missing or unusable checkpoint or dataset; the message names the file or folder."""


@dataclass
class KnnResult:
    top1: float
    k: int
    temperature: float
    num_train: int
    num_val: int
    feature_dim: int
    checkpoint: str | None
    config: str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--checkpoint",
        type=Path,
        help="a VISSL checkpoint file, or a peer's checkpoint folder (its checkpoint.torch, else "
        "its newest model_*.torch)",
    )
    source.add_argument(
        "--random_init",
        action="store_true",
        help="evaluate the untrained trunk (seeded with the config's SEED_VALUE): the baseline",
    )
    parser.add_argument(
        "--data_path",
        type=Path,
        required=True,
        help="labelled ImageFolder dataset: DATA_PATH/train/<class>/<image> and DATA_PATH/val/...",
    )
    parser.add_argument(
        "--config",
        default="swav_tiny",
        help=f"the config the trunk was trained with (available: {', '.join(available_configs())})",
    )
    parser.add_argument(
        "--adapt_bn",
        action="store_true",
        help="recompute the trunk's BatchNorm statistics on DATA_PATH/train before extracting",
    )
    parser.add_argument("--k", type=int, default=20, help="number of neighbours that vote")
    parser.add_argument("--batch_size", type=int, default=256, help="images per forward pass of the trunk")
    parser.add_argument("--num_workers", type=int, default=0, help="DataLoader worker processes for decoding images")
    parser.add_argument(
        "--knn_memory_gb",
        type=float,
        default=DEFAULT_MEMORY_GB,
        help="working memory of the kNN vote (train chunk + similarity block), not counting the features themselves",
    )
    parser.add_argument(
        "--feature_cache",
        type=Path,
        default=None,
        help="folder for cached features (default: eval_features/ next to the checkpoint; "
        "--random_init caches only with this flag)",
    )
    parser.add_argument("--no_feature_cache", action="store_true", help="always extract, write no cache")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here as JSON")
    return parser


def check_data_path(data_path: Path) -> list[str]:
    """Both splits must be ImageFolders with the same classes; return the class names."""
    classes = {}
    for split in SPLITS:
        folder = data_path / split
        if not folder.is_dir():
            raise EvalError(
                f"--data_path {data_path}: no folder {folder}; expected {data_path}/{split}/<class>/"
                f"<image> (`python scripts/export_digits.py --out {data_path}` makes a small one)"
            )
        names = sorted(path.name for path in folder.iterdir() if path.is_dir() and has_images(path))
        if not names:
            raise EvalError(f"--data_path {data_path}: {folder} has no class folders with images")
        classes[split] = names
    if classes["train"] != classes["val"]:
        raise EvalError(
            f"--data_path {data_path}: train and val have different classes ({classes['train']} vs {classes['val']})"
        )
    return classes["train"]


def has_images(folder: Path) -> bool:
    return any(path.suffix.lower() in IMAGE_SUFFIXES for path in folder.iterdir())


def resolve_checkpoint(path: Path) -> Path:
    """A file as given; a folder: VISSL's checkpoint.torch link to its newest, else the final or newest one."""
    if path.is_file():
        return path
    if not path.exists():
        raise EvalError(f"--checkpoint {path}: no such file or folder")
    if (path / "checkpoint.torch").is_file():
        return (path / "checkpoint.torch").resolve()
    finals = sorted(path.glob("model_final_checkpoint_phase*.torch"), key=_number)
    for pattern in ("model_iteration*.torch", "model_phase*.torch"):
        finals = finals or sorted(path.glob(pattern), key=_number)
    if not finals:
        raise EvalError(
            f"--checkpoint {path}: the folder holds no VISSL checkpoint (checkpoint.torch or model_*.torch)"
        )
    return finals[-1]


def _number(path: Path) -> int:
    found = re.findall(r"\d+", path.stem)
    return int(found[-1]) if found else -1


def load_trunk_state(path: Path) -> dict[str, Any]:
    """The trunk's state dict from a VISSL checkpoint; weights_only: a checkpoint needs no code to unpickle."""
    import torch

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated file, not a torch file, foreign pickle: all mean "not usable"
        first_sentence = str(error).split(". ")[0].splitlines()[0] if str(error).strip() else ""
        reason = f"{type(error).__name__}: {first_sentence}" if first_sentence else type(error).__name__
        raise EvalError(
            f"--checkpoint {path}: cannot be read as a torch checkpoint, corrupt or not one ({reason})"
        ) from error
    try:
        return checkpoint["classy_state_dict"]["base_model"]["model"]["trunk"]
    except (KeyError, TypeError) as error:
        raise EvalError(
            f"--checkpoint {path}: not a VISSL checkpoint (no classy_state_dict/base_model/model/trunk)"
        ) from error


def eval_transform(config: Any) -> Any:
    """Resize + center crop to the config's (first) training crop size, normalized like the training data."""
    from torchvision import transforms

    size, mean, std = 224, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    for step in config.DATA.TRAIN.TRANSFORMS:
        if step["name"] == "ImgPilToMultiCrop":
            size = int(step["size_crops"][0])
        elif step["name"] in ("RandomResizedCrop", "CenterCrop") and "size" in step:
            size = int(step["size"])
        elif step["name"] == "Normalize":
            mean, std = list(step["mean"]), list(step["std"])
    return transforms.Compose(
        [transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor(), transforms.Normalize(mean, std)]
    )


def build_trunk(config_name: str, trunk_state: dict[str, Any] | None, source: Path | None) -> tuple[Any, Any]:
    """The config's trunk in eval mode, with the checkpoint's weights or its seeded random init."""
    import torch

    from vissl_swarm import vissl_compat

    vissl_compat.apply()
    from vissl.models import build_model

    from vissl_swarm.config_loading import compose_config

    config, _ = compose_config(config_name, [], has_gpu=False)
    torch.manual_seed(config.SEED_VALUE)
    trunk = build_model(config.MODEL, config.OPTIMIZER).trunk
    if trunk_state is not None:
        try:
            trunk.load_state_dict(trunk_state)
        except RuntimeError as error:
            first_line = str(error).splitlines()[0]
            raise EvalError(
                f"--checkpoint {source}: its trunk does not fit config {config_name!r} "
                f"({first_line}); pass the --config it was trained with"
            ) from error
    return trunk.eval(), config


def image_loader(
    folder: Path, transform: Any, batch_size: int, shuffle_seed: int | None = None, num_workers: int = 0
) -> Any:
    """Batches of one ImageFolder split, in file order or shuffled with a seeded generator."""
    import torch
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(str(folder), transform=transform)
    generator = None if shuffle_seed is None else torch.Generator().manual_seed(shuffle_seed)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle_seed is not None,
        generator=generator,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
    )


def adapt_batchnorm(trunk: Any, folder: Path, transform: Any, batch_size: int, num_workers: int = 0) -> Any:
    """The trunk with every BatchNorm's running mean and variance recomputed over the images of ``folder``: a
    forward pass in train mode without gradients, momentum None (torch's cumulative average over all batches)."""
    import torch

    norms = [module for module in trunk.modules() if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
    trunk.train()
    with torch.no_grad():  # shuffled: the folder is sorted by class, and a batch of one class has skewed statistics
        for images, _ in image_loader(folder, transform, batch_size, shuffle_seed=0, num_workers=num_workers):
            trunk(images.to(trunk_device(trunk), non_blocking=True), [])  # [] as the trainer: ResNet needs it
    return trunk.eval()


def trunk_device(trunk: Any) -> Any:
    return next(trunk.parameters()).device


def extract_features(
    trunk: Any, folder: Path, transform: Any, batch_size: int, num_workers: int = 0
) -> tuple[Any, Any]:
    """L2-normalized trunk features and labels of one ImageFolder split, on the CPU (the bank may not fit on the
    GPU); the forward passes on the trunk's device, under AMP autocast on CUDA (the trunk's features are only
    compared by cosine similarity, which half precision keeps to ~3 digits)."""
    import torch

    device = trunk_device(trunk)
    loader = image_loader(folder, transform, batch_size, num_workers=num_workers)
    features, labels = [], []
    with torch.no_grad(), torch.autocast("cuda", enabled=device.type == "cuda"):
        for images, targets in loader:
            output = trunk(images.to(device, non_blocking=True), [])[0].flatten(1).float()  # [] as the trainer
            features.append(torch.nn.functional.normalize(output, dim=1).cpu())
            labels.append(targets)
    return torch.cat(features), torch.cat(labels)


def cache_key(checkpoint: Path | None, data_path: Path, split: str, config: str, adapt_bn: bool) -> str:
    """What makes two extractions equal: the checkpoint file and its mtime (a rewritten checkpoint.torch link target
    is a new file), the data folder, the split, the config (transform, random-init seed) and --adapt_bn."""
    stamp = os.stat(checkpoint).st_mtime_ns if checkpoint is not None else None
    parts = [
        str(checkpoint.resolve()) if checkpoint else "random_init",
        stamp,
        str((data_path / split).resolve()),
        split,
        config,
        adapt_bn,
    ]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def cached_features(cache_dir: Path | None, key: str, split: str, extract: Any) -> tuple[Any, Any]:
    """(features, labels) of a split from ``cache_dir``, else ``extract()``-ed and written there (atomically: a
    killed evaluation leaves no half file). Cached features come back memory-mapped: the kNN reads them in chunks."""
    import numpy as np
    import torch

    if cache_dir is None:
        return extract()
    features_file, labels_file = cache_dir / f"{split}-{key}.npy", cache_dir / f"{split}-{key}.labels.npy"
    if not (features_file.is_file() and labels_file.is_file()):
        features, labels = extract()
        cache_dir.mkdir(parents=True, exist_ok=True)
        for tensor, target in ((features, features_file), (labels, labels_file)):
            partial = target.with_name(target.name + f".{os.getpid()}.partial")
            with open(partial, "wb") as handle:
                np.save(handle, tensor.numpy())
            partial.replace(target)
    return np.load(features_file, mmap_mode="r"), torch.from_numpy(np.load(labels_file))


def knn_top1(
    train_features: Any,
    train_labels: Any,
    val_features: Any,
    val_labels: Any,
    k: int,
    temperature: float,
    memory_gb: float = DEFAULT_MEMORY_GB,
) -> float:
    """Share of val images whose weighted vote among their k nearest train images picks the right class; the train
    features (a tensor, an array or a memory-mapped .npy) streamed in chunks that fit ``memory_gb``."""
    import torch

    val_labels = torch.as_tensor(val_labels)
    num_classes = int(max(int(train_labels.max()), int(val_labels.max()))) + 1
    predictions = knn_predictions(
        train_features, train_labels, torch.as_tensor(val_features), k, temperature, num_classes, memory_gb=memory_gb
    )
    return float((predictions.cpu() == val_labels.cpu()).float().mean())


def evaluate(
    checkpoint: Path | None,
    data_path: Path,
    config: str = "swav_tiny",
    k: int = 20,
    batch_size: int = 256,
    adapt_bn: bool = False,
    num_workers: int = 0,
    knn_memory_gb: float = DEFAULT_MEMORY_GB,
    feature_cache: Path | None = None,
    use_cache: bool = True,
) -> KnnResult:
    """Extract (or load cached) features of both splits and vote; see the module docstring."""
    import numpy as np
    import torch

    if k < 1:
        raise EvalError(f"--k must be at least 1, got {k}")
    try:
        config_path(config)
    except ConfigError as error:
        raise EvalError(str(error)) from error
    check_data_path(data_path)
    resolved = resolve_checkpoint(checkpoint) if checkpoint is not None else None
    trunk_state = load_trunk_state(resolved) if resolved is not None else None  # before VISSL: fail fast
    trunk, vissl_config = build_trunk(config, trunk_state, resolved)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trunk.to(device)
    transform = eval_transform(vissl_config)
    cache_dir = feature_cache or (resolved.parent / "eval_features" if resolved is not None else None)
    cache_dir = cache_dir if use_cache else None
    adapted = False

    def extractor(split: str) -> Any:
        def extract() -> tuple[Any, Any]:
            nonlocal adapted
            if adapt_bn and not adapted:  # only when something is extracted: a cache hit needs no trunk pass
                adapt_batchnorm(trunk, data_path / "train", transform, batch_size, num_workers)
                adapted = True
            return extract_features(trunk, data_path / split, transform, batch_size, num_workers)

        return extract

    train, val = (
        cached_features(cache_dir, cache_key(resolved, data_path, split, config, adapt_bn), split, extractor(split))
        for split in SPLITS
    )
    # the queries in memory, the train bank streamed
    queries = val[0]  # a tensor when just extracted, a numpy memmap from the cache (numpy 2 warns on np.array(tensor))
    queries = queries.float() if torch.is_tensor(queries) else torch.from_numpy(np.array(queries, dtype=np.float32))
    val_features = queries.to(device)
    temperature = float(vissl_config.NEAREST_NEIGHBOR.SIGMA)
    top1 = knn_top1(train[0], train[1], val_features, val[1], k=k, temperature=temperature, memory_gb=knn_memory_gb)
    return KnnResult(
        top1=top1,
        k=min(k, len(train[1])),
        temperature=temperature,
        num_train=len(train[1]),
        num_val=len(val[1]),
        feature_dim=int(train[0].shape[1]),
        checkpoint=str(resolved) if resolved else None,
        config=config,
    )


def knn_accuracy(
    checkpoint: Path | None, data_path: Path, config: str = "swav_tiny", k: int = 20, adapt_bn: bool = False
) -> float:
    """kNN top-1 accuracy in [0, 1] on DATA_PATH/val; ``checkpoint=None``: the random-init trunk; ``adapt_bn``:
    after recomputing its BatchNorm statistics on DATA_PATH/train."""
    return evaluate(checkpoint, data_path, config, k, adapt_bn=adapt_bn).top1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = evaluate(
            None if args.random_init else args.checkpoint,
            args.data_path,
            args.config,
            args.k,
            args.batch_size,
            args.adapt_bn,
            args.num_workers,
            args.knn_memory_gb,
            args.feature_cache,
            not args.no_feature_cache,
        )
    except EvalError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    trunk = result.checkpoint or f"random init (seed of {result.config})"
    trunk += ", BatchNorm statistics of the train split" if args.adapt_bn else ""
    print(
        f"kNN top-1 on {args.data_path / 'val'}: {result.top1:.4f} (k={result.k}, T={result.temperature}, "
        f"{result.num_val} val / {result.num_train} train images, {result.feature_dim}-dim features; "
        f"trunk: {trunk})"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(result), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
