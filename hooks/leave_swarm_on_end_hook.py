"""Leave the swarm cleanly when training ends or fails."""

from __future__ import annotations

from classy_vision.hooks import ClassyHook


class LeaveSwarmOnEndHook(ClassyHook):
    """Shuts the averager and the DHT down on ``on_end`` and ``on_exception`` so that groupmates are not left
    waiting for our chunks (run_trainer.py does the same on Ctrl-C, which VISSL's hooks never see)."""

    on_start = ClassyHook._noop
    on_phase_start = ClassyHook._noop
    on_forward = ClassyHook._noop
    on_loss_and_meter = ClassyHook._noop
    on_backward = ClassyHook._noop
    on_update = ClassyHook._noop
    on_step = ClassyHook._noop
    on_phase_end = ClassyHook._noop

    def on_end(self, task) -> None:
        if hasattr(task, "shutdown_averaging"):
            task.shutdown_averaging()

    def on_exception(self, task) -> None:
        self.on_end(task)
