"""The training recipe: one initial model per run, and what run_trainer.py derives from the box and the dataset."""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean

import pytest
import torch

from tests.conftest import run_trainer
from vissl_swarm import swarm
from vissl_swarm.config_loading import TrainerConfig, compose_config, compose_trainer_config
from vissl_swarm.initial_model import weights_fingerprint
from vissl_swarm.local_swarm import read_jsonl
from vissl_swarm.recipe import count_images


def build_task_model(run_id: str, seed_value: int) -> torch.nn.Module:
    """The model exactly as a peer's DecentralizedSelfSupervisionTask builds it (swav_tiny, on the CPU)."""
    from decentralized_task import DecentralizedSelfSupervisionTask

    config, _ = compose_config("swav_tiny", [f"config.SEED_VALUE={seed_value}"], has_gpu=False)
    config.SWARM = swarm.SwarmSettings(run_id=run_id, config_name="swav_tiny").to_config()
    torch.manual_seed(seed_value)  # what VISSL's set_seeds does with the peer's own seed before building the task
    return DecentralizedSelfSupervisionTask(config)._build_model()


def test_peers_of_a_run_build_the_same_initial_model_and_keep_their_own_randomness() -> None:
    torch.manual_seed(1)
    first = build_task_model("runA", seed_value=1)
    after_first = torch.rand(4)  # the peer's own stream continues after the build: its data order
    second = build_task_model("runA", seed_value=2)
    after_second = torch.rand(4)
    other_run = build_task_model("runB", seed_value=1)

    assert weights_fingerprint(first) == weights_fingerprint(second)  # trunk and heads
    assert weights_fingerprint(first.trunk) != weights_fingerprint(other_run.trunk)
    assert not torch.equal(after_first, after_second)  # seeds 1 and 2 still give two different peers
    torch.manual_seed(1)
    assert torch.equal(after_first, torch.rand(4)), "building the model must not consume the peer's random stream"


def box_config(name: str, digits_dir: Path, *overrides: str) -> TrainerConfig:
    train = digits_dir / "train"
    return compose_trainer_config(
        name,
        [
            f"config.DATA.TRAIN.DATA_PATHS=[{train}]",
            f"config.CHECKPOINT.DIR={digits_dir.parent / 'recipe_checkpoints'}",
            *overrides,
        ],
        has_gpu=True,
    )


def test_the_resnet50_recipe_is_scaled_to_the_box_and_the_dataset(digits_dir: Path) -> None:
    """Two GPUs of 64 images: a box batch of 128, half of SwAV's 256; an epoch is images // 128 iterations."""
    composed = box_config("swav_resnet50", digits_dir, "config.DISTRIBUTED.NUM_PROC_PER_NODE=2")
    config = composed.config
    images = count_images(digits_dir / "train")
    epoch = images // 2 // 64
    queue = config.LOSS.swav_loss.queue
    assert queue.queue_length == 1920 and queue.local_queue_length == 960  # 3840 x 128/256, split over 2 GPUs
    assert queue.start_iter == 15 * epoch
    assert config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP == [["module.heads.0.prototypes0.weight", epoch]]
    lr = config.OPTIMIZER.param_schedulers.lr
    assert (lr.start_value, lr.end_value) == pytest.approx((0.3, 0.0003))
    assert config.OPTIMIZER.param_schedulers.lr_head.start_value == pytest.approx(0.3)  # VISSL copies it
    assert composed.recipe[0].startswith("box batch 128 ") and f"{images} training images" in composed.recipe[0]
    assert any(line.startswith("LOSS.swav_loss.queue.queue_length=1920:") for line in composed.recipe)


