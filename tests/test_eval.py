"""run_eval.py: kNN accuracy of a trunk that run_trainer.py really trained, of the random-init baseline, the kNN
vote itself (streamed in chunks: the same predictions as the whole similarity matrix), the feature cache, and clear
errors for unusable checkpoints and data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import run_eval as run_eval_module
from run_eval import EvalError, evaluate, knn_accuracy, knn_top1, resolve_checkpoint
from tests.conftest import REPO, run_trainer, trainer_env
from vissl_swarm.knn import exact_knn_predictions, knn_predictions, streaming_topk

# 2 batches of 16 images, one epoch: a real VISSL checkpoint in seconds (alone, no swarm)
SHORT_RUN = [
    "--isolated",
    "config.DATA.TRAIN.DATA_LIMIT=32",
    "config.OPTIMIZER.num_epochs=1",
    "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=1",
]


@pytest.fixture(scope="module")
def trained_dir(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    checkpoint_dir = tmp_path_factory.mktemp("eval") / "peer"
    result = run_trainer(
        "--config", "swav_tiny", "--data_path", str(digits_dir), "--checkpoint_dir", str(checkpoint_dir), *SHORT_RUN
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return checkpoint_dir


@pytest.fixture
def one_thread():
    """The tests share 2 cores with other tests: the in-process evaluation uses one, like the subprocesses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "run_eval.py"), *args],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_trained_and_random_init_trunks_are_evaluated(
    trained_dir: Path, digits_dir: Path, tmp_path: Path, one_thread: None
) -> None:
    result = run_eval(
        "--checkpoint", str(trained_dir), "--data_path", str(digits_dir), "--json", str(tmp_path / "knn.json")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "knn.json").read_text())
    assert 0.0 <= report["top1"] <= 1.0
    # the folder resolves to the final checkpoint VISSL wrote, through its checkpoint.torch link
    assert Path(report["checkpoint"]).name == "model_final_checkpoint_phase0.torch"
    assert report["num_val"] == 360 and report["num_train"] == 1437 and report["feature_dim"] == 64
    assert f"{report['top1']:.4f}" in result.stdout
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    baseline = run_eval("--random_init", "--data_path", str(digits_dir))  # extracted here (no cache): no warning
    assert baseline.returncode == 0 and "kNN top-1" in baseline.stdout, baseline.stderr[-3000:]
    assert "Warning" not in baseline.stderr, baseline.stderr[-3000:]

    random_init = knn_accuracy(None, digits_dir, config="swav_tiny", k=20)
    assert 0.0 <= random_init <= 1.0
    # 10 classes: a trunk, even an untrained one, separates the digits far better than chance
    assert random_init > 0.2 and report["top1"] > 0.2


def test_knn_vote_weights_close_neighbours_more() -> None:
    train = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]]), dim=1)
    labels = torch.tensor([0, 0, 1, 1])
    val = torch.nn.functional.normalize(torch.tensor([[1.0, 0.05], [0.05, 1.0]]), dim=1)
    assert knn_top1(train, labels, val, torch.tensor([0, 1]), k=2, temperature=0.1) == 1.0
    assert knn_top1(train, labels, val, torch.tensor([1, 0]), k=2, temperature=0.1) == 0.0
    # k=3 with two class-1 neighbours that are far and one class-0 neighbour that is close: the close one wins
    train = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.2, 1.0], [0.3, 1.0]]), dim=1)
    val = torch.nn.functional.normalize(torch.tensor([[1.0, 0.1]]), dim=1)
    assert knn_top1(train, torch.tensor([0, 1, 1]), val, torch.tensor([0]), k=3, temperature=0.1) == 1.0


