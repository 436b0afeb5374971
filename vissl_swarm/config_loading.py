"""Turn ``--config NAME`` plus ``config.X=Y`` overrides into a VISSL config, failing early with clear messages.

Our YAML files live in ``configs/`` (not inside VISSL's package), so each is registered in hydra's ConfigStore
under VISSL's ``config`` group and then composed by VISSL's own ``compose_hydra_configuration``: the result
is exactly what ``tools/run_distributed_engines.py config=...`` would build.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vissl_swarm import vissl_compat
from vissl_swarm.recipe import RecipeError, apply_recipe

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
_OVERRIDE_PATTERN = re.compile(r"^\+?config(\.[A-Za-z_][A-Za-z0-9_]*)+=.*$", re.DOTALL)


class ConfigError(ValueError):
    """Bad user input about configs; the message says what to do."""


def available_configs() -> list[str]:
    return sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))


def config_path(name: str) -> Path:
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"unknown config {name!r}: there is no {path}. Available configs: {', '.join(available_configs())}"
        )
    return path


def check_overrides(overrides: list[str]) -> None:
    for override in overrides:
        if not _OVERRIDE_PATTERN.match(override):
            raise ConfigError(
                f"malformed override {override!r}: VISSL overrides look like config.SECTION.KEY=VALUE, "
                "e.g. config.OPTIMIZER.num_epochs=10 or config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=32"
            )


@dataclass
class TrainerConfig:
    """What ``run_trainer.py`` trains with, and the lines it prints about how it got there."""

    config: Any  # VISSL's AttrDict
    compat_changes: list[str] = field(default_factory=list)  # vissl_compat.adapt_config
    recipe: list[str] = field(default_factory=list)  # recipe.apply_recipe: values set for this box and dataset


def compose_config(name: str, overrides: list[str], has_gpu: bool, dump_config: bool = False) -> tuple[Any, list[str]]:
    """Return (VISSL AttrDict config, list of compat changes made to it); ``dump_config`` writes
    ``train_config.yaml`` into the checkpoint folder as VISSL's own launcher does."""
    composed = _compose(name, overrides, has_gpu, dump_config, scale_recipe=False)
    return composed.config, composed.compat_changes


def compose_trainer_config(name: str, overrides: list[str], has_gpu: bool) -> TrainerConfig:
    """The config a peer trains with: composed, adapted to this stack, its recipe scaled to this box and dataset
    (``vissl_swarm/recipe.py``), then completed by VISSL's own inference. Nothing is written yet: the trainer dumps
    ``train_config.yaml`` once the box has joined (a box that cannot join leaves no file behind)."""
    return _compose(name, overrides, has_gpu, dump_config=False, scale_recipe=True)


def _compose(name: str, overrides: list[str], has_gpu: bool, dump_config: bool, scale_recipe: bool) -> TrainerConfig:
    vissl_compat.apply()
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from vissl.utils.hydra_config import compose_hydra_configuration, convert_to_attrdict

    check_overrides(overrides)
    node = OmegaConf.load(config_path(name))
    ConfigStore.instance().store(group="config", name=name, node=node, package="_global_")
    try:
        composed = compose_hydra_configuration([f"config={name}", *overrides])
    except (HydraException, OmegaConfBaseException) as error:
        message = str(error).splitlines()[0]
        raise ConfigError(
            f"cannot apply the overrides {overrides} to config {name!r}: {message}. "
            f"Check the key names against configs/{name}.yaml and VISSL's defaults.yaml; "
            "a key that is not there yet needs a leading '+'."
        ) from error
    result = TrainerConfig(config=None, compat_changes=vissl_compat.adapt_config(composed.config, has_gpu=has_gpu))
    if scale_recipe:
        try:
            result.recipe = apply_recipe(composed.config, overrides)
        except RecipeError as error:
            raise ConfigError(f"config {name!r}: {error}") from error
    _, result.config = convert_to_attrdict(composed, dump_config=dump_config)  # also VISSL's inference and checks
    return result
