"""The round machine's moving parts: the thread that drives rounds through their states (``RoundScheduler``) and a
round's tensor work (``RoundExchange``: fill, trigger, the update from the average, the apply).

Every tick (20 ms, or at once when a round ends or the trainer steps) the scheduler:
1. checks the averager (``supervisor``); if it failed, fails the rounds in flight;
2. fills a formed group at once from the last completed step, under ``dsgd.lock`` (held by the trainer only around
   its step and the apply), so no groupmate waits for our step boundary. An older update still waiting for the
   trainer goes into the fill (``w + update``): the delta rule stays exact. If the trainer's next boundary is due
   within ``boundary_wait_share`` of an AllReduce (at most half a step), the fill waits for it that long;
3. triggers a filled round (the snapshot goes into the averager's buffers right after, under their lock);
4. turns a finished AllReduce into the update ``averaged − snapshot``, which the trainer adds at its next boundary;
5. starts the next matchmaking once the newest round is triggered, and only after a step boundary since the last
   start: a stalled trainer joins at most one group it does not trigger. A peer starved of CPU starts none.
It tells a trainer waiting for SSP when a round changed. Lock order: see ``rounds``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from .hivemind_fixes import AveragerUnresponsive, cancel_step_first, release_ended_step, shared_memory_manager_timed_out
from .outer import OuterOptimizer
from .rounds import LOCK_POLL_S, Round, RoundBook, TrainerState
from .rounds import RoundState as S
from .supervisor import AveragerSupervisor
from .tensors import ResultSlots, add_, averaged_minus_, copy_
from .vetting import RoundVetting

logger = logging.getLogger(__name__)

TICK_S = 0.02
MIN_PIPELINED_MATCHMAKING = 0.5  # seconds: shortest matchmaking scheduled for a round started during an AllReduce
MATCHMAKING_SLACK = 2.0  # a round finds no group if none formed this many min_matchmaking_time after its schedule
EXCHANGE_COUNTS = ("fills", "fill_s", "fill_locked_s", "applies", "apply_s")  # RoundExchange.counts
_FORMED_STAGES = (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE)


@dataclass(frozen=True)
class RoundSettings:
    """What tests and benchmarks tune beyond ``DecentralizedSGD``'s arguments, and the benchmarks' ablations (the old
    design, one improvement at a time); the defaults are the product's."""

    min_group_size: int = 2
    averager_timeout: float = 30.0  # every call to the averager process is bounded by it (supervisor)
    staleness_timeout: float = 60.0  # SSP: the longest wait for a round
    average_buffers: bool = True  # the model's float buffers (BatchNorm statistics) too
    no_group_patience: float = 60.0  # with a swarm secret: say so when no group formed for this long (secret)
    verbose: bool = False  # log every round's record
    before_allreduce: Callable[[], None] | None = None  # run under dsgd.lock right before a fill reads the tensors
    boundary_wait_share: float = 0.05  # a fill waits at most this share of an AllReduce for a step boundary
    delta_rule: bool = True  # False: overwrite the parameters with the average
    refresh_before_allreduce: bool = True  # False: the snapshot is taken when matchmaking starts
    pipeline: bool = True  # False: the next matchmaking starts only once the round before has ended
    fill_when_formed: bool = True  # False: fill at the first step boundary after the group formed
    slow_peer_fixes: bool = True  # False: hivemind's behaviour with a slow groupmate (hivemind_slow_peer_fixes)

    def __post_init__(self) -> None:
        if not 0.0 <= self.boundary_wait_share < 1.0:
            raise ValueError(
                f"boundary_wait_share must be in [0, 1) (a share of an AllReduce's time; 0: never wait "
                f"for a step boundary before a fill), got {self.boundary_wait_share}"
            )


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
    """Moves one peer's tensors in and out of its rounds. ``outer``: turns an accepted round's update into its outer
    step (None: the plain delta rule)."""

    def __init__(
        self,
        settings: RoundSettings,
        trainer: TrainerState,
        book: RoundBook,
        supervisor: AveragerSupervisor,
        vetting: RoundVetting,
        outer: OuterOptimizer | None = None,
        *,
        weight_by_samples: bool = False,
    ):
        self.settings, self.trainer, self.tensors, self.book = settings, trainer, trainer.tensors, book
        self.supervisor, self.vetting, self.counts = supervisor, vetting, dict.fromkeys(EXCHANGE_COUNTS, 0)
        self.outer, self.weight_by_samples = outer, weight_by_samples

    # --- scheduler thread ---
    def fill_and_trigger(self, r: Round) -> bool:
        """FORMED → FILLED → TRIGGERED in one hold of the averager's buffers, ``dsgd.lock`` held only while reading
        the trainer's tensors. False if the trainer held its lock (the next tick tries again)."""
        trainer = self.trainer
        with self.supervisor.averager.buffers(self.settings.averager_timeout) as buffers:
            if not trainer.lock.acquire(timeout=LOCK_POLL_S):
                return False
            started, filled = time.perf_counter(), False
            try:
                if self.settings.before_allreduce is not None:
                    self.settings.before_allreduce()
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
        seconds = time.perf_counter() - started
        self.counts["fills"] += 1
        self.counts["fill_s"] += seconds
        self.counts["fill_locked_s"] += locked  # all a trainer can wait for
        r.extra["fill_ms"] = 1000 * seconds
        return True

    def early_snapshot(self) -> tuple[list[torch.Tensor], int] | None:
        """``refresh_before_allreduce=False``: host copies of the tensors and their step; None if the lock was busy."""
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
        """Holding dsgd.lock: the trainer's values into the round's slot. Returns the ``pending`` updates (of DONE
        rounds) still to add to it (no lock needed) and how many the snapshot includes."""
        staging = self.book.slots.staging(slot)
        if r.early_snapshot is not None:  # refresh_before_allreduce=False: the values from when matchmaking began
            staging.write_(r.early_snapshot)
            return [], 0
        if pending and not self.settings.delta_rule:  # overwriting: the params will be the newest pending average
            staging.write_(pending[-1])
            return [], len(pending)
        staging.download_(self.tensors.local())  # from a GPU: one wait, in this thread (staging)
        return pending, len(pending)

    def trigger(self, r: Round, buffers: list[torch.Tensor]) -> None:
        """Holding the averager's buffers: go, then put the snapshot (finite, or zeros with weight 0) into them."""
        if r.control.done():  # the group broke up meanwhile
            fail_from_control(r, self.book)
            return
        finite = self.tensors.all_finite(r.slot)  # checked on the host copies: no GPU syncs
        if not finite:  # contribute zeros with weight 0 rather than poison the group
            logger.warning(f"Round {r.index}: local params are not finite, contributing with weight 0")
            torch._foreach_zero_(r.slot)
        weight = float(max(r.samples, 1) if self.weight_by_samples else 1) if finite else 0.0
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
                refusal = vetting.check_update(r, judgement, norm, None if self.weight_by_samples else r.slot)
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
        """Holding the averager's buffers: the slot's ``m − snapshot`` → the outer step's ``x_new − snapshot``."""
        if self.outer is None:
            return
        started = time.perf_counter()
        step_norm = self.outer.step_(r.slot, averaged, skip=lambda: r.stale)
        if step_norm is not None:
            r.extra["outer_step_norm"] = step_norm
            r.extra["outer_ms"] = 1000 * (time.perf_counter() - started)

    # --- trainer thread ---
    def apply_finished(self) -> list[Round]:
        """Holding dsgd.lock, at a step boundary: add the updates of DONE rounds, oldest first; returns them."""
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
        seconds = time.perf_counter() - started  # on a GPU: queueing the copies and adds, not waiting for them
        self.counts["applies"] += 1
        self.counts["apply_s"] += seconds
        with book.lock:
            for r in finished:
                r.extra["apply_ms"] = 1000 * seconds
                r.apply()
            book.retire(self.trainer.local_step)
        return finished


