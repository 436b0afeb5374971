"""Hold the averager's lock while VISSL changes the parameters, so that averaging never sees half an update."""

from __future__ import annotations

import threading
import time

from classy_vision.hooks import ClassyHook

from averaging_protocol import Averaging


class HoldParamsDuringUpdateHook(ClassyHook):
    """Holds ``task.decentralized_sgd.lock`` from the end of backward until the optimizer step is done: a late
    joiner downloads our parameters from hivemind's thread while we train, and must never get half an update.

    The old design (``baseline_averaging``) applies rounds from its own thread at any time, so there the lock is
    held from the end of one step through the next forward, backward and update (an in-place apply between
    forward and backward would break autograd), and released only between steps.
    """

    on_phase_start = ClassyHook._noop
    on_forward = ClassyHook._noop
    on_loss_and_meter = ClassyHook._noop
    on_phase_end = ClassyHook._noop

    def __init__(self) -> None:
        super().__init__()
        self._held: threading.RLock | None = None

    @staticmethod
    def _averager(task) -> Averaging | None:
        return getattr(task, "decentralized_sgd", None)  # None: not averaging (--isolated, or a non-zero local rank)

    def _acquire(self, task) -> None:
        averager = self._averager(task)
        if averager is not None and self._held is None:
            averager.lock.acquire()
            self._held = averager.lock

    def _release(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None

    def _holds_through_forward(self, task) -> bool:
        averager = self._averager(task)
        return averager is not None and averager.needs_lock_for_forward

    def on_start(self, task) -> None:
        if self._holds_through_forward(task):
            self._acquire(task)

    def on_backward(self, task) -> None:
        self._acquire(task)

    def on_update(self, task) -> None:
        self._release()
        if self._holds_through_forward(task):
            time.sleep(0.001)  # let a waiting averaging thread take the lock between steps

    def on_step(self, task) -> None:
        if self._holds_through_forward(task):
            self._acquire(task)

    def on_end(self, task) -> None:
        self._release()

    on_exception = on_end
