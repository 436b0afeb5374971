"""bench_learning's evaluation: a trunk's kNN top-1 on val (``Evaluator``), each box's checkpoints, the curves."""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

import numpy as np
import torch

from benchmarks.common import crossing, rounded
from benchmarks.learning_setup import SWARM_MODES, BenchError, Plan, count_images
from run_eval import knn_top1
from vissl_swarm.local_swarm import LocalPeer, read_jsonl


def load_split(folder: Path, transform: Any, indices: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The eval-transformed images of one ImageFolder split (or of ``indices`` of it) and their labels."""
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(str(folder), transform=transform)
    chosen = range(len(dataset)) if indices is None else indices
    images, labels = [], []
    for index in chosen:
        image, label = dataset[index]
        images.append(image)
        labels.append(label)
    return torch.stack(images), torch.tensor(labels)


def fixed_subset(size: int, count: int, seed: int) -> list[int] | None:
    """``count`` of ``size`` indices, the same for every model (None: all)."""
    if count <= 0 or count >= size:
        return None
    return sorted(torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:count].tolist())


class Evaluator:
    """kNN top-1 (bank: a fixed train subset; queries: val) and held-out SwAV loss of a checkpoint; decoded once."""

    def __init__(
        self,
        config_name: str,
        overrides: list[str],
        data_path: Path,
        knn_train: int,
        heldout_images: int,
        heldout_batch: int,
    ) -> None:
        from vissl_swarm import vissl_compat

        vissl_compat.apply()
        from classy_vision.generic.distributed_util import set_cpu_device
        from vissl.models import build_model

        from run_eval import eval_transform
        from vissl_swarm.config_loading import compose_config

        set_cpu_device()  # the evaluation runs on the CPU (SwAV's Sinkhorn would move its tensors to a GPU otherwise)
        self.config, _ = compose_config(  # no queue for the held-out loss: a fresh one is empty, fed to the Sinkhorn
            config_name, [*overrides, "config.LOSS.swav_loss.queue.queue_length=0"], has_gpu=False
        )
        self.model = build_model(self.config.MODEL, self.config.OPTIMIZER)
        transform = eval_transform(self.config)
        self.bank_indices = fixed_subset(count_images(data_path / "train"), knn_train, seed=1)
        self.bank, self.bank_labels = load_split(data_path / "train", transform, self.bank_indices)
        self.val, self.val_labels = load_split(data_path / "val", transform)
        self.temperature = float(self.config.NEAREST_NEIGHBOR.SIGMA)
        self.heldout = self._heldout_batches(data_path / "val", heldout_images, heldout_batch)

    @property
    def sizes(self) -> dict:
        return {
            "knn_bank": len(self.bank_labels),
            "knn_queries": len(self.val_labels),
            "heldout_batches": len(self.heldout),
        }

    def _heldout_batches(self, folder: Path, count: int, batch: int) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """Held-out crops drawn once: ``count`` val images, training transforms seeded 0 (torch, numpy, random)."""
        from torchvision.datasets import ImageFolder
        from vissl.data.collators import get_collator
        from vissl.data.ssl_transforms import get_transform

        dataset = ImageFolder(str(folder))
        count = max(batch, min(count, len(dataset)) // batch * batch)
        indices = fixed_subset(len(dataset), count, seed=2) or list(range(len(dataset)))[:count]
        transform = get_transform(self.config.DATA.TRAIN.TRANSFORMS)
        train = self.config.DATA.TRAIN
        collate = get_collator(train.COLLATE_FUNCTION, train.get("COLLATE_FUNCTION_PARAMS", {}))
        state = torch.get_rng_state(), np.random.get_state(), random.getstate()
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        try:
            samples = [
                transform({"data": [dataset[index][0]], "label": [index], "data_valid": [1], "data_idx": [index]})
                for index in indices
            ]
        finally:
            torch.set_rng_state(state[0])
            np.random.set_state(state[1])
            random.setstate(state[2])
        batches = []
        for start in range(0, len(samples), batch):
            collated = collate(samples[start : start + batch])
            batches.append((collated["data"][0], collated["label"][0]))
        return batches

    def load(self, checkpoint: Path) -> None:
        """The model of a VISSL checkpoint (trunk and heads, with BatchNorm statistics)."""
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)  # our own benchmark's files
        self.model.set_classy_state(state["classy_state_dict"]["base_model"])

    def features(self, images: torch.Tensor, batch: int = 512) -> torch.Tensor:
        trunk = self.model.trunk.eval()
        with torch.no_grad():
            return torch.cat(
                [
                    torch.nn.functional.normalize(trunk(images[start : start + batch])[0].flatten(1).float(), dim=1)
                    for start in range(0, len(images), batch)
                ]
            )

    def knn(self, bank: torch.Tensor, queries: torch.Tensor, k: int = 20, chunk: int = 2000) -> float:
        """run_eval.py's weighted kNN vote, over chunks of queries (a 10k x 60k similarity matrix is 2.4 GB)."""
        correct = 0.0
        for start in range(0, len(queries), chunk):
            labels = self.val_labels[start : start + chunk]
            part = knn_top1(bank, self.bank_labels, queries[start : start + chunk], labels, k, self.temperature)
            correct += part * len(labels)
        return correct / len(queries)

    def knn_of_model(self) -> float:
        return self.knn(self.features(self.bank), self.features(self.val))

    def heldout_loss(self) -> float:
        """Mean SwAV loss over the held-out batches, BatchNorm on batch statistics as training computes it."""
        import vissl.losses  # noqa: F401  (registers VISSL's losses)
        from classy_vision.losses import build_loss

        name = self.config.LOSS["name"]
        loss_config = copy.deepcopy(self.config.LOSS[name])  # VISSL's AttrDict, as its task builds the loss
        loss_config["name"] = name
        loss = build_loss(loss_config)
        self.model.train()
        values = []
        with torch.no_grad():
            for crops, target in self.heldout:
                output = self.model(crops)
                output = output[0] if len(output) == 1 else output  # as VISSL's train step does
                values.append(float(loss(output, target)))
        self.model.eval()
        return mean(values)

    def evaluate(self, checkpoint: Path) -> dict:
        self.load(checkpoint)
        accuracy = self.knn_of_model()
        return {"knn": round(accuracy, 4), "heldout_loss": round(self.heldout_loss(), 4)}

    def adapt_batchnorm(self, batch: int = 256) -> None:
        """The model's BatchNorm statistics recomputed over the kNN bank's train images (run_eval.py --adapt_bn)."""
        trunk = self.model.trunk
        norms = [module for module in trunk.modules() if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)]
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None
        order = torch.randperm(len(self.bank), generator=torch.Generator().manual_seed(0))
        trunk.train()
        with torch.no_grad():
            for start in range(0, len(order), batch):
                trunk(self.bank[order[start : start + batch]])
        trunk.eval()

    def raw_pixels(self) -> float:
        """kNN on the eval tensors themselves, flattened: what the trunk has to beat without any learning."""

        def flat(images: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.normalize(images.flatten(1).float(), dim=1)

        return self.knn(flat(self.bank), flat(self.val))


def box_checkpoints(folder: Path, mode: str, plan: Plan) -> list[dict]:
    """A box's checkpoints in order: path, its steps, the swarm's samples (alone and ddp: steps x global batch)."""
    finals = list(folder.glob("model_final_checkpoint*.torch"))
    if not finals:
        raise BenchError(f"{folder} holds no final checkpoint (model_final_checkpoint_*.torch): training did not end")
    found: dict[int, dict] = {}
    for path in [*folder.glob("model_iteration*.torch"), *finals]:  # the final one last: it wins a shared step
        state = torch.load(path, map_location="cpu", weights_only=False)  # our own benchmark's files
        steps = int(state["iteration"])
        progress = state["classy_state_dict"].get("swarm_progress")
        samples = int(progress["position"]) if progress else steps * plan.global_batch(mode)
        found[steps] = {"path": path, "steps": steps, "samples": samples, "final": path in finals}
    return [found[steps] for steps in sorted(found)]


def rounds_of(peer: LocalPeer) -> dict:
    """A swarm box's averaging rounds (its averaging_rounds.jsonl)."""
    records = read_jsonl(peer.checkpoint_dir / "averaging_rounds.jsonl")
    applied = [record for record in records if record.get("applied")]
    staleness = [record["staleness_steps"] for record in applied if record.get("staleness_steps") is not None]
    return {
        "applied": len(applied),
        "failed": len(records) - len(applied),
        "group_size_mean": rounded(mean(r["group_size"] for r in applied)) if applied else None,
        "staleness_mean": rounded(mean(staleness)) if staleness else None,
    }


def mean_curve(boxes: list[list[dict]], initial: InitialModel) -> list[dict]:
    """The run's curve: step 0, the checkpoints every box has at the same step, the final ones; means over boxes."""
    common = set.intersection(*({point["steps"] for point in box if not point["final"]} for box in boxes))
    points = [{"steps": 0, "samples": 0, "knn": initial.knn, "heldout_loss": initial.heldout_loss}]
    groups = [[next(p for p in box if p["steps"] == steps) for box in boxes] for steps in sorted(common)]
    groups.append([box[-1] for box in boxes])
    for group in groups:
        points.append(
            {
                key: rounded(mean(point[key] for point in group), 4 if key in ("knn", "heldout_loss") else 1)
                for key in ("steps", "samples", "knn", "heldout_loss")
            }
        )
    return points


def reached(curve: list[dict], target: float, axis: str) -> float | None:
    """Where the curve first reaches ``target`` kNN along ``axis`` (steps or samples); None if it never does."""
    at = crossing([(point[axis], point["knn"]) for point in curve], target)
    return None if at is None else round(at, 1)


def trunk_distance(paths: list[Path]) -> float | None:
    """Mean pairwise L2 distance of the boxes' final trunks (how far the swarm's boxes are apart at the end)."""
    from run_eval import load_trunk_state

    weights = [
        [tensor.double() for _, tensor in sorted(load_trunk_state(path).items()) if tensor.is_floating_point()]
        for path in paths
    ]
    distances = [
        math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True)))
        for a, b in itertools.combinations(weights, 2)
    ]
    return rounded(mean(distances), 3) if distances else None


