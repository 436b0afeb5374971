"""The training recipe of a config, turned into the numbers VISSL needs for this box and this dataset.

A config states its recipe in the units its source uses (``config.RECIPE``): values for a reference batch
(SwAV's and DINO's recipes are given for 256 images) and lengths in epochs. VISSL wants iterations, and a queue
length that is a multiple of the batch, which depend on the box (``BATCHSIZE_PER_REPLICA x NUM_PROC_PER_NODE``)
and on the number of training images. :func:`apply_recipe` sets them on the composed config, before VISSL's own
inference (which then splits the queue over the box's GPUs), and returns one line per value it set.

``config.RECIPE`` keys (each optional; absent: the config's own VISSL values stay):

- ``reference_batch``: the batch the values below are given for.
- ``scale_lr``: scale every value of ``OPTIMIZER.param_schedulers.lr`` linearly with the box's batch (Goyal et
  al.'s rule, as SwAV and DINO do). VISSL's ``auto_lr_scaling`` cannot do it for a warm-up on one node: it
  starts the warm-up at the scaled LR and then drops it (``vissl/utils/hydra_config.resolve_linear_schedule``).
- ``scale_final_lr`` (default True): False keeps the schedule's last value as given (DINO's ``min_lr`` is not
  scaled; SwAV's ``final_lr`` is, it stays base/1000).
- ``queue_length``: SwAV's feature queue at the reference batch; scaled with the box's batch, rounded down to a
  multiple of it (VISSL's swav loss needs that); 0: no queue.
- ``queue_start_epoch``: the epoch from which the queue is used (``LOSS.swav_loss.queue.start_iter``).
- ``freeze_prototypes_epochs``: epochs during which the prototypes stay frozen (the prototypes' entry of
  ``MODEL.TEMP_FROZEN_PARAMS_ITER_MAP``), whatever the number of GPUs per box.

A value the user overrides on the command line (the VISSL key itself) wins and is only reported.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the LR values each kind of VISSL param scheduler uses (vissl/utils/hydra_config.get_scaled_lr_scheduler)
LR_VALUE_KEYS = {
    "cosine": ("start_value", "end_value"),
    "linear": ("start_value", "end_value"),
    "constant": ("value",),
    "multistep": ("values",),
    "step": ("values",),
    "step_with_fixed_gamma": ("base_value",),
}
QUEUE = "LOSS.swav_loss.queue"
FROZEN = "MODEL.TEMP_FROZEN_PARAMS_ITER_MAP"
LR = "OPTIMIZER.param_schedulers.lr"


class RecipeError(ValueError):
    """A recipe that cannot be applied to this box or dataset; the message says what to change."""


def count_images(folder: Path) -> int:
    """Images in an ImageFolder (``folder/<class>/<image>``), with the extensions torchvision's ImageFolder reads
    (VISSL's ``disk_folder`` source is one): what one epoch goes through."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    if not folder.is_dir():
        raise RecipeError(f"cannot count the training images: {folder} is not a folder (pass --data_path)")
    total = 0
    with os.scandir(folder) as classes:
        for entry in classes:
            if entry.is_dir():
                with os.scandir(entry.path) as files:
                    total += sum(1 for file in files if file.name.lower().endswith(IMG_EXTENSIONS))
    return total


def training_images(config: Any) -> int:
    """Images per epoch of the training split: the ImageFolder's, or ``DATA_LIMIT`` if that is smaller."""
    train = config.DATA.TRAIN
    if list(train.DATA_SOURCES) != ["disk_folder"]:
        raise RecipeError(
            f"the recipe counts images of a disk_folder source, not of {list(train.DATA_SOURCES)}: "
            "set the RECIPE epoch keys to null and give VISSL's iteration counts instead"
        )
    images = count_images(Path(train.DATA_PATHS[0]))
    return min(images, train.DATA_LIMIT) if train.DATA_LIMIT >= 0 else images


def _overridden(overrides: list[str], key: str) -> str | None:
    """The user's value for ``config.<key>`` (or for a key below it), if given on the command line."""
    for override in overrides:
        name, _, value = override.lstrip("+").partition("=")
        if name == f"config.{key}" or name.startswith(f"config.{key}."):
            return value
    return None


def _select(config: Any, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def _scale_schedule(schedule: Any, factor: float) -> list[str]:
    """Multiply the LR values a VISSL param scheduler uses (composite ones recursively) in place; describe them.
    Only the keys of the scheduler's kind: VISSL's defaults give every scheduler all keys."""
    name = schedule.name
    if name == "composite":
        return [part for scheduler in schedule.schedulers for part in _scale_schedule(scheduler, factor)]
    if name not in LR_VALUE_KEYS:
        raise RecipeError(f"RECIPE.scale_lr cannot scale a {name!r} LR schedule (known: {sorted(LR_VALUE_KEYS)})")
    keys = LR_VALUE_KEYS[name]
    for key in keys:
        value = schedule[key]
        schedule[key] = [float(v) * factor for v in value] if key == "values" else float(value) * factor
    return [f"{name} " + " -> ".join(f"{schedule[key]}" if key == "values" else f"{schedule[key]:.6g}" for key in keys)]


class _Recipe:
    """One config's recipe applied to one box: each method sets one group of VISSL values and says what it set."""

    def __init__(self, config: Any, overrides: list[str], images: Callable[[], int]) -> None:
        self.config, self.overrides, self.recipe = config, overrides, config.RECIPE
        self.reference = int(self.recipe.get("reference_batch", 256))
        self.gpus = config.DISTRIBUTED.NUM_PROC_PER_NODE * config.DISTRIBUTED.NUM_NODES
        self.batch = int(config.DATA.TRAIN.BATCHSIZE_PER_REPLICA) * self.gpus
        self._images, self._iterations = images, None
        self.lines: list[str] = []

    @property
    def iterations_per_epoch(self) -> int:
        """As VISSL's stateful sampler splits an epoch: each GPU its share of the images, in full batches."""
        if self._iterations is None:
            images = self._images()
            self._iterations = images // self.gpus // int(self.config.DATA.TRAIN.BATCHSIZE_PER_REPLICA)
            if self._iterations < 1:
                raise RecipeError(
                    f"{images} training images make no full batch of {self.batch} on this box: "
                    "use a larger dataset or a smaller BATCHSIZE_PER_REPLICA"
                )
            self.lines.insert(
                0,
                f"box batch {self.batch} (BATCHSIZE_PER_REPLICA x NUM_PROC_PER_NODE); {images} "
                f"training images: {self._iterations} iterations per epoch",
            )
        return self._iterations

    def _set(self, key: str, value: Any, why: str) -> None:
        """Set ``key`` unless the user overrode it; either way, one line."""
        user = _overridden(self.overrides, key)
        if user is not None:
            self.lines.append(f"{key}={user}: your override (the recipe's value: {value}, {why})")
            return
        parent, _, name = key.rpartition(".")
        _select(self.config, parent)[name] = value
        self.lines.append(f"{key}={value}: {why}")

    def scale_lr(self) -> None:
        if not self.recipe.get("scale_lr", False):
            return
        schedule = _select(self.config, LR)
        if schedule.get("auto_lr_scaling", {}).get("auto_scale", False):
            raise RecipeError(f"RECIPE.scale_lr and VISSL's {LR}.auto_lr_scaling both scale the LR: turn one off")
        if _overridden(self.overrides, LR) is not None:
            self.lines.append(f"{LR}: your overrides, not scaled (the recipe's values are for batch {self.reference})")
            return
        factor = self.batch / self.reference
        last = schedule.schedulers[-1] if schedule.name == "composite" else schedule
        final = last.get("end_value")
        described = _scale_schedule(schedule, factor)
        if not self.recipe.get("scale_final_lr", True) and final is not None:
            last.end_value = float(final)
            described[-1] = f"{last.name} {last.start_value:.6g} -> {last.end_value:.6g} (final LR not scaled)"
        self.lines.append(
            f"{LR}: x{factor:g} (given for batch {self.reference}, this box's is {self.batch}): " + ", ".join(described)
        )

    def queue(self) -> None:
        if self.recipe.get("queue_length") is not None:
            reference_length = int(self.recipe.queue_length)
            batches = round(reference_length * self.batch / self.reference) // self.batch
            length = max(batches, 1 if reference_length > 0 else 0) * self.batch
            why = (
                (
                    f"{reference_length} features at batch {self.reference}, scaled to this box's batch {self.batch} "
                    "(a multiple of it)"
                )
                if length
                else "no queue"
            )
            self._set(f"{QUEUE}.queue_length", length, why)
        if self.recipe.get("queue_start_epoch") is not None:
            epochs = self.recipe.queue_start_epoch
            if _select(self.config, QUEUE).queue_length > 0:
                self._set(f"{QUEUE}.start_iter", int(epochs * self.iterations_per_epoch), f"epoch {epochs}")

    def freeze_prototypes(self) -> None:
        epochs = self.recipe.get("freeze_prototypes_epochs")
        if epochs is None:
            return
        iterations = int(epochs * self.iterations_per_epoch)
        why = f"prototypes frozen for {epochs} epoch(s) whatever the GPUs per box"
        if _overridden(self.overrides, FROZEN) is not None:
            self.lines.append(f"{FROZEN}: your override (the recipe's: {iterations} iterations, {why})")
            return
        entries = [entry for entry in self.config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP if "prototypes" in entry[0]]
        if not entries:
            raise RecipeError(f"RECIPE.freeze_prototypes_epochs is set but {FROZEN} has no prototypes entry")
        for entry in entries:
            entry[1] = iterations
            self.lines.append(f"{FROZEN}: {entry[0]} for {iterations} iterations ({why})")


def apply_recipe(config: Any, overrides: list[str], images: Callable[[], int] | None = None) -> list[str]:
    """Set the box- and dataset-dependent values of ``config.RECIPE`` on a composed (not yet VISSL-inferred)
    config; returns one line per value. ``images`` counts the training images (default: the ImageFolder's,
    counted once and only if a value needs it)."""
    if not config.get("RECIPE"):
        return []
    recipe = _Recipe(config, overrides, images or (lambda: training_images(config)))
    recipe.scale_lr()
    recipe.queue()
    recipe.freeze_prototypes()
    return recipe.lines


# the overrides that decide a swarm's schedule: its budget (epochs, data), LR, warm-up, freezing, queue, loss. A box's
# batch is not one: each box trains at its own (the budget counts samples, and the recipe scales its LR to its batch)
SCHEDULE_KEYS = (
    "config.OPTIMIZER.",
    "config.LOSS.",
    "config.RECIPE.",
    "config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP",
    "config.DATA.TRAIN.DATA_LIMIT",
)
SCHEDULE_FLAGS = {"--schedule": "swarm", "--swarm_lr": "sqrt"}  # and their defaults


def swarm_recipe(overrides: list[str], flags: dict[str, str]) -> dict[str, str]:
    """What every box of a swarm must run alike: the overrides of :data:`SCHEDULE_KEYS` (``key: value``) and the
    flags of :data:`SCHEDULE_FLAGS`."""
    recipe = {name: value for name, value in flags.items() if name in SCHEDULE_FLAGS}
    for override in overrides:
        name, _, value = override.lstrip("+").partition("=")
        if name.startswith(SCHEDULE_KEYS):
            recipe[name] = value
    return recipe


def recipe_hash(recipe: dict[str, str]) -> str:
    """8 hex digits that name a recipe: boxes of different recipes average under different names (never together)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]


def recipe_words(recipe: dict[str, str]) -> list[str]:
    """The recipe as command-line words (flags at their default left out)."""
    words = []
    for name, value in sorted(recipe.items()):
        if not name.startswith("--"):
            words.append(f"{name}={value}")
        elif value != SCHEDULE_FLAGS.get(name):
            words += [name, value]
    return words


def recipe_fixes(ours: dict[str, str], swarm: dict[str, str]) -> list[str]:
    """What this box must change to train the swarm's recipe: one item per differing key, with the value to pass."""
    fixes = []
    for name in sorted(set(ours) | set(swarm)):
        if ours.get(name) == swarm.get(name):
            continue
        if name not in swarm:
            fixes.append(f"drop {name}={ours[name]} (the swarm runs the config's value)")
        else:
            word = f"{name} {swarm[name]}" if name.startswith("--") else f"{name}={swarm[name]}"
            fixes.append(f"pass {word}" + (f" (this box has {ours[name]})" if name in ours else ""))
    return fixes
