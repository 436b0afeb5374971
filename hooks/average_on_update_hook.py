"""After each optimizer step: let DecentralizedSGD apply, trigger and schedule averaging rounds."""

from __future__ import annotations

from classy_vision.hooks import ClassyHook

import local_replicas
from decentralized_task import torch_optimizer


class AverageOnUpdateHook(ClassyHook):
    """Calls ``DecentralizedSGD.on_step_end`` at the step boundary (where the delta rule may touch the weights).

    On a box with several GPUs only local rank 0 is in the swarm; when it applied a round (or healed), it broadcasts its
    parameters and buffers (and the optimizer state, when that is averaged too) to the other local ranks in the
    same step, so the replicas never diverge (``local_replicas``: on the device the box's backend serves).
    """

    on_start = ClassyHook._noop
    on_phase_start = ClassyHook._noop
    on_forward = ClassyHook._noop
    on_loss_and_meter = ClassyHook._noop
    on_backward = ClassyHook._noop
    on_step = ClassyHook._noop
    on_phase_end = ClassyHook._noop
    on_end = ClassyHook._noop

    def on_update(self, task) -> None:
        if not task.train or not hasattr(task, "decentralized_sgd"):
            return
        optimizer = task.decentralized_sgd
        applied = False
        if optimizer is not None:  # a round applied, or the swarm's state taken by a peer that diverged (a heal)
            before = optimizer.counters["rounds_applied"] + optimizer.counters.get("outlier_heals", 0)
            optimizer.on_step_end(batch_size=task.get_global_batchsize())  # the box's: its weight in a round
            applied = optimizer.counters["rounds_applied"] + optimizer.counters.get("outlier_heals", 0) > before
        if local_replicas.is_box() and local_replicas.broadcast_flag(applied):
            averaged_optimizer = task.swarm_settings.average_optimizer_state
            local_replicas.sync_replicas(task.base_model, torch_optimizer(task) if averaged_optimizer else None)
