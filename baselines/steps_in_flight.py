"""The averaging steps running in a hivemind averager's process, for the baselines' shutdown."""

from __future__ import annotations

from typing import Any

from hivemind.averaging.control import StepControl


class KeepsStepsInFlight:
    """Mixin for hivemind's own averagers, put before the hivemind class: the StepControls of the steps running in
    the averager's process (``_steps``), which ``averager_shutdown.shut_down_averager`` cancels first when it
    leaves: the trainer has no handle on them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._steps: set[StepControl] = set()
        super().__init__(*args, **kwargs)

    async def _step(self, *, step: StepControl, **kwargs: Any) -> None:
        self._steps.add(step)
        try:
            await super()._step(step=step, **kwargs)
        finally:
            self._steps.discard(step)
