"""The tensor work of a round, apart from its scheduling (``scheduler``): fill the snapshot, trigger the AllReduce,
turn the average into an update, and add finished updates to the trainer's tensors.

Who runs what, holding which lock (lock order: the averager's buffer lock, then ``dsgd.lock``, then
``RoundBook.lock``):
- ``fill_and_trigger``: scheduler thread; the averager's buffers, then ``dsgd.lock`` (tried for ``LOCK_POLL_S``)
  while it reads the trainer's tensors only, ``RoundBook.lock`` around each state change (FORMED → FILLED →
  TRIGGERED); the snapshot goes into the buffers after the trigger, before their lock is released;
- ``finish``: scheduler thread; the averager's buffers while it reads them (TRIGGERED → DONE or discarded), and
  inside them the outer optimizer's lock for its step (``outer``; taken last everywhere: a state download's reset
  holds ``dsgd.lock`` and then it);
- ``apply_finished``: trainer thread, holding ``dsgd.lock``, at a step boundary (DONE → applied).
The values travel through ``staging`` (flat host buffers; from a GPU one non-blocking copy, one wait in the
scheduler thread and none in the trainer's).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import torch

from .hivemind_fixes import release_ended_step
from .outer import OuterOptimizer
from .rounds import Round, RoundBook
from .rounds import RoundState as S
from .settings import RoundSettings
from .supervisor import AveragerSupervisor
from .tensor_ops import add_, averaged_minus_, copy_
from .tensors import AveragedTensors
from .trainer_state import TrainerState
from .vetting import RoundVetting

logger = logging.getLogger(__name__)

LOCK_POLL_S = 0.1  # longest a fill waits for dsgd.lock (the trainer is inside its optimizer step or apply)


def fail_from_control(r: Round, book: RoundBook) -> None:
    """A round whose hivemind step ended without an AllReduce for us: record hivemind's reason."""
    try:
        error = repr(r.control.exception())
    except (Exception, asyncio.CancelledError) as e:  # cancelled by hivemind
        error = repr(e)
    release_ended_step(r.control)
    with book.lock:
        r.fail(error)


