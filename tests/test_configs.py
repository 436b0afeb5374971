"""The shipped configs compose through VISSL's hydra composition and build a working SwAV model on CPU."""

from __future__ import annotations

import pytest
import torch

from vissl_swarm.config_loading import ConfigError, available_configs, compose_config


def test_all_three_configs_are_shipped() -> None:
    assert {"swav_tiny", "swav_resnet50", "swav_vit_small"} <= set(available_configs())


@pytest.mark.parametrize(
    ("name", "size", "trunk_dim"),
    [("swav_resnet50", 64, 2048), ("swav_vit_small", 32, 384), ("swav_tiny", 32, 64)],
)
def test_config_builds_model_and_runs_forward(name: str, size: int, trunk_dim: int) -> None:
    from vissl.models import build_model

    overrides = [f"config.MODEL.TRUNK.VISION_TRANSFORMERS.IMAGE_SIZE={size}"] if "vit" in name else []
    config, _ = compose_config(name, overrides, has_gpu=False)
    assert config.LOSS.name == "swav_loss"
    head_name, head_args = config.MODEL.HEAD.PARAMS[0]
    assert head_name == "swav_head" and head_args["dims"][0] == trunk_dim
    model = build_model(config.MODEL, config.OPTIMIZER).eval()
    with torch.no_grad():
        ((embedding, scores),) = model(torch.randn(2, 3, size, size))
    assert embedding.shape == (2, head_args["dims"][-1])
    assert scores.shape == (2, head_args["num_clusters"][0])
    assert torch.isfinite(scores).all()


def test_recipe_of_the_resnet50_config() -> None:
    """SwAV's small-batch recipe, as given for 256 images (run_trainer.py scales it: tests/test_recipe.py)."""
    config, _ = compose_config("swav_resnet50", [], has_gpu=True)
    crops = config.DATA.TRAIN.TRANSFORMS[0]
    assert crops["size_crops"] == [224, 96] and crops["num_crops"] == [2, 6]
    assert config.OPTIMIZER.use_larc and config.OPTIMIZER.name == "sgd_fsdp"
    assert config.DATA.TRAIN.BATCHSIZE_PER_REPLICA == 64
    assert config.MODEL.AMP_PARAMS.AMP_TYPE == "pytorch"
    lr = config.OPTIMIZER.param_schedulers.lr
    assert (lr.name, lr.start_value, lr.end_value) == ("cosine", 0.6, 0.0006)  # no warm-up
    assert config.RECIPE.reference_batch == 256 and config.RECIPE.scale_lr
    assert (config.RECIPE.queue_length, config.RECIPE.queue_start_epoch) == (3840, 15)
    assert config.RECIPE.freeze_prototypes_epochs == 1
    assert config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP[0][0] == "module.heads.0.prototypes0.weight"


def test_recipe_of_the_vit_config() -> None:
    """DINO's ViT optimisation around SwAV's small-batch recipe."""
    config, _ = compose_config("swav_vit_small", [], has_gpu=True)
    optimizer = config.OPTIMIZER
    assert optimizer.name == "adamw" and not optimizer.use_larc
    assert not optimizer.regularize_bn and not optimizer.regularize_bias
    assert set(optimizer.non_regularized_parameters) == {"pos_embed", "cls_token"}
    warmup, cosine = optimizer.param_schedulers.lr.schedulers
    assert warmup == {"name": "linear", "start_value": 0.0, "end_value": 0.0005}
    assert cosine == {"name": "cosine", "start_value": 0.0005, "end_value": 1e-6}
    for key in ("weight_decay", "weight_decay_head"):
        decay = optimizer.param_schedulers[key]
        assert (decay["name"], decay["start_value"], decay["end_value"]) == ("cosine", 0.04, 0.4)
    assert config.MODEL.GRAD_CLIP.USE_GRAD_CLIP and config.MODEL.GRAD_CLIP.MAX_NORM == 3.0
    assert config.RECIPE.scale_lr and not config.RECIPE.scale_final_lr
    assert (config.RECIPE.queue_length, config.RECIPE.queue_start_epoch) == (3840, 15)


def test_unknown_key_in_override_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="config.NO_SUCH_SECTION"):
        compose_config("swav_tiny", ["config.NO_SUCH_SECTION.key=1"], has_gpu=False)