def evaluate_run(
    mode: str,
    seed: int,
    peers: list[LocalPeer],
    plan: Plan,
    evaluator: Evaluator,
    initial: InitialModel,
    wall_s: float,
    hivemind_target: int | None,
) -> dict:
    """Every box's checkpoints evaluated (kNN, held-out loss), the run's mean curve, steps, samples and rounds."""
    boxes, final_paths = [], []
    for peer in peers:
        points = box_checkpoints(peer.checkpoint_dir, mode, plan)
        final_paths.append(points[-1]["path"])
        for point in points:
            point.update(evaluator.evaluate(point.pop("path")))
        boxes.append(points)
    finals = [box[-1] for box in boxes]
    result = {
        "mode": mode,
        "seed": seed,
        "wall_s": round(wall_s, 1),
        "same_initial_model": started_from(mode, peers, initial),
        "knn": round(mean(point["knn"] for point in finals), 4),
        "knn_per_box": [point["knn"] for point in finals],
        "heldout_loss": round(mean(point["heldout_loss"] for point in finals), 4),
        "steps_per_box": [point["steps"] for point in finals],
        "samples_of_swarm": max(point["samples"] for point in finals),
        "curve": mean_curve(boxes, initial),
        "curves_per_box": [[{k: v for k, v in point.items() if k != "final"} for point in box] for box in boxes],
    }
    if mode in SWARM_MODES:
        rounds = [rounds_of(peer) for peer in peers]
        applied = [entry["applied"] for entry in rounds]
        ratios = [steps / count for steps, count in zip(result["steps_per_box"], applied, strict=True) if count]
        last_logged = [peer.progress()[-1] for peer in peers if peer.progress()]
        result.update(
            rounds_per_box=rounds,
            rounds_applied_per_box=applied,
            steps_per_round=rounded(mean(ratios), 1) if ratios else None,
            trunk_distance=trunk_distance(final_paths),
            lr_factor=[entry.get("lr_factor") for entry in last_logged],
        )  # --swarm_lr scaling
        if mode == "hivemind_optimizer":
            result["hivemind_target_batch_size"] = hivemind_target
    return result


