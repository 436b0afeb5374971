"""Stop at the end of a step when Ctrl-C was pressed during it (see ``ctrl_c``)."""

from __future__ import annotations

import logging

from hooks.quiet_hook import QuietHook
from vissl_swarm.ctrl_c import ctrl_c, stopped_by_ctrl_c


class StopOnStepHook(QuietHook):
    """Raises the deferred KeyboardInterrupt in ``on_step``, after the step's averaging and progress hooks ran."""

    def on_start(self, task) -> None:
        ctrl_c.training = True
        logging.root.addFilter(stopped_by_ctrl_c)  # VISSL's logger by now (its setup_logging replaces logging.root)

    def on_step(self, task) -> None:
        ctrl_c.stop_if_requested()

    def on_end(self, task) -> None:
        ctrl_c.training = False

    on_exception = on_end
