"""Leave the swarm cleanly when training ends or fails."""

from __future__ import annotations

from hooks.quiet_hook import QuietHook


class LeaveSwarmOnEndHook(QuietHook):
    """Shuts the averager and the DHT down on ``on_end`` and ``on_exception`` so that groupmates are not left
    waiting for our chunks (run_trainer.py does the same on Ctrl-C, which VISSL's hooks never see)."""

    def on_end(self, task) -> None:
        if hasattr(task, "shutdown_averaging"):
            task.shutdown_averaging()

    def on_exception(self, task) -> None:
        self.on_end(task)