def test_user_overrides_win_over_the_recipe(digits_dir: Path) -> None:
    composed = box_config(
        "swav_resnet50",
        digits_dir,
        "config.LOSS.swav_loss.queue.queue_length=512",
        "config.OPTIMIZER.param_schedulers.lr.start_value=0.05",
        "config.RECIPE.queue_start_epoch=2",
    )
    config = composed.config
    assert config.LOSS.swav_loss.queue.queue_length == 512
    assert config.LOSS.swav_loss.queue.start_iter == 2 * (count_images(digits_dir / "train") // 64)
    assert config.OPTIMIZER.param_schedulers.lr.start_value == 0.05
    assert config.OPTIMIZER.param_schedulers.lr.end_value == 0.0006  # not scaled either: the user owns the LR
    assert any("queue_length=512: your override" in line for line in composed.recipe)


def test_the_vit_recipe_scales_dino_s_peak_lr_but_not_its_floor(digits_dir: Path) -> None:
    config = box_config("swav_vit_small", digits_dir).config
    warmup, cosine = config.OPTIMIZER.param_schedulers.lr.schedulers
    assert (warmup["start_value"], warmup["end_value"]) == pytest.approx((0.0, 0.0005 * 64 / 256))
    assert (cosine["start_value"], cosine["end_value"]) == pytest.approx((0.0005 * 64 / 256, 1e-6))
    assert config.OPTIMIZER.param_schedulers.weight_decay["end_value"] == 0.4  # weight decay does not scale
    assert config.LOSS.swav_loss.queue.queue_length == 960


def test_prototypes_are_normalised_inside_the_averaging_hooks_lock_window() -> None:
    """VISSL's normalisation hook, which would run on its own before a round is applied, is out of the hook list: the
    averaging hook runs it inside its lock window, after the apply, whatever the order of the other hooks."""
    from vissl.hooks import NormalizePrototypesHook

    from hooks import AverageOnUpdateHook, swarm_hook_generator

    config, _ = compose_config("swav_tiny", [], has_gpu=False)
    hooks = swarm_hook_generator(config)
    assert not any(isinstance(hook, NormalizePrototypesHook) for hook in hooks)
    averaging = [hook for hook in hooks if isinstance(hook, AverageOnUpdateHook)]
    assert len(averaging) == 1 and isinstance(averaging[0].normalizer, NormalizePrototypesHook)


# swav_vit_small's recipe on a ViT small enough for the CPU (2 layers, 64 wide, 8px patches of 32px crops) and on
# swav_tiny's two 32px views of the digits (their small crops collapse SwAV there, see configs/swav_tiny.yaml)
SMALL_VIT = [
    "config.MODEL.TRUNK.VISION_TRANSFORMERS.IMAGE_SIZE=32",
    "config.MODEL.TRUNK.VISION_TRANSFORMERS.PATCH_SIZE=8",
    "config.MODEL.TRUNK.VISION_TRANSFORMERS.NUM_LAYERS=2",
    "config.MODEL.TRUNK.VISION_TRANSFORMERS.NUM_HEADS=2",
    "config.MODEL.TRUNK.VISION_TRANSFORMERS.HIDDEN_DIM=64",
    "config.MODEL.TRUNK.VISION_TRANSFORMERS.MLP_DIM=128",
    "config.MODEL.HEAD.PARAMS=[[swav_head,{dims:[64,128,32],use_bn:true,num_clusters:[30]}]]",
]
DIGIT_VIEWS = [
    "config.DATA.TRAIN.TRANSFORMS=[{name:ImgPilToMultiCrop,total_num_crops:2,size_crops:[32],num_crops:[2],"
    "crop_scales:[[0.5,1]]},{name:ImgPilColorDistortion,strength:0.3},{name:ToTensor},"
    "{name:Normalize,mean:[0.5,0.5,0.5],std:[0.5,0.5,0.5]}]",
    "config.DATA.NUM_DATALOADER_WORKERS=0",
    "config.DATA.TRAIN.MMAP_MODE=False",
    "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=16",
    "config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD=False",
]


def test_vit_param_groups_leave_norms_biases_and_embeddings_without_weight_decay() -> None:
    from vissl.models import build_model
    from vissl.optimizers.optimizer_helper import get_optimizer_param_groups

    config, _ = compose_config("swav_vit_small", SMALL_VIT, has_gpu=False)
    model = build_model(config.MODEL, config.OPTIMIZER)
    names = {id(param): name for name, param in model.named_parameters()}
    schedulers = {"lr": 0.1, "lr_head": 0.1, "weight_decay": 0.04, "weight_decay_head": 0.04}
    groups = get_optimizer_param_groups(model, config.MODEL, config.OPTIMIZER, schedulers)
    decayed = [names[id(p)] for group in groups if group["weight_decay"] != 0.0 for p in group["params"]]
    free = [names[id(p)] for group in groups if group["weight_decay"] == 0.0 for p in group["params"]]
    assert sorted(decayed + free) == sorted(names.values())  # each parameter in exactly one group
    # DINO's rule (biases and norms, the 1-D parameters, are not decayed) plus the ViT's two embeddings
    expected_free = {
        name for name, param in model.named_parameters() if param.ndim == 1 or name.endswith(("pos_embed", "cls_token"))
    }
    assert set(free) == expected_free and {"trunk.pos_embed", "trunk.cls_token"} <= expected_free


def test_the_vit_recipe_trains_on_the_cpu(digits_dir: Path, tmp_path: Path) -> None:
    """AdamW, the weight-decay schedule, the warm-up, clipping: the SwAV loss falls over 3 epochs (267 steps)."""
    result = run_trainer(
        "--config",
        "swav_vit_small",
        "--data_path",
        str(digits_dir),
        "--checkpoint_dir",
        str(tmp_path / "vit"),
        "--isolated",
        *SMALL_VIT,
        *DIGIT_VIEWS,
        "config.OPTIMIZER.num_epochs=3",
        "config.LOG_FREQUENCY=5",
        timeout=580,  # it took over 280 s beside three test suites and two busy processes
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[recipe] OPTIMIZER.param_schedulers.lr: x0.0625" in result.stderr  # batch 16 of DINO's 256
    losses = [entry["loss"] for entry in read_jsonl(tmp_path / "vit" / "stdout.json")]
    assert len(losses) >= 40 and all(math.isfinite(loss) for loss in losses)
    first, last = mean(losses[:10]), mean(losses[-10:])
    assert last < first - 0.2, f"the ViT's SwAV loss did not fall: {first:.3f} -> {last:.3f}"