class RoundScheduler(threading.Thread):
    """Runs one peer's rounds in a daemon thread, and enforces hivemind's matchmaking and AllReduce deadlines. It
    drives the parts the ``exchange`` works with (settings, trainer, book, supervisor, vetting)."""

    def __init__(
        self,
        exchange: RoundExchange,
        *,
        min_matchmaking_time: float,
        next_chunk_timeout: float,
        allreduce_timeout: float,
    ):
        super().__init__(name="dsgd-scheduler", daemon=True)
        self.exchange, self.settings, self.trainer = exchange, exchange.settings, exchange.trainer
        self.book, self.supervisor, self.vetting = exchange.book, exchange.supervisor, exchange.vetting
        self.min_matchmaking_time, self.next_chunk_timeout = min_matchmaking_time, next_chunk_timeout
        self.allreduce_timeout = allreduce_timeout
        self._wake, self._stopping = threading.Event(), threading.Event()
        self._boundary_at_last_start = self._failures_seen = 0
        self._allreduce_ema: float | None = None
        self._errors_seen: set[str] = set()
        self._trainer_told = True  # False: a round changed and an SSP wait may not know yet

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float) -> None:
        self._stopping.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout)

    # --- the loop ---
    def run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(TICK_S)
            self._wake.clear()
            self.tick_and_log_errors()

    def tick_and_log_errors(self) -> None:
        """The thread's tick: an error is logged, never raised (the thread keeps the peer training)."""
        try:
            self.tick()
        except AveragerUnresponsive as e:
            self.supervisor.failed(str(e))
        except Exception as e:
            if shared_memory_manager_timed_out(e):  # an overloaded machine, not a bug: the next tick tries again
                logger.warning(
                    "DecentralizedSGD scheduler: torch's shared-memory manager did not answer in time (this machine "
                    "is overloaded: pytorch/pytorch#2482); a round may fail, the next tick goes on"
                )
            elif repr(e) not in self._errors_seen:  # a bug: say so loudly once, keep the peer training
                self._errors_seen.add(repr(e))
                logger.exception(f"DecentralizedSGD scheduler: unexpected {e!r}; rounds may stall, please report")

    def tick(self) -> None:
        """One pass over the rounds (every tick; a unit test calls it itself)."""
        before = self._states()
        self.vetting.on_tick()
        usable = self.supervisor.check()
        if self.supervisor.failures != self._failures_seen:  # rounds of a failed averager never end by themselves
            self._failures_seen = self.supervisor.failures
            self.book.fail_in_flight(f"averager failed: {self.supervisor.last_failure}")
        if usable:
            with self.book.lock:
                rounds = list(self.book.rounds)
            for i, r in enumerate(rounds):
                if self._stopping.is_set():
                    return
                self._advance(r, rounds[:i])
            self._maybe_start_round()
        with self.book.lock:
            self.book.retire(self.trainer.local_step)
        if self._states() != before or not self._trainer_told:  # wake an SSP wait: a step boundary may follow
            self._trainer_told = self.trainer.round_changed()

    def _states(self) -> list[tuple[int, S]]:
        with self.book.lock:
            return [(r.index, r.state) for r in self.book.rounds]

    def _advance(self, r: Round, older: list[Round]) -> None:
        r.observe(self.supervisor.averager.allreduce_stamps)
        self._check_hivemind_progress(r)
        if r.state is S.LOOKING:
            if r.control.done():
                fail_from_control(r, self.book)
            elif r.control.stage in _FORMED_STAGES or r.control.began_allreduce:
                prev_running = bool(older) and not older[-1].control.done()
                with self.book.lock:
                    r.form(self.trainer.local_step, self.trainer.boundaries, prev_running)
                if not self.vetting.accept_group(r):  # False: cancelled before anything is filled
                    with self.book.lock:
                        r.cancel("group not accepted")
        if r.state is S.FORMED:
            if r.control.done():
                fail_from_control(r, self.book)
            elif (overdue := self._fill_overdue(r, older)) is not None:
                with self.book.lock:  # its groupmates have dropped us by now; triggering would only stall us
                    r.cancel(f"not filled in time: {overdue}")
                self._boundary_at_last_start = self.trainer.boundaries  # maybe stalled: start again after a boundary
            elif self._may_fill(r, older):
                self.exchange.fill_and_trigger(r)
        if r.state is S.TRIGGERED and r.control.done():
            self._finish(r)

    def _check_hivemind_progress(self, r: Round) -> None:
        """hivemind must end matchmaking by the round's deadline and an AllReduce after allreduce_timeout; if it does
        not (stuck on a dead peer), the averager has failed."""
        now, allreduce_limit = time.monotonic(), self.allreduce_timeout + self.settings.averager_timeout
        if r.state is S.LOOKING and not r.control.done() and now > r.must_form_by:
            raise AveragerUnresponsive(f"did not end the matchmaking of round {r.index} by its deadline")
        if r.state is S.TRIGGERED and not r.control.done() and now - r.triggered_at > allreduce_limit:
            raise AveragerUnresponsive(f"did not end the AllReduce of round {r.index} within allreduce_timeout")

    @staticmethod
    def _buffers_busy(older: list[Round]) -> bool:
        """hivemind owns the averager's buffers until an older round's AllReduce ends."""
        return any(o.state in (S.FILLED, S.TRIGGERED) for o in older)

    def _fill_overdue(self, r: Round, older: list[Round]) -> str | None:
        """Too late to fill: a groupmate that triggered has dropped us (our averager refused its part), or the trainer
        held ``dsgd.lock`` for next_chunk_timeout since the round could be filled (after any older AllReduce)."""
        if self.supervisor.averager.early_part_refused_at() >= r.t_start:
            return "a groupmate's part came before we could trigger, and was refused"
        now = time.monotonic()
        if self._buffers_busy(older):
            return None
        if r.fillable_at is None:
            r.fillable_at = now
        if now - r.fillable_at > self.next_chunk_timeout:
            return f"the trainer held its lock for next_chunk_timeout ({self.next_chunk_timeout}s)"
        return None

    def _may_fill(self, r: Round, older: list[Round]) -> bool:
        older = [o for o in older if not o.state.resolved]
        if self._buffers_busy(older):
            return False
        if not self.settings.fill_when_formed:  # the old behaviour: the first step boundary after the group formed
            return not older and self.trainer.boundaries > r.boundary_at_formed
        return self.book.slots.free() > 0 and not self._waiting_for_boundary(r)

    def _waiting_for_boundary(self, r: Round) -> bool:
        """Step 2's exception: wait for a boundary due within the budget (``boundary_wait_ms`` in the record)."""
        trainer, now = self.trainer, time.monotonic()
        if r.boundary_wait is None:
            due_in, budget = trainer.clock.next_due_in(), self._boundary_wait_budget()
            until = now + budget + TICK_S if due_in is not None and due_in <= budget else now
            r.boundary_wait = (now, until, trainer.boundaries)
        since, until, boundary = r.boundary_wait
        if trainer.boundaries == boundary and now < until:
            return True
        r.extra.setdefault("boundary_wait_ms", 1000 * (now - since))  # once: a fill retried later did not wait
        return False

    def _boundary_wait_budget(self) -> float:
        """How long a fill may wait for a step boundary: a share of an AllReduce (their mean), at most half a step."""
        step_s = self.trainer.clock.step_s
        if self._allreduce_ema is None or step_s is None:
            return 0.0
        return min(self.settings.boundary_wait_share * self._allreduce_ema, 0.5 * step_s)

    def _finish(self, r: Round) -> None:
        self.exchange.finish(r)
        if r.allreduce_s is not None:  # the records' measure, so that a wait budget matches what they show
            ema = self._allreduce_ema
            self._allreduce_ema = r.allreduce_s if ema is None else 0.7 * ema + 0.3 * r.allreduce_s

    def _starved(self) -> bool:
        if not self.supervisor.starved:
            return False
        self.book.cancel_untriggered("starved of CPU", (S.LOOKING,))
        return True

    def _maybe_start_round(self) -> None:
        settings, trainer = self.settings, self.trainer
        if self._starved():
            return
        with self.book.lock:
            rounds = list(self.book.rounds)
        if len(rounds) >= ResultSlots.count:  # one AllReduce and one result waiting for the trainer at most
            return
        latest = rounds[-1] if rounds else None
        if latest is not None and (latest.state in (S.LOOKING, S.FORMED, S.FILLED) or not settings.pipeline):
            return  # the next matchmaking starts only once the newest round is triggered
        boundary = trainer.boundaries
        if boundary <= self._boundary_at_last_start:
            return  # no step boundary since the previous round started: the trainer may be stalled
        gather = self.vetting.payload()  # sent to the groupmates with hivemind's gather
        if gather is None:
            return  # not now
        delay = self.min_matchmaking_time if latest is None else self._pipelined_delay(latest)
        t_start, step, early = time.time(), trainer.local_step, None
        if not settings.refresh_before_allreduce:  # ablation, the old behaviour: snapshot when matchmaking starts
            taken = self.exchange.early_snapshot()
            if taken is None:
                return
            early, step = taken
        scheduled, slack = get_dht_time() + delay, MATCHMAKING_SLACK * self.min_matchmaking_time
        control = self.supervisor.averager.start_step(
            scheduled_time=scheduled, deadline=scheduled + slack, gather=gather, timeout=settings.averager_timeout
        )
        control.add_done_callback(lambda _: self._wake.set())  # prepare the result right away
        with self.book.lock:
            if self._stopping.is_set():
                cancel_step_first(control)
                return
            r = Round(self.book.num_started, control, t_start, step, early)
            r.must_form_by = time.monotonic() + delay + slack + settings.averager_timeout
            self.book.rounds.append(r)
            self.book.num_started += 1
        self._boundary_at_last_start = boundary

    def _pipelined_delay(self, latest: Round) -> float:
        """Pipelining: the next group forms about when the running AllReduce ends (its mean duration); a full group may
        form that early (hivemind holds others to min_matchmaking_time), with a floor so that near peers meet."""
        remaining = 0.0
        if latest.state is S.TRIGGERED and self._allreduce_ema is not None:
            started = latest.allreduce_started_at if latest.allreduce_started_at is not None else time.monotonic()
            remaining = max(self._allreduce_ema - (time.monotonic() - started), 0.0)
        return max(remaining, min(self.min_matchmaking_time, MIN_PIPELINED_MATCHMAKING))
