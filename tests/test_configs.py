"""The shipped configs compose through VISSL's hydra composition and build a working SwAV model on CPU."""

from __future__ import annotations

import pytest
import torch

from config_loading import ConfigError, available_configs, compose_config


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
        (embedding, scores), = model(torch.randn(2, 3, size, size))
    assert embedding.shape == (2, head_args["dims"][-1])
    assert scores.shape == (2, head_args["num_clusters"][0])
    assert torch.isfinite(scores).all()


def test_recipe_of_the_resnet50_config() -> None:
    config, _ = compose_config("swav_resnet50", [], has_gpu=True)
    crops = config.DATA.TRAIN.TRANSFORMS[0]
    assert crops["size_crops"] == [224, 96] and crops["num_crops"] == [2, 6]
    assert config.OPTIMIZER.use_larc and config.OPTIMIZER.name == "sgd_fsdp"
    assert config.DATA.TRAIN.BATCHSIZE_PER_REPLICA == 64
    assert config.MODEL.AMP_PARAMS.AMP_TYPE == "pytorch"
    assert [s["name"] for s in config.OPTIMIZER.param_schedulers.lr.schedulers] == ["linear", "cosine"]
    assert config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP[0][0] == "module.heads.0.prototypes0.weight"


def test_unknown_key_in_override_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="config.NO_SUCH_SECTION"):
        compose_config("swav_tiny", ["config.NO_SUCH_SECTION.key=1"], has_gpu=False)
