"""The averager's lock window of each step, and what must happen inside it: the optimizer step, the apply of finished
rounds, the prototypes' normalisation and the broadcast to the box's other GPUs."""

from __future__ import annotations

import threading
import time

from vissl.hooks import NormalizePrototypesHook

from decentralized_task import torch_optimizer
from hooks.quiet_hook import QuietHook
from vissl_swarm import local_replicas
from vissl_swarm.averaging_protocol import Averaging


class AverageOnUpdateHook(QuietHook):
    """Holds ``task.decentralized_sgd.lock`` from the end of backward until the update is complete, and calls
    ``on_step_end`` (where finished rounds are applied) inside that hold.

    Why one hook: averaging copies the parameters and late joiners download them from other threads, and must never
    get half an update: not the optimizer step without its apply, and not an averaged prototype matrix before it is
    put back on the unit sphere (an average of unit vectors is not one). So the window covers, in this order, the
    optimizer step (VISSL's, between ``on_backward`` and ``on_update``), ``on_step_end``, VISSL's own
    normalisation of the prototypes (``normalizer``: VISSL's hook, taken out of the hook list and run here, after
    the apply; None when the config does not normalise), and on a box with several GPUs the broadcast of local rank
    0's parameters to the other local ranks when anything changed them (``local_replicas``). Whatever the order of
    the other hooks, nothing else sees the parameters in between. An SSP wait inside ``on_step_end`` releases the
    lock while it sleeps (DecentralizedSGD waits on a Condition of it).

    The old design (``baselines.old_design``) applies rounds from its own thread at any time, so there the lock is
    held from the end of one step through the next forward, backward and update (an in-place apply between forward
    and backward would break autograd), released only between steps, and the prototypes are normalised again when
    the lock is taken back (its apply may have moved them).

    A task that does not average (``--isolated``: VISSL's own task) still gets the normalisation, without a lock.
    """

    def __init__(self, normalizer: NormalizePrototypesHook | None = None) -> None:
        super().__init__()
        self.normalizer = normalizer
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

    def _normalize(self, task) -> None:
        if self.normalizer is not None:
            self.normalizer.on_update(task)

    def on_start(self, task) -> None:
        if self._holds_through_forward(task):
            self._acquire(task)

    def on_backward(self, task) -> None:
        self._acquire(task)

    def on_update(self, task) -> None:
        try:
            changed = self._apply(task)
            self._normalize(task)
            if changed is not None and local_replicas.is_box() and local_replicas.broadcast_flag(changed > 0):
                averaged_optimizer = task.swarm_settings.average_optimizer_state
                local_replicas.sync_replicas(task.base_model, torch_optimizer(task) if averaged_optimizer else None)
        finally:
            self._release()
        if self._holds_through_forward(task):
            time.sleep(0.001)  # let a waiting averaging thread take the lock between steps

    def _apply(self, task) -> int | None:
        """Rounds (or a heal) that changed the parameters in this step; None for a task that does not average."""
        if not task.train or not hasattr(task, "decentralized_sgd"):
            return None
        averager = self._averager(task)  # a box's other local ranks: None, they take rank 0's broadcast
        return averager.on_step_end(batch_size=task.get_global_batchsize()) if averager is not None else 0

    def on_step(self, task) -> None:
        if self._holds_through_forward(task):
            self._acquire(task)
            self._normalize(task)

    def on_end(self, task) -> None:
        self._release()

    on_exception = on_end
