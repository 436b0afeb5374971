"""After each optimizer step: let DecentralizedSGD apply, trigger and schedule averaging rounds."""

from __future__ import annotations

import torch
import torch.distributed as dist
from classy_vision.hooks import ClassyHook


class AverageOnUpdateHook(ClassyHook):
    """Calls ``DecentralizedSGD.on_step_end`` at the step boundary (where the delta rule may touch the weights).

    On a box with several GPUs only local rank 0 is in the swarm; when it applied a round, it broadcasts its
    parameters and buffers to the other local ranks in the same step, so the replicas never diverge.
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
        applied = 0
        if optimizer is not None:
            before = optimizer.counters["rounds_applied"]
            optimizer.on_step_end(batch_size=task.get_batchsize_per_replica())
            applied = int(optimizer.counters["rounds_applied"] > before)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._broadcast_if_applied(task, applied)

    @staticmethod
    def _broadcast_if_applied(task, applied: int) -> None:
        flag = torch.tensor([applied], dtype=torch.int64)
        dist.broadcast(flag, src=0)
        if flag.item():
            with torch.no_grad():
                for tensor in [*task.base_model.parameters(), *task.base_model.buffers()]:
                    dist.broadcast(tensor.data, src=0)
