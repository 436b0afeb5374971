"""End a pre-flight (``run_trainer.py --preflight SECONDS``) that many seconds after the box's first round with
another box, and write what only the trainer knows for the report (see ``preflight``)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from hooks.follow_swarm_schedule_on_step_hook import end_training_now
from hooks.quiet_hook import QuietHook
from vissl_swarm import local_replicas, preflight


def averaged_values(task) -> int:
    """Values the averager sends per round: the tensors DecentralizedSGD really averages (parameters and float
    buffers; momentum with --average_optimizer_state); for the baselines, the model's float tensors."""
    optimizer = getattr(task, "decentralized_sgd", None)
    tensors = getattr(optimizer, "averaged_tensors", None)
    if tensors is not None:
        return int(sum(t.numel() for t in tensors.local()))
    model = task.base_model
    return int(sum(t.numel() for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()))


WAIT_FOR_A_GROUP_S = 120.0  # boxes started by hand "at once" reach their first step up to a minute or more apart


def rounds_with_group(task) -> int:
    """DecentralizedSGD's counters (--preflight runs with no other averager): its failed rounds had a group. They
    count a round when it retires, so the window starts at the step after the first round with a group."""
    counters = getattr(getattr(task, "decentralized_sgd", None), "counters", {})
    return int(counters.get("rounds_applied", 0)) + int(counters.get("rounds_failed", 0))


class PreflightOnStepHook(QuietHook):
    """Ends training at the first step boundary ``seconds`` after the box's first round with a group, so that boxes
    started by hand at different times still measure ``seconds`` together; the report's steps, seconds and rounds
    count from that round (``since``), not the wait for it. A box that meets nobody ends ``max(seconds,
    WAIT_FOR_A_GROUP_S)`` after its first step, and its report says that nobody came. The stop is the swarm
    schedule's: VISSL ends the phase and writes its final checkpoint. On a box of several GPUs local rank 0 decides
    and the others follow in the same step. Local rank 0 writes ``preflight.RUN_FILE`` at the start and at the end."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.seconds, self.clock = seconds, clock
        self._started: float | None = None  # the first step, then the first round with a group
        self._since = 0.0  # the same moment as a time stamp, as the round records have them
        self._first_iteration = 0
        self._grouped = False
        self._stopped = False

    def on_start(self, task) -> None:
        self._started, self._since, self._first_iteration = self.clock(), time.time(), task.iteration
        self._write(task)

    def on_step(self, task) -> None:
        if not task.train or self._stopped or self._started is None:
            return
        now = self.clock()
        if not self._grouped and rounds_with_group(task):
            logging.info(
                f"pre-flight: a first round with another box after {now - self._started:.0f} s; it measures "
                f"the next {self.seconds:g} s"
            )
            self._grouped, self._started, self._since, self._first_iteration = True, now, time.time(), task.iteration
        due = now - self._started >= (self.seconds if self._grouped else max(self.seconds, WAIT_FOR_A_GROUP_S))
        if local_replicas.is_box():
            due = local_replicas.broadcast_flag(due)
        if due:
            self._stopped = True
            self._write(task)
            end_training_now(task)
            raise StopIteration

    def on_end(self, task) -> None:
        if not self._stopped:  # our stop wrote it, before VISSL's final checkpoint (whose seconds are not training)
            self._write(task)

    def on_exception(self, task) -> None:
        self._write(task)

    def _write(self, task) -> None:
        folder = getattr(task, "checkpoint_folder", None)
        optimizer = getattr(task, "decentralized_sgd", None)
        if not folder or optimizer is None or self._started is None:  # not the box's swarm peer, or no swarm
            return
        run = {
            "values": averaged_values(task),
            "compression": task.swarm_settings.compression,
            "peer": getattr(optimizer, "peer", None) or str(optimizer.peer_id),
            "steps": int(task.iteration - self._first_iteration),
            "seconds": round(self.clock() - self._started, 3),
            "since": self._since,
            "preflight_s": self.seconds,
        }
        path = Path(folder) / preflight.RUN_FILE
        path.with_suffix(".tmp").write_text(json.dumps(run))
        path.with_suffix(".tmp").replace(path)
