"""Ctrl-C stops a peer at its next step boundary, not wherever the interpreter happens to be.

Why: Python raises KeyboardInterrupt in whatever the main thread runs at that moment. Inside a destructor (hivemind's
``StepControl.__del__``, run by the garbage collector) it is swallowed ("Exception ignored in ...": the peer trains
on as if nothing was pressed); inside hivemind or VISSL internals it leaves a traceback and half-done work. So the
first Ctrl-C of a training run only asks to stop, and the step hook (``hooks/stop_on_step_hook.py``) raises the
KeyboardInterrupt at the end of the step, where VISSL's launcher wraps up and ``run_trainer.py`` leaves the swarm.
Before training starts, and for a second Ctrl-C, it is raised at once as usual. Main thread only (signals are).
"""

from __future__ import annotations

import signal
import sys
from types import FrameType


class StopAtStepBoundary:
    """The SIGINT handler of ``run_trainer.py``'s process; ``training`` is set by the step hook's ``on_start``."""

    def __init__(self) -> None:
        self.training = False  # True between the training loop's start and its end
        self.requested = False  # Ctrl-C was pressed during training: stop at the next step boundary

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if not self.training or self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "Ctrl-C: this peer stops after the current step and leaves the swarm (Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def stop_if_requested(self) -> None:
        """At a step boundary (the step hook)."""
        if self.requested:
            raise KeyboardInterrupt


ctrl_c = StopAtStepBoundary()  # the one of this process
