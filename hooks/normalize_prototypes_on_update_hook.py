"""After each optimizer step and averaging round: put SwAV's prototypes back on the unit sphere."""

from __future__ import annotations

import contextlib

import torch
from vissl.hooks import NormalizePrototypesHook


def params_lock(task) -> contextlib.AbstractContextManager:
    """The averager's lock (held whenever parameters change), or nothing for a task that does not average."""
    lock = getattr(getattr(task, "decentralized_sgd", None), "lock", None)
    return lock if lock is not None else contextlib.nullcontext()


def prototypes_norm_error(task) -> float | None:
    """max |‖row‖ − 1| over the prototypes of a SwAV head that normalises them; None for other models."""
    if task.config["LOSS"]["name"] != "swav_loss" or not task.config.LOSS["swav_loss"].normalize_last_layer:
        return None
    head = task.base_model.heads[0]
    with torch.no_grad():
        errors = [getattr(head, f"prototypes{j}").weight.float().norm(dim=1).sub(1).abs().max()
                  for j in range(head.nmb_heads)]
    return float(max(errors)) if errors else None


class NormalizePrototypesOnUpdateHook(NormalizePrototypesHook):
    """VISSL's normalisation of the prototypes, run *after* AverageOnUpdateHook and under the averager's lock.

    VISSL normalises right after the optimizer step; an averaging round applied in the same step (``w += average −
    snapshot``, an average of unit vectors) would then leave them off the unit sphere for the next forward. This
    hook replaces VISSL's instance in the hook list and comes after the averaging hook, so the next forward and
    the checkpoints see unit prototypes. On a box with several GPUs every rank runs it on the weights rank 0
    broadcast, so the replicas stay identical.

    The lock is released between the apply and this normalisation (HoldParamsDuringUpdateHook lets go before
    AverageOnUpdateHook, whose SSP wait needs the averager's thread to take the lock), so a round whose group
    formed in this very step may copy the prototypes in that gap, off the sphere by the applied round's tiny
    deviation; closing it would need a callback of DecentralizedSGD right after its apply.

    The old design (``baseline_averaging``) applies rounds from its own thread between two steps; for it the
    prototypes are normalised again in ``on_step``, after HoldParamsDuringUpdateHook has taken the lock back and
    before the next forward.
    """

    def on_update(self, task) -> None:
        with params_lock(task):
            super().on_update(task)

    def on_step(self, task) -> None:
        if getattr(getattr(task, "decentralized_sgd", None), "needs_lock_for_forward", False):
            with params_lock(task):
                super().on_update(task)
