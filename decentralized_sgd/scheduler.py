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
   ``staging`` describes, with what "a step boundary's values" means for BatchNorm statistics.
   One exception: if the trainer's next step boundary is due within ``boundary_wait_share`` (5%) of an AllReduce's
   time (at most half a step), the fill waits for it (at most that long): the average then holds the step that was
   about to finish. A fill at a random point of a step reads values on average half a step old, and the update waits
   half a step on average for the boundary that applies it, so a round's mean staleness is (snapshot to update
   ready) / step + 1; the wait wins back about (wait budget / step) steps of it for at most the budget per round
   (benchmarks: ``fill_at_once``);
3. triggers a filled round (finite check of the snapshot, ``allow_allreduce``, then the snapshot into the averager's
   buffers, whose lock hivemind's AllReduce waits for);
4. turns a finished AllReduce into the update ``averaged − snapshot`` in the slot (the trainer adds it at its next
   step boundary: an in-place change between forward and backward would break autograd);
5. starts the next matchmaking, only once the newest round is triggered, and only if the trainer passed a step
   boundary since the previous round started (or since a formed round was cancelled unfilled): a trainer stalled
   inside its optimizer step joins at most one group it does not trigger (that round is cancelled
   ``next_chunk_timeout`` after it could have been filled, or once our averager refused a groupmate's part for it:
   its groupmates have dropped it by then; a round waiting for an older AllReduce, whose own deadline bounds the
   wait, is cancelled only for the latter: see ``_fill_overdue``). A trainer stalled elsewhere keeps
   averaging its last step (its rounds are filled without it) for at most the rounds already started.
   A peer starved of CPU (``starvation``) starts no round and cancels the one still looking for a group: it would
   lead or join groups that then wait for it. Groups it has formed already go on (leaving them would cost its
   groupmates ``next_chunk_timeout``).

Lock order: the averager's buffer lock, then ``dsgd.lock``, then ``RoundBook.lock``. Every wait has a deadline:
``dsgd.lock`` is tried for ``LOCK_POLL_S`` (then the next tick tries again), hivemind calls time out after
``averager_timeout`` and count as an averager failure.

The tensor work of steps 2-4 and of the trainer's apply is ``exchange``'s; this module decides when.

Extension points: ``gather_payload()`` (sent to the groupmates with hivemind's gather) and ``accept_group(round)``
(decides on a formed group); both, the verdict on an ended round and the update check are ``vetting``'s (diverged
peers and the swarm secret).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from .exchange import LOCK_POLL_S, RoundExchange, fail_from_control
from .hivemind_fixes import AveragerUnresponsive, cancel_step_first, shared_memory_manager_timed_out
from .rounds import Round, RoundBook
from .rounds import RoundState as S
from .settings import RoundSettings
from .starvation import StarvationMonitor
from .supervisor import AveragerSupervisor
from .tensors import ResultSlots
from .trainer_state import TrainerState
from .vetting import RoundVetting

logger = logging.getLogger(__name__)

TICK_S = 0.02
MIN_PIPELINED_MATCHMAKING = 0.5  # seconds: shortest matchmaking scheduled for a round started during an AllReduce
MATCHMAKING_SLACK = 2.0  # a round finds no group if none formed this many min_matchmaking_time after its schedule
_FORMED_STAGES = (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE)


class RoundScheduler(threading.Thread):
    """Runs one peer's rounds in a daemon thread. It is handed the parts it drives: the round book, the averager's
    supervisor, the exchange (the rounds' tensor work), the vetting (payloads and verdicts), the trainer's counts,
    the starvation monitor (None: never starved), ``counts``: sources of counters it copies every tick, and
    ``on_group``: told the peer ids of every group a round ended with (the address book notes new ones at once)."""

    def __init__(
        self,
        settings: RoundSettings,
        trainer: TrainerState,
        book: RoundBook,
        supervisor: AveragerSupervisor,
        exchange: RoundExchange,
        vetting: RoundVetting,
        counters: dict[str, float],
        *,
        starvation: StarvationMonitor | None = None,
        counts: Sequence[Callable[[], Mapping[str, float]]] = (),
        on_group: Callable[[list[str]], None] | None = None,
    ):
        super().__init__(name="dsgd-scheduler", daemon=True)
        self.settings, self.trainer, self.book, self.supervisor = settings, trainer, book, supervisor
        self.exchange, self.vetting, self.counters = exchange, vetting, counters
        self.starvation, self.counts, self.on_group = starvation, counts, on_group
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

    # --- extension points ---
    def gather_payload(self) -> Any:
        """What this peer sends its groupmates with hivemind's gather (our weight summary and member token, see
        ``vetting``); None: start no round now (the next tick asks again)."""
        return self.vetting.payload()

    def accept_group(self, r: Round) -> bool:
        """Called once the group formed; False cancels the round before anything is filled."""
        return self.vetting.accept_group(r)

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
        """One pass over the rounds (the thread's loop calls it every tick; a unit test may call it itself)."""
        before = self._states()
        for source in self.counts:
            self.counters.update(source())
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
            self._trainer_told = self.trainer.round_changed(LOCK_POLL_S)

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
                if not self.accept_group(r):
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
        """hivemind ends matchmaking by the round's deadline and an AllReduce after allreduce_timeout; if it does
        not (a coroutine stuck on a dead peer), the averager is no use any more: treat it as failed."""
        now, allreduce_limit = time.monotonic(), self.settings.allreduce_timeout + self.settings.averager_timeout
        if r.state is S.LOOKING and not r.control.done() and now > r.must_form_by:
            raise AveragerUnresponsive(f"did not end the matchmaking of round {r.index} by its deadline")
        if r.state is S.TRIGGERED and not r.control.done() and now - r.triggered_at > allreduce_limit:
            raise AveragerUnresponsive(f"did not end the AllReduce of round {r.index} within allreduce_timeout")

    @staticmethod
    def _buffers_busy(older: list[Round]) -> bool:
        """hivemind owns the averager's buffers until an older round's AllReduce ends."""
        return any(o.state in (S.FILLED, S.TRIGGERED) for o in older)

    def _fill_overdue(self, r: Round, older: list[Round]) -> str | None:
        """Too late to fill: a groupmate that triggered has dropped us (our averager refused its part, which came
        after this round began, once ``trigger_grace`` was over), or the trainer held ``dsgd.lock`` (stalled inside
        its step) for next_chunk_timeout since the round could be filled. Time spent waiting for an older AllReduce
        counts only through the first: groupmates that were in it wait as well (a pipelined round forms about
        when the running AllReduce should end, and one that waited for a stalled peer's part ran late), while a
        groupmate that was not in it has triggered at once and is refused in time; filling late for it would
        start an AllReduce nobody joins, and the next round, formed meanwhile, would be late again."""
        if self.supervisor.averager.early_part_refused_at() >= r.t_start:
            return "a groupmate's part came before we could trigger, and was refused"
        now = time.monotonic()
        if self._buffers_busy(older):
            return None
        if r.fillable_at is None:
            r.fillable_at = now
        if now - r.fillable_at > self.settings.next_chunk_timeout:
            return f"the trainer held its lock for next_chunk_timeout ({self.settings.next_chunk_timeout}s)"
        return None

    def _may_fill(self, r: Round, older: list[Round]) -> bool:
        older = [o for o in older if not o.state.resolved]
        if self._buffers_busy(older):
            return False
        if not self.settings.fill_when_formed:  # the old behaviour: the first step boundary after the group formed
            return not older and self.trainer.boundaries > r.boundary_at_formed
        return self.book.slots.free() > 0 and not self._waiting_for_boundary(r)

    def _waiting_for_boundary(self, r: Round) -> bool:
        """Step 2's exception: the first time round ``r`` could be filled, wait if the trainer's next boundary is due
        within the budget; then until a boundary passed or the budget is spent. The record keeps the wait
        (``boundary_wait_ms``)."""
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
        if r.group and self.on_group is not None:
            self.on_group(r.group)
        if r.allreduce_s is not None:  # the records' measure, so that a wait budget matches what they show
            ema = self._allreduce_ema
            self._allreduce_ema = r.allreduce_s if ema is None else 0.7 * ema + 0.3 * r.allreduce_s

    def _starved(self) -> bool:
        """Starved of CPU (see starvation): True, after cancelling the rounds still looking for a group."""
        if self.starvation is None or not self.starvation.starved:
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
        gather = self.gather_payload()
        if gather is None:
            return  # not now (see gather_payload)
        delay = settings.min_matchmaking_time if latest is None else self._pipelined_delay(latest)
        t_start, step, early = time.time(), trainer.local_step, None
        if not settings.refresh_before_allreduce:  # ablation, the old behaviour: snapshot when matchmaking starts
            taken = self.exchange.early_snapshot()
            if taken is None:
                return
            early, step = taken
        scheduled, slack = get_dht_time() + delay, MATCHMAKING_SLACK * settings.min_matchmaking_time
        control = self.supervisor.averager.start_step(
            scheduled_time=scheduled,
            deadline=scheduled + slack,
            gather=gather,
            timeout=settings.averager_timeout,
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
        """Pipelining: schedule the next group to form about when the running AllReduce ends (the EMA of past
        AllReduce durations). hivemind never lets a group that is not full form before min_matchmaking_time
        (matchmaking.py): a full group forms this early, with a short floor so that groupmates a few ms apart meet."""
        remaining = 0.0
        if latest.state is S.TRIGGERED and self._allreduce_ema is not None:
            started = latest.allreduce_started_at if latest.allreduce_started_at is not None else time.monotonic()
            remaining = max(self._allreduce_ema - (time.monotonic() - started), 0.0)
        return max(remaining, min(self.settings.min_matchmaking_time, MIN_PIPELINED_MATCHMAKING))
