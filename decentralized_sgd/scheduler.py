"""The background thread that drives rounds through their states (see ``rounds``) and watches the averager.

Every tick (20 ms, or at once when a round ends or the trainer steps) it:
1. checks the averager (``supervisor``); if it failed, fails the rounds in flight and waits for the restart;
2. notices a formed group and **fills it at once** from the last completed step: under ``dsgd.lock``, which the
   trainer holds only around its optimizer step and the apply, so no groupmate waits for our step boundary
   (``fill_when_formed=False`` restores the old behaviour: fill at the first step boundary after the group formed,
   and only once every older round was applied). If an older round's update still waits for the trainer, the
   fill puts in ``w + update`` (the params as they will be once it is applied): the delta rule stays exact and the
   round need not wait for the trainer. ``step_at_snapshot`` is the step count at the fill. The values go into the
   round's slot (its snapshot; from a GPU: one non-blocking copy after the boundary, one wait in this thread), which
   ``staging`` describes, with what "a step boundary's values" means for BatchNorm statistics;
3. triggers a filled round (finite check of the snapshot, which then goes into the averager's buffers,
   ``allow_allreduce``);
4. turns a finished AllReduce into the update ``averaged − snapshot`` in the slot (the trainer adds it at its next
   step boundary: an in-place change between forward and backward would break autograd);
5. starts the next matchmaking, only once the newest round is triggered, and only if the trainer passed a step
   boundary since the previous round started (or since a formed round was cancelled unfilled): a trainer stalled
   inside its optimizer step joins at most one group it does not trigger (that round is cancelled after
   ``next_chunk_timeout``, when its groupmates have dropped it anyway). A trainer stalled elsewhere keeps
   averaging its last step (its rounds are filled without it) for at most the rounds already started.
   A peer starved of CPU (``starvation``) starts no round and cancels the one still looking for a group: it would
   lead or join groups that then wait for it. Groups it has formed already go on (leaving them would cost its
   groupmates ``next_chunk_timeout``).

Lock order: the averager's buffer lock, then ``dsgd.lock``, then ``RoundBook.lock``. Every wait has a deadline:
``dsgd.lock`` is tried for ``LOCK_POLL_S`` (then the next tick tries again), hivemind calls time out after
``averager_timeout`` and count as an averager failure.

Extension points: ``gather_payload()`` (sent to the groupmates with hivemind's gather) and ``accept_group(round)``
(decides on a formed group); both, the verdict on an ended round and the update check are ``vetting``'s (issue 13:
diverged peers and the swarm secret).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from .dht_rejoin import rejoin_count
from .hivemind_fixes import AveragerUnresponsive
from .rounds import Round, RoundBook
from .rounds import RoundState as S
from .supervisor import AveragerSupervisor
from .tensors import ResultSlots, add_, copy_

if TYPE_CHECKING:
    from .optimizer import DecentralizedSGD

logger = logging.getLogger(__name__)

TICK_S = 0.02
LOCK_POLL_S = 0.1  # longest a tick waits for dsgd.lock (the trainer is inside its optimizer step or apply)
MIN_PIPELINED_MATCHMAKING = 0.5  # seconds: shortest matchmaking scheduled for a round started during an AllReduce
MATCHMAKING_SLACK = 2.0  # a round finds no group if none formed this many min_matchmaking_time after its schedule
_FORMED_STAGES = (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE)


class RoundScheduler(threading.Thread):
    """Runs the rounds of one DecentralizedSGD (whose settings it reads) in a daemon thread."""

    def __init__(self, owner: DecentralizedSGD, supervisor: AveragerSupervisor, book: RoundBook):
        super().__init__(name="dsgd-scheduler", daemon=True)
        self.owner, self.supervisor, self.book = owner, supervisor, book
        self._wake, self._stopping = threading.Event(), threading.Event()
        self._boundary_at_last_start = self._failures_seen = 0
        self._allreduce_ema: float | None = None
        self._errors_seen: set[str] = set()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float) -> None:
        self._stopping.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout)

    # --- extension points ---
    def gather_payload(self) -> Any:
        """What this peer sends its groupmates with hivemind's gather (our weight summary and member token, see
        ``vetting``); None: start no round now (the next tick asks again)."""
        return self.owner.vetting.payload()

    def accept_group(self, r: Round) -> bool:
        """Called once the group formed; False cancels the round before anything is filled."""
        return self.owner.vetting.accept_group(r)

    # --- the loop ---
    def run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(TICK_S)
            self._wake.clear()
            try:
                self._tick()
            except AveragerUnresponsive as e:
                self.supervisor.failed(str(e))
            except Exception as e:  # a bug: say so loudly once, keep the peer training
                if repr(e) not in self._errors_seen:
                    self._errors_seen.add(repr(e))
                    logger.exception(f"DecentralizedSGD scheduler: unexpected {e!r}; rounds may stall, please report")

    def _tick(self) -> None:
        owner = self.owner
        owner.counters["dht_rejoins"] = rejoin_count(owner.dht)
        self._count_slow_peer_fixes()
        owner.vetting.on_tick()
        usable = self.supervisor.check()
        if self.supervisor.failures != self._failures_seen:  # rounds of a failed averager never end by themselves
            self._failures_seen = self.supervisor.failures
            self._fail_in_flight(f"averager failed: {self.supervisor.last_failure}")
        if usable:
            with self.book.lock:
                rounds = list(self.book.rounds)
            for i, r in enumerate(rounds):
                if self._stopping.is_set():
                    return
                self._advance(r, rounds[:i])
            self._maybe_start_round()
        with self.book.lock:
            self.book.retire(owner.local_step, owner.peer)

    def _fail_in_flight(self, reason: str) -> None:
        with self.book.lock:
            for r in self.book.rounds:
                if not r.state.resolved and r.state is not S.DONE:
                    r.fail(reason)

    def _advance(self, r: Round, older: list[Round]) -> None:
        r.observe()
        self._check_hivemind_progress(r)
        if r.state is S.LOOKING:
            if r.control.done():
                self._fail(r)
            elif r.control.stage in _FORMED_STAGES or r.control.began_allreduce:
                prev_running = bool(older) and not older[-1].control.done()
                with self.book.lock:
                    r.form(self.owner.local_step, self.owner.boundaries, prev_running)
                if not self.accept_group(r):
                    with self.book.lock:
                        r.cancel("group not accepted")
        if r.state is S.FORMED:
            if r.control.done():
                self._fail(r)
            elif time.monotonic() - r.formed_at > self.owner.next_chunk_timeout:
                with self.book.lock:  # its groupmates have dropped us by now; triggering would only stall us
                    r.cancel(f"not filled within next_chunk_timeout ({self.owner.next_chunk_timeout}s)")
                self._boundary_at_last_start = self.owner.boundaries  # maybe stalled: start again after a boundary
            elif self._may_fill(r, older):
                self._fill_and_trigger(r)
        if r.state is S.TRIGGERED and r.control.done():
            self._finish(r)

    def _check_hivemind_progress(self, r: Round) -> None:
        """hivemind ends matchmaking by the round's deadline and an AllReduce after allreduce_timeout; if it does
        not (a coroutine stuck on a dead peer), the averager is no use any more: treat it as failed."""
        now, allreduce_limit = time.monotonic(), self.owner.allreduce_timeout + self.owner.averager_timeout
        if r.state is S.LOOKING and not r.control.done() and now > r.must_form_by:
            raise AveragerUnresponsive(f"did not end the matchmaking of round {r.index} by its deadline")
        if r.state is S.TRIGGERED and not r.control.done() and now - r.triggered_at > allreduce_limit:
            raise AveragerUnresponsive(f"did not end the AllReduce of round {r.index} within allreduce_timeout")

    def _fail(self, r: Round) -> None:
        try:
            error = repr(r.control.exception())
        except (Exception, asyncio.CancelledError) as e:  # cancelled by hivemind
            error = repr(e)
        with self.book.lock:
            r.fail(error)

    def _may_fill(self, r: Round, older: list[Round]) -> bool:
        older = [o for o in older if not o.state.resolved]
        if any(o.state in (S.FILLED, S.TRIGGERED) for o in older):
            return False  # hivemind owns the buffers until that AllReduce ends
        if not self.owner.fill_when_formed:  # the old behaviour: the first step boundary after the group formed
            return not older and self.owner.boundaries > r.boundary_at_formed
        return self.book.slots.free() > 0

    def _fill_and_trigger(self, r: Round) -> bool:
        """FORMED → FILLED → TRIGGERED in one hold of the averager's buffers (held first: see the lock order).
        False if the round could not be filled now (the trainer holds its lock: the next tick tries again)."""
        owner = self.owner
        with self.supervisor.averager.buffers(owner.averager_timeout) as buffers:
            if not owner.lock.acquire(timeout=LOCK_POLL_S):
                return False
            started, filled = time.perf_counter(), False
            try:
                if owner.before_allreduce is not None:
                    owner.before_allreduce()
                with self.book.lock:
                    pending = [o for o in self.book.rounds if o.state is S.DONE]
                    slot = self.book.slots.take()
                try:
                    included = self._fill_slot(slot, r, pending)
                    step, samples = owner.local_step, owner.take_samples_since_fill()
                    with self.book.lock:
                        filled = r.fill(step, samples, slot, included)
                finally:
                    if not filled:
                        with self.book.lock:
                            self.book.slots.give_back(slot)
            finally:
                owner.lock.release()
            if not filled:
                return False
            locked = time.perf_counter() - started
            self._trigger(r, buffers)
        self._count_fill(r, locked, time.perf_counter() - started)
        return True

    def _fill_slot(self, slot: list[torch.Tensor], r: Round, pending: list[Round]) -> int:
        """Holding dsgd.lock: the values this round averages, into its slot (the snapshot): the params as they will
        be once `pending` updates are applied. Returns how many pending updates went in."""
        staging = self.book.slots.staging(slot)
        if r.early_snapshot is not None:  # refresh_before_allreduce=False: the values from when matchmaking began
            staging.write_(r.early_snapshot)
            return 0
        if pending and not self.owner.delta_rule:  # overwriting: the params will be the newest pending average
            staging.write_(pending[-1].slot)
            return len(pending)
        staging.download_(self.owner.averaged_tensors.local())  # from a GPU: one wait, in this thread (staging)
        for o in pending:
            add_(slot, o.slot)
        return len(pending)

    def _count_fill(self, r: Round, locked_s: float, seconds: float) -> None:
        """What the fill cost: ``fill_locked_s`` is how long it held dsgd.lock (all a trainer can wait for),
        ``fill_s`` the whole fill and trigger; ``fill_ms`` in the round's record."""
        counters = self.owner.counters
        counters["fills"] += 1
        counters["fill_s"] += seconds
        counters["fill_locked_s"] += locked_s
        r.extra["fill_ms"] = 1000 * seconds

    def _trigger(self, r: Round, buffers: list[torch.Tensor]) -> None:
        if r.control.done():  # the group broke up meanwhile
            self._fail(r)
            return
        finite = self.owner.averaged_tensors.all_finite(r.slot)  # checked on the host copies: no GPU syncs
        if not finite:  # contribute zeros with weight 0 rather than poison the group
            logger.warning(f"Round {r.index}: local params are not finite, contributing with weight 0")
            torch._foreach_zero_(r.slot)
        copy_(buffers, r.slot)  # the snapshot is exactly what goes into the AllReduce
        weight = float(max(r.samples, 1) if self.owner.weight_by_samples else 1) if finite else 0.0
        with self.book.lock:
            r.trigger(weight, local_nonfinite=not finite)

    def _finish(self, r: Round) -> None:
        """A triggered round ended: fail it, discard it, or turn the averaged buffers into the update to add."""
        r.observe()
        try:
            gathered = r.control.result()
        except (Exception, asyncio.CancelledError) as e:
            with self.book.lock:
                r.fail(repr(e))
            return
        judgement = self.owner.vetting.judge(r, gathered)  # logged and counted; asks for a heal if we are refused
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
        with self.supervisor.averager.buffers(self.owner.averager_timeout) as buffers:
            reference = self.owner.vetting.reference_of(buffers)
            if self.owner.delta_rule:  # slot: snapshot → averaged − snapshot (the snapshot was finite: so is this,
                torch._foreach_sub_(r.slot, buffers)  # iff the average is)
                torch._foreach_neg_(r.slot)
            else:
                copy_(r.slot, buffers)
            norm = self.owner.averaged_tensors.norm(r.slot)
            finite = math.isfinite(norm)
            if finite and self.owner.delta_rule:
                refusal = self.owner.vetting.check_update(r, judgement, norm)
            if finite and refusal is None:  # before DONE: the trainer may apply it right after
                self.owner.vetting.accepted(r, reference, norm)
            with self.book.lock:
                if not finite:
                    r.discard("averaged result not finite", group)
                elif refusal is not None:
                    r.discard(refusal, group)
                else:
                    r.finish(group)
        if not finite:
            logger.warning(f"Round {r.index}: averaged result is not finite, keeping local params")
        if r.allreduce_started_at is not None and r.ended_at is not None:
            new, ema = r.ended_at - r.allreduce_started_at, self._allreduce_ema
            self._allreduce_ema = new if ema is None else 0.7 * ema + 0.3 * new

    def _count_slow_peer_fixes(self) -> None:
        """What the slow-peer fixes did (see hivemind_slow_peer_fixes, starvation), into ``counters``."""
        self.owner.counters.update(self.owner.slow_peer_counts.as_dict())
        if self.owner.starvation is not None:
            self.owner.counters.update(self.owner.starvation.counts())

    def _starved(self) -> bool:
        """Starved of CPU (see starvation): True, after cancelling the rounds still looking for a group."""
        if self.owner.starvation is None or not self.owner.starvation.starved:
            return False
        with self.book.lock:
            for r in self.book.rounds:
                if r.state is S.LOOKING:
                    r.cancel("starved of CPU")
        return True

    def _maybe_start_round(self) -> None:
        owner = self.owner
        if self._starved():
            return
        with self.book.lock:
            rounds = list(self.book.rounds)
        if len(rounds) >= ResultSlots.count:  # one AllReduce and one result waiting for the trainer at most
            return
        latest = rounds[-1] if rounds else None
        if latest is not None and (latest.state in (S.LOOKING, S.FORMED, S.FILLED) or not owner.pipeline):
            return  # the next matchmaking starts only once the newest round is triggered
        boundary = owner.boundaries
        if boundary <= self._boundary_at_last_start:
            return  # no step boundary since the previous round started: the trainer may be stalled
        gather = self.gather_payload()
        if gather is None:
            return  # not now (see gather_payload)
        delay = owner.min_matchmaking_time if latest is None else self._pipelined_delay(latest)
        t_start, step, early = time.time(), owner.local_step, None
        if not owner.refresh_before_allreduce:  # ablation, the old behaviour: snapshot when matchmaking starts
            if not owner.lock.acquire(timeout=LOCK_POLL_S):
                return
            try:
                early = [t.detach().to("cpu", torch.float32, copy=True) for t in owner.averaged_tensors.local()]
                step = owner.local_step
            finally:
                owner.lock.release()
        scheduled, slack = get_dht_time() + delay, MATCHMAKING_SLACK * owner.min_matchmaking_time
        control = self.supervisor.averager.start_step(
            scheduled_time=scheduled, deadline=scheduled + slack, gather=gather,
            timeout=owner.averager_timeout,
        )
        control.add_done_callback(lambda _: self._wake.set())  # prepare the result right away
        with self.book.lock:
            if self._stopping.is_set():
                control.cancel()
                return
            r = Round(self.book.num_started, control, t_start, step, early)
            r.must_form_by = time.monotonic() + delay + slack + owner.averager_timeout
            self.book.rounds.append(r)
            self.book.num_started += 1
        self._boundary_at_last_start = boundary

    def _pipelined_delay(self, latest: Round) -> float:
        """Pipelining: schedule the next group to form about when the running AllReduce ends (the EMA of past
        AllReduce durations). hivemind never lets a group that is not full form before min_matchmaking_time
        (matchmaking.py): a full group forms this early, with a short floor so that groupmates a few ms apart meet."""
        remaining = 0.0
        if latest.state is S.TRIGGERED and self._allreduce_ema is not None:
            started = latest.allreduce_started_at if latest.allreduce_started_at is not None else time.monotonic()
            remaining = max(self._allreduce_ema - (time.monotonic() - started), 0.0)
        return max(remaining, min(self.owner.min_matchmaking_time, MIN_PIPELINED_MATCHMAKING))