def floor_runs(mode: str, seed: int, initial: InitialModel, raw_pixels: float | None) -> dict:
    value = initial.knn_adapted_bn if mode == "random_init" else raw_pixels
    return {"mode": mode, "seed": seed, "knn": value, "steps_per_box": [0], "samples_of_swarm": 0, "curve": []}


def hivemind_target_for(seed: int, runs: list[dict], plan: Plan, args: argparse.Namespace) -> tuple[int, str]:
    """hivemind_optimizer's samples per global epoch: rounds as often as ``swarm``'s (same seed), else the flag's."""
    measured = next(
        (
            run.get("steps_per_round")
            for run in runs
            if run["mode"] == "swarm" and run["seed"] == seed and "error" not in run
        ),
        None,
    )
    steps = measured or args.hivemind_steps_per_round
    source = f"swarm's {measured} steps per round" if measured else f"--hivemind_steps_per_round {steps:g}"
    return max(plan.batch, round(plan.boxes * plan.batch * steps)), source


@dataclass(frozen=True)
class InitialModel:
    """What every process of a seed starts from; evaluated as is and with BatchNorm adapted (the random_init floor)."""

    path: Path
    trunk_fingerprint: str
    knn: float
    heldout_loss: float
    knn_adapted_bn: float


def run_id(seed: int) -> str:
    return f"learn{seed}"