def test_unusable_checkpoints_are_named(trained_dir: Path, digits_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no_such_peer"
    result = run_eval("--checkpoint", str(missing), "--data_path", str(digits_dir))
    assert result.returncode == 2 and f"--checkpoint {missing}: no such file or folder" in result.stderr
    assert "Traceback" not in result.stderr

    truncated = tmp_path / "truncated.torch"
    truncated.write_bytes((trained_dir / "checkpoint.torch").read_bytes()[:50_000])
    with pytest.raises(EvalError, match=f"{truncated}: cannot be read as a torch checkpoint"):
        knn_accuracy(truncated, digits_dir)

    foreign = tmp_path / "foreign.torch"
    torch.save({"state_dict": {"weight": torch.zeros(2)}}, foreign)
    with pytest.raises(EvalError, match=f"{foreign}: not a VISSL checkpoint"):
        knn_accuracy(foreign, digits_dir)

    empty = tmp_path / "empty_peer"
    empty.mkdir()
    with pytest.raises(EvalError, match="holds no VISSL checkpoint"):
        knn_accuracy(empty, digits_dir)

    # without VISSL's checkpoint.torch link, a folder resolves to its final checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(trained_dir, copy, symlinks=True)
    (copy / "checkpoint.torch").unlink()
    assert resolve_checkpoint(copy).name == "model_final_checkpoint_phase0.torch"


def test_missing_data_folder_is_named(trained_dir: Path, tmp_path: Path) -> None:
    only_train = tmp_path / "only_train"
    (only_train / "train" / "0").mkdir(parents=True)
    (only_train / "train" / "0" / "a.png").write_bytes(b"")
    result = run_eval("--checkpoint", str(trained_dir), "--data_path", str(only_train))
    assert result.returncode == 2 and f"no folder {only_train / 'val'}" in result.stderr
    with pytest.raises(EvalError, match="no folder"):
        knn_accuracy(None, tmp_path / "nothing_here")


def test_streaming_knn_equals_exact_on_random_features(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    train = torch.nn.functional.normalize(torch.randn(3000, 32, generator=generator), dim=1)
    val = torch.nn.functional.normalize(torch.randn(400, 32, generator=generator), dim=1)
    labels = torch.randint(0, 10, (3000,), generator=generator)
    exact = exact_knn_predictions(train, labels, val, k=20, temperature=0.1, num_classes=10)
    np.save(tmp_path / "bank.npy", train.numpy())
    # chunks smaller than k, uneven last chunk and last query block; a bank on disk read in chunks; sizes derived
    # from a tiny memory budget
    for bank, sizes in (
        (train, {"query_block": 37, "train_chunk": 13}),
        (tmp_path / "bank.npy", {"query_block": 100, "train_chunk": 7}),
        (tmp_path / "bank.npy", {"memory_gb": 1e-4}),
    ):
        streamed = knn_predictions(bank, labels.numpy(), val, k=20, temperature=0.1, num_classes=10, **sizes)
        assert torch.equal(streamed, exact), sizes


def test_features_are_cached_and_the_streamed_vote_is_exact(
    trained_dir: Path, digits_dir: Path, tmp_path: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    first = evaluate(trained_dir, digits_dir, feature_cache=cache)
    cached = sorted(path.name for path in cache.iterdir())
    assert len(cached) == 4 and all(name.startswith(("train-", "val-")) for name in cached)

    def no_extraction(*args: object, **kwargs: object) -> None:
        raise AssertionError("extracted again despite the cache")

    monkeypatch.setattr(run_eval_module, "extract_features", no_extraction)
    assert evaluate(trained_dir, digits_dir, feature_cache=cache) == first

    # the digits features of a trained trunk: the streamed vote, in many chunks, finds the full matrix's neighbours
    # and predicts as it does. A trunk trained two steps gives many near-equal similarities: a chunk's product may
    # round differently in the last bit, so where the k-th neighbour ties the next one or two classes' votes tie,
    # either answer is right (seen once, on a loaded machine)
    files = {name.split("-")[0] + (".labels" if "labels" in name else ""): cache / name for name in cached}
    train, val = torch.from_numpy(np.load(files["train"])), torch.from_numpy(np.load(files["val"]))
    train_labels, val_labels = (torch.from_numpy(np.load(files[f"{split}.labels"])) for split in ("train", "val"))
    exact = exact_knn_predictions(train, train_labels, val, k=20, temperature=0.1, num_classes=10)
    assert first.top1 == float((exact == val_labels).float().mean())
    nearest = (val @ train.T).topk(21, dim=1)  # the full matrix's 20 nearest, and the next one
    decided = ~near_ties(nearest, train_labels, k=20, temperature=0.1, num_classes=10)
    exact_similarity = nearest.values[:, :20]
    for sizes in ({}, {"query_block": 50, "train_chunk": 100}):
        similarity, _ = streaming_topk(files["train"], val, 20, **sizes)
        assert torch.allclose(similarity, exact_similarity, atol=1e-5), sizes
        streamed = knn_predictions(files["train"], train_labels, val, k=20, temperature=0.1, num_classes=10, **sizes)
        assert torch.equal(streamed[decided], exact[decided]), (sizes, int(decided.sum()), len(decided))


def near_ties(
    top: torch.return_types.topk, labels: torch.Tensor, k: int, temperature: float, num_classes: int
) -> torch.Tensor:
    """Queries whose vote rounding may decide (``top``: each query's k + 1 nearest): the k-th similarity within 1e-5
    of the next, or the two largest classes' votes within 0.1% of each other."""
    tie_at_k = top.values[:, k - 1] - top.values[:, k] <= 1e-5
    votes = torch.zeros(len(top.values), num_classes)
    votes.scatter_add_(1, labels[top.indices[:, :k]], (top.values[:, :k] / temperature).exp())
    best, second = votes.topk(2, dim=1).values.unbind(dim=1)
    return tie_at_k | (best - second <= 1e-3 * best)


def test_a_resnet50_trunk_is_evaluated_as_the_trainer_calls_it(digits_dir: Path, tmp_path: Path) -> None:
    """VISSL's ResNet trunk needs the feature keys argument the trainer passes ([]), unlike the RegNet of swav_tiny:
    feature extraction and the BatchNorm pass run on swav_resnet50's untrained trunk (a few digits, CPU)."""
    import shutil

    from run_eval import adapt_batchnorm, build_trunk, eval_transform, extract_features

    folder = tmp_path / "few"
    for label in ("0", "1"):
        (folder / label).mkdir(parents=True)
        for image in sorted((digits_dir / "val" / label).iterdir())[:2]:
            shutil.copy(image, folder / label / image.name)
    trunk, config = build_trunk("swav_resnet50", None, None)
    transform = eval_transform(config)
    adapt_batchnorm(trunk, folder, transform, batch_size=4)
    features, labels = extract_features(trunk, folder, transform, batch_size=4)
    assert features.shape == (4, 2048) and labels.tolist() == [0, 0, 1, 1]