class RoundExchange:
    """Moves one peer's tensors in and out of its rounds. ``before_allreduce``: the caller's hook, run under
    ``dsgd.lock`` right before a fill reads the tensors (hivemind has no such hook). ``outer``: the peer's outer
    optimizer (``outer``), which turns an accepted round's plain update into its outer step; None: the plain
    delta rule."""

    def __init__(
        self,
        settings: RoundSettings,
        trainer: TrainerState,
        tensors: AveragedTensors,
        book: RoundBook,
        supervisor: AveragerSupervisor,
        vetting: RoundVetting,
        counters: dict[str, float],
        before_allreduce: Callable[[], None] | None = None,
        outer: OuterOptimizer | None = None,
    ):
        self.settings, self.trainer, self.tensors, self.book = settings, trainer, tensors, book
        self.supervisor, self.vetting, self.counters = supervisor, vetting, counters
        self.before_allreduce = before_allreduce
        self.outer = outer

    # --- scheduler thread ---
    def fill_and_trigger(self, r: Round) -> bool:
        """FORMED → FILLED → TRIGGERED in one hold of the averager's buffers (held first: see the lock order).
        ``dsgd.lock`` is held only while the trainer's tensors are read. The trigger goes out before the snapshot is
        copied into the buffers: hivemind's AllReduce reads them only under their lock, which this hold keeps until
        the copy is done, so what hivemind does first (our trigger reaching its process, its load balancing) runs
        while we copy. False if the round could not be filled now (the trainer holds its lock: the next tick tries
        again)."""
        trainer = self.trainer
        with self.supervisor.averager.buffers(self.settings.averager_timeout) as buffers:
            if not trainer.lock.acquire(timeout=LOCK_POLL_S):
                return False
            started, filled = time.perf_counter(), False
            try:
                if self.before_allreduce is not None:
                    self.before_allreduce()
                with self.book.lock:
                    pending = [o.slot for o in self.book.rounds if o.state is S.DONE]
                    slot = self.book.slots.take()
                try:
                    to_add, included = self._read_snapshot(slot, r, pending)
                    step, samples = trainer.local_step, trainer.take_samples_since_fill()
                    with self.book.lock:
                        filled = r.fill(step, samples, slot, included)
                finally:
                    if not filled:
                        with self.book.lock:
                            self.book.slots.give_back(slot)
            finally:
                trainer.lock.release()
            if not filled:
                return False
            locked = time.perf_counter() - started
            for update in to_add:  # outside dsgd.lock: a pending update the trainer adds meanwhile stays unchanged
                add_(slot, update)
            self.trigger(r, buffers)
        self._count_fill(r, locked, time.perf_counter() - started)
        return True

    def early_snapshot(self) -> tuple[list[torch.Tensor], int] | None:
        """Scheduler thread, ``refresh_before_allreduce=False`` (the old design's snapshot, taken when matchmaking
        starts): host copies of the tensors and the step they hold; None if the trainer held its lock meanwhile."""
        if not self.trainer.lock.acquire(timeout=LOCK_POLL_S):
            return None
        try:
            copies = [t.detach().to("cpu", torch.float32, copy=True) for t in self.tensors.local()]
            return copies, self.trainer.local_step
        finally:
            self.trainer.lock.release()

    def _read_snapshot(
        self, slot: list[torch.Tensor], r: Round, pending: list[list[torch.Tensor]]
    ) -> tuple[list[list[torch.Tensor]], int]:
        """Holding dsgd.lock: the trainer's values into the round's slot. The round averages the params as they will
        be once the ``pending`` updates (of DONE rounds) are applied. Returns the updates still to add to the slot
        (that needs no lock) and how many pending updates the snapshot includes."""
        staging = self.book.slots.staging(slot)
        if r.early_snapshot is not None:  # refresh_before_allreduce=False: the values from when matchmaking began
            staging.write_(r.early_snapshot)
            return [], 0
        if pending and not self.settings.delta_rule:  # overwriting: the params will be the newest pending average
            staging.write_(pending[-1])
            return [], len(pending)
        staging.download_(self.tensors.local())  # from a GPU: one wait, in this thread (staging)
        return pending, len(pending)

    def _count_fill(self, r: Round, locked_s: float, seconds: float) -> None:
        """What the fill cost: ``fill_locked_s`` is how long it held dsgd.lock (all a trainer can wait for),
        ``fill_s`` the whole fill and trigger; ``fill_ms`` in the round's record."""
        counters = self.counters
        counters["fills"] += 1
        counters["fill_s"] += seconds
        counters["fill_locked_s"] += locked_s
        r.extra["fill_ms"] = 1000 * seconds

    def trigger(self, r: Round, buffers: list[torch.Tensor]) -> None:
        """Holding the averager's buffers: go, then put the snapshot (finite, or zeros with weight 0) into them;
        hivemind's AllReduce waits for their lock (see fill_and_trigger)."""
        if r.control.done():  # the group broke up meanwhile
            fail_from_control(r, self.book)
            return
        finite = self.tensors.all_finite(r.slot)  # checked on the host copies: no GPU syncs
        if not finite:  # contribute zeros with weight 0 rather than poison the group
            logger.warning(f"Round {r.index}: local params are not finite, contributing with weight 0")
            torch._foreach_zero_(r.slot)
        weight = float(max(r.samples, 1) if self.settings.weight_by_samples else 1) if finite else 0.0
        with self.book.lock:
            triggered = r.trigger(weight, local_nonfinite=not finite)
        if triggered:
            copy_(buffers, r.slot)  # the snapshot is exactly what goes into the AllReduce

    def finish(self, r: Round) -> None:
        """A triggered round ended: fail it, discard it, or turn the averaged buffers into the update to add."""
        r.observe(self.supervisor.averager.allreduce_stamps)
        try:
            gathered = r.control.result()
        except (Exception, asyncio.CancelledError) as e:
            with self.book.lock:
                r.fail(repr(e))
            return
        vetting, delta_rule = self.vetting, self.settings.delta_rule
        judgement = vetting.judge(r, gathered)  # logged and counted; asks for a heal if we are refused
        group = judgement.group
        if r.local_nonfinite or r.stale:
            with self.book.lock:
                r.discard("local snapshot not finite" if r.local_nonfinite else "state reloaded since snapshot", group)
            return
        if judgement.refusal is not None:
            with self.book.lock:
                r.discard(judgement.refusal, group)
            return
        refusal = None
        with self.supervisor.averager.buffers(self.settings.averager_timeout) as buffers:
            reference = vetting.reference_of(buffers)
            if delta_rule:  # slot: snapshot → averaged − snapshot (the snapshot was finite: so is this,
                averaged_minus_(r.slot, buffers)  # iff the average is)
            else:
                copy_(r.slot, buffers)
            norm = self.tensors.norm(r.slot)
            finite = math.isfinite(norm)
            if finite and delta_rule:  # weighted by samples, the AllReduce is not the summaries' plain mean
                refusal = vetting.check_update(r, judgement, norm, None if self.settings.weight_by_samples else r.slot)
            if finite and refusal is None:  # before DONE: the trainer may apply it right after
                self._outer_step(r, buffers)  # the check above vetted the plain average, not the outer step
                vetting.accepted(r, reference, norm)
            with self.book.lock:
                if not finite:
                    r.discard("averaged result not finite", group)
                elif refusal is not None:
                    r.discard(refusal, group)
                else:
                    r.finish(group)
        if not finite:
            logger.warning(f"Round {r.index}: averaged result is not finite, keeping local params")

    def _outer_step(self, r: Round, averaged: list[torch.Tensor]) -> None:
        """Holding the averager's buffers (``averaged``): the slot's plain update ``m − snapshot`` → the outer
        optimizer's ``x_new − snapshot`` (a stale round, whose snapshot predates a state download, is left alone: it
        is discarded when it ends). Its norm and cost go into the round's record."""
        if self.outer is None:
            return
        started = time.perf_counter()
        step_norm = self.outer.step_(r.slot, averaged, skip=lambda: r.stale)
        if step_norm is not None:
            r.extra["outer_step_norm"] = step_norm
            r.extra["outer_ms"] = 1000 * (time.perf_counter() - started)

    # --- trainer thread ---
    def apply_finished(self) -> list[Round]:
        """Holding dsgd.lock, at a step boundary: add the updates of DONE rounds, oldest first (they wait in result
        slots, which only this thread reads once DONE; see tensors.ResultSlots). Returns the rounds applied."""
        book = self.book
        with book.lock:
            finished = [r for r in book.rounds if r.state is S.DONE]
        if not finished:
            return []
        started, local = time.perf_counter(), self.tensors.local()
        with torch.no_grad():
            for r in finished:  # host → device without waiting on a GPU (see staging)
                staging = book.slots.staging(r.slot)
                (staging.add_to_ if self.settings.delta_rule else staging.copy_to_)(local)
        self._count_apply(finished, time.perf_counter() - started)
        with book.lock:
            for r in finished:
                r.apply()
            book.retire(self.trainer.local_step)
        return finished

    def _count_apply(self, finished: list[Round], seconds: float) -> None:
        """What the apply cost the trainer's thread (on a GPU: queueing the copies and adds, not waiting for them);
        ``apply_ms`` in each applied round's record."""
        counters = self.counters
        counters["applies"] += 1
        counters["apply_s"] += seconds
        for r in finished:
            r.extra["apply_ms"] = 1000 * seconds
