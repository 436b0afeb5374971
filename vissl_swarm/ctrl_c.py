"""Ctrl-C stops a peer at its next step boundary, not wherever the interpreter happens to be.

Why: Python raises KeyboardInterrupt in whatever the main thread runs at that moment. Inside a destructor (hivemind's
``StepControl.__del__``, run by the garbage collector) it is swallowed ("Exception ignored in ...": the peer trains
on as if nothing was pressed); inside hivemind or VISSL internals it leaves a traceback and half-done work. So the
first Ctrl-C of a training run only asks to stop, and the step hook (``hooks/stop_on_step_hook.py``) raises the
KeyboardInterrupt at the end of the step, where VISSL's launcher wraps up and ``run_trainer.py`` leaves the swarm.
Before training starts, and for a second Ctrl-C, it is raised at once as usual. Main thread only (signals are).
"""

from __future__ import annotations

import asyncio
import functools
import logging
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
        if not getattr(asyncio.create_subprocess_exec, "own_session", False):
            asyncio.create_subprocess_exec = asyncio.subprocess.create_subprocess_exec = _own_session(
                asyncio.create_subprocess_exec
            )

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


def stopped_by_ctrl_c(record: logging.LogRecord) -> bool:
    """A filter for VISSL's logger (``logging.root`` once VISSL set up its logging; the step hook adds it): VISSL's
    launcher logs the KeyboardInterrupt that ends a Ctrl-C'd run as an ERROR ("Wrapping up, caught exception",
    ``vissl/utils/distributed_launcher.py``, ``launch_distributed``); it is the stop the user asked for, so it
    becomes one INFO line."""
    if str(record.msg).startswith("Wrapping up, caught exception") and isinstance(
        (record.args or (None,))[0], KeyboardInterrupt
    ):
        record.levelno, record.levelname, record.msg, record.args = logging.INFO, "INFO", "Stopped by Ctrl-C", ()
    return True


def _own_session(create_subprocess_exec):
    """hivemind starts ``p2pd`` in our process group (``hivemind/p2p/p2p_daemon.py``, ``P2P.create``), so a terminal's
    Ctrl-C, sent to the whole group, ends it at once, under the DHT that still uses it (an ERROR per DHT call, then a
    WARN that the DHT did not shut down in time). In a session of its own it ends when the DHT shuts it down (and with
    its parent: ``hivemind_fixes.end_with_parent``). Upstream: none found; the PR: "start p2pd in a session of its
    own"."""

    @functools.wraps(create_subprocess_exec)
    async def in_own_session(program, *args, **kwargs):
        if str(program).endswith("p2pd"):
            kwargs.setdefault("start_new_session", True)
        return await create_subprocess_exec(program, *args, **kwargs)

    in_own_session.own_session = True
    return in_own_session
