"""Before each optimizer step: keep SwAV's prototypes frozen while the *swarm* is early in the run."""

from __future__ import annotations

from typing import Any

from vissl.hooks import FreezeParametersHook


class _AtScheduleIteration:
    """The task as VISSL's freezing hook reads it, with ``iteration`` the swarm's position in this box's
    iterations (``task.schedule_iteration()``); every other attribute is the task's."""

    def __init__(self, task: Any) -> None:
        object.__setattr__(self, "_task", task)

    @property
    def iteration(self) -> int:
        return self._task.schedule_iteration()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


class FreezeParametersOnSwarmScheduleHook(FreezeParametersHook):
    """VISSL's ``FreezeParametersHook`` (``MODEL.TEMP_FROZEN_PARAMS_ITER_MAP``: the prototypes stay frozen for the
    first iterations), counting the swarm's iterations: with the swarm-wide schedule a joiner does not freeze its
    prototypes again while the swarm is past that point, and three boxes do not each freeze them for the whole
    span. It replaces VISSL's instance in the hook list; for a task without a swarm schedule it is VISSL's."""

    def on_backward(self, task: Any) -> None:
        super().on_backward(_AtScheduleIteration(task) if hasattr(task, "schedule_iteration") else task)