def write_initial_model(
    seed: int, folder: Path, config_name: str, overrides: list[str], evaluator: Evaluator
) -> InitialModel:
    """The model the swarm boxes of run ``learn<seed>`` build, saved as VISSL weights for alone and ddp to load."""
    from vissl_swarm import vissl_compat

    vissl_compat.apply()
    from vissl.models import build_model
    from vissl.utils.misc import set_torch_seed

    from vissl_swarm.config_loading import compose_config
    from vissl_swarm.initial_model import initial_model_seed, weights_fingerprint

    config, _ = compose_config(config_name, overrides, has_gpu=False)
    init_seed = initial_model_seed(run_id(seed), config_name)
    config.MODEL._MODEL_INIT_SEED = init_seed  # as the task does: VISSL seeds the heads with it
    with set_torch_seed(init_seed):
        model = build_model(config.MODEL, config.OPTIMIZER)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run_id(seed)}.torch"
    torch.save({"classy_state_dict": {"base_model": model.get_classy_state()}}, path)
    as_is = evaluator.evaluate(path)
    evaluator.load(path)
    evaluator.adapt_batchnorm()
    return InitialModel(
        path, weights_fingerprint(model.trunk), as_is["knn"], as_is["heldout_loss"], round(evaluator.knn_of_model(), 4)
    )


def started_from(mode: str, peers: list[LocalPeer], initial: InitialModel) -> bool:
    """Whether every process logged starting from the seed's initial model (its trunk fingerprint or weights file)."""
    if mode in SWARM_MODES:  # (a restarted box builds it again before it loads its checkpoint: logged twice)
        return all(
            set(re.findall(r"trunk fingerprint (\w+)", peer.log_text())) == {initial.trunk_fingerprint}
            for peer in peers
        )
    return all(f"Initializing model from: {initial.path}" in peer.log_text() for peer in peers)
