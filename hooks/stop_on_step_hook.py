"""Stop at the end of a step when Ctrl-C was pressed during it (see ``ctrl_c``)."""

from __future__ import annotations

import logging

from classy_vision.hooks import ClassyHook

from vissl_swarm.ctrl_c import ctrl_c, stopped_by_ctrl_c


class StopOnStepHook(ClassyHook):
    """Raises the deferred KeyboardInterrupt in ``on_step``, after the step's averaging and progress hooks ran."""

    on_phase_start = ClassyHook._noop
    on_forward = ClassyHook._noop
    on_loss_and_meter = ClassyHook._noop
    on_backward = ClassyHook._noop
    on_update = ClassyHook._noop
    on_phase_end = ClassyHook._noop

    def on_start(self, task) -> None:
        ctrl_c.training = True
        logging.root.addFilter(stopped_by_ctrl_c)  # VISSL's logger by now (its setup_logging replaces logging.root)

    def on_step(self, task) -> None:
        ctrl_c.stop_if_requested()

    def on_end(self, task) -> None:
        ctrl_c.training = False

    on_exception = on_end
