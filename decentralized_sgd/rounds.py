"""One averaging round's states, the book of rounds, and the trainer's counts they are read against
(``TrainerState``). Every transition is one method of ``Round``, called holding ``RoundBook.lock``::

    LOOKING ──► FORMED ──► FILLED ──► TRIGGERED ──► DONE ──► APPLIED
       │           │          │            │           └───► DISCARDED   (state reloaded meanwhile)
       │           │          │            ├───────────────► DISCARDED   (not finite, or state reloaded)
       └───────────┴──────────┴──► CANCELLED                 (never after TRIGGERED)
       └───────────┴──────────┴────────────┴──────► FAILED   (hivemind reported an error, or the averager died)

FILLED: our snapshot is in the round's slot; TRIGGERED: hivemind owns the averager's buffers; DONE: the update
waits in the slot for the trainer's next step boundary. Never cancelled once triggered: hivemind may have committed
to the AllReduce (trigger and cancel call hivemind inside the transition, under the lock, so they cannot race).

Lock order, everywhere: the averager's buffer lock, then ``dsgd.lock`` (``TrainerState.lock``), then
``RoundBook.lock``; the outer optimizer's lock last (``outer``). A background thread tries ``dsgd.lock`` for
``LOCK_POLL_S`` at most (the next tick tries again); every other wait has a deadline too.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hivemind.averaging.control import StepControl

from .hivemind_fixes import cancel_step_first
from .tensors import AveragedTensors, ResultSlots

logger = logging.getLogger(__name__)

LOCK_POLL_S = 0.1  # longest a background thread waits for dsgd.lock at a time


class StepClock:
    """When the trainer's step boundaries come (written by the trainer, read by the scheduler: a float each)."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.last: float | None = None  # time.monotonic() of the last boundary
        self.step_s: float | None = None

    def tick(self) -> None:
        now = time.monotonic()
        if self.last is not None:
            interval = now - self.last
            self.step_s = interval if self.step_s is None else self.step_s + self.smoothing * (interval - self.step_s)
        self.last = now

    def next_due_in(self) -> float | None:
        """Seconds until the next boundary is due if the trainer keeps its pace; None if unknown or overdue."""
        if self.last is None or self.step_s is None:
            return None
        due_in = self.last + self.step_s - time.monotonic()
        return due_in if due_in > 0 else None


class TrainerState:
    """What the trainer changes at its step boundaries, holding ``lock`` (the contract's: it guards ``tensors``;
    re-entrant, as a caller of on_step_end may hold it); the scheduler reads the counts without it."""

    def __init__(self, tensors: AveragedTensors) -> None:
        self.lock = threading.RLock()
        self.tensors = tensors
        self.local_step = self.samples = self._samples_since_fill = 0
        self.boundaries = 0  # step boundaries passed: one per step, and one per wake while waiting for SSP
        self.clock = StepClock()  # when the next step boundary is due (scheduler, step 2)
        self.last_sync_step = 0  # the step at which a round was last applied (SSP)
        # SSP: the trainer waits on it for a round to change; Condition.wait releases ``lock`` entirely
        self._round_changed = threading.Condition(self.lock)
        self.round_changes = 0  # written by the scheduler thread only
        self.waiting = False  # the trainer sleeps in wait_for_round_change (set holding ``lock``)

    def count_step(self, batch_size: int | None) -> None:
        """Holding ``lock``: one local step of ``batch_size`` samples (1 if unknown) ended."""
        self.local_step += 1
        self.samples += batch_size or 1
        self._samples_since_fill += batch_size or 1
        self.boundaries += 1
        self.clock.tick()

    def count_wait(self) -> None:
        """Holding ``lock``: a wake while waiting for SSP is a step boundary too (no step)."""
        self.boundaries += 1

    def synced(self) -> None:
        """Holding ``lock``: a round was applied now (or SSP gave up waiting for one)."""
        self.last_sync_step = self.local_step

    @property
    def steps_since_sync(self) -> int:
        return self.local_step - self.last_sync_step

    def take_samples_since_fill(self) -> int:
        """Scheduler thread, holding ``lock``: the samples seen since the previous fill (weight_by_samples)."""
        samples, self._samples_since_fill = self._samples_since_fill, 0
        return samples

    def took_over(self, local_step: int, samples: int) -> None:
        """Holding ``lock``, after a donor's state replaced ours: continue from these counts."""
        self.local_step = self.last_sync_step = local_step
        self.samples = samples

    def wait_for_round_change(self, seen: int, timeout: float) -> None:
        """Trainer thread, holding ``lock``: sleep (``lock`` released) until ``round_changes`` moved from ``seen``."""
        self.waiting = True
        try:
            if self.round_changes == seen:
                self._round_changed.wait(timeout)
        finally:
            self.waiting = False

    def round_changed(self) -> bool:
        """Scheduler thread: a round changed; wakes an SSP wait. False if ``lock`` stayed busy (call again later)."""
        self.round_changes += 1
        if not self.waiting:  # it sees the count before it sleeps (wait_for_round_change)
            return True
        if not self.lock.acquire(timeout=LOCK_POLL_S):
            return False
        try:
            self._round_changed.notify_all()
        finally:
            self.lock.release()
        return True


class RoundState(enum.Enum):
    LOOKING = "looking"
    FORMED = "formed"
    FILLED = "filled"
    TRIGGERED = "triggered"
    DONE = "done"
    APPLIED = "applied"
    DISCARDED = "discarded"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def resolved(self) -> bool:
        return self in _RESOLVED


_RESOLVED = {RoundState.APPLIED, RoundState.DISCARDED, RoundState.CANCELLED, RoundState.FAILED}
S = RoundState


@dataclass(eq=False)
class Round:
    """One round: its hivemind StepControl, its state and its record (``t_*``: wall clock; ``*_at``: monotonic)."""

    index: int
    control: StepControl
    t_start: float
    step_at_start: int
    early_snapshot: list[torch.Tensor] | None = None  # refresh_before_allreduce=False: values from the start
    state: RoundState = RoundState.LOOKING
    slot: list[torch.Tensor] | None = None  # from FILLED: the snapshot, then (DONE) the update to add
    samples: int = 0  # samples the trainer saw between the previous fill and this one (weight_by_samples)
    results_included: int = 0  # updates of DONE rounds added to this round's fill (not applied to w yet)
    weight: float | None = None
    local_nonfinite: bool = False  # our values were not finite: we took part with zeros and weight 0
    stale: bool = False  # params were replaced by load_state_from_peers after our fill
    error: str | None = None
    group: list[str] | None = None
    must_form_by: float = float("inf")  # hivemind's matchmaking deadline + slack; it and the *_at are monotonic
    triggered_at: float | None = None
    formed_at: float | None = None
    boundary_at_formed: int | None = None  # the trainer's step-boundary count when the group formed
    fillable_at: float | None = None  # formed, and no older AllReduce owned the averager's buffers any more
    boundary_wait: tuple[float, float, int] | None = None  # (from, until, boundary count): see scheduler, step 2
    allreduce_started_at: float | None = None  # as the scheduler saw it (a tick late at most)
    formed_during_prev_allreduce: bool = False
    t_group_formed: float | None = None
    t_triggered: float | None = None
    t_allreduce_start: float | None = None
    t_end: float | None = None
    t_snapshot: float | None = None  # when the values that go into the AllReduce were read (the fill)
    t_update_ready: float | None = None  # when the update was ready for the trainer (DONE)
    step_at_group_formed: int | None = None
    step_at_snapshot: int | None = None
    extra: dict = field(default_factory=dict)  # further record fields (e.g. from extensions)

    def _move(self, sources: set[RoundState], target: RoundState) -> bool:
        """Change state; False if the round was resolved meanwhile (e.g. by shutdown); a bug raises."""
        if self.state not in sources:
            if self.state.resolved:
                return False
            raise AssertionError(f"round {self.index}: {self.state.name} -> {target.name} is not a transition")
        self.state = target
        return True

    # --- transitions (each with RoundBook.lock held) ---
    def form(self, step: int, boundary: int, prev_running: bool) -> bool:
        """LOOKING → FORMED. Scheduler thread. ``prev_running``: the previous round's AllReduce still runs."""
        if not self._move({S.LOOKING}, S.FORMED):
            return False
        self.t_group_formed, self.formed_at, self.step_at_group_formed = time.time(), time.monotonic(), step
        self.boundary_at_formed, self.formed_during_prev_allreduce = boundary, prev_running
        return True

    def fill(self, step: int, samples: int, slot: list[torch.Tensor], results_included: int) -> bool:
        """FORMED → FILLED. Scheduler thread, holding the averager's buffers and ``dsgd.lock``."""
        if not self._move({S.FORMED}, S.FILLED):
            return False
        self.samples, self.slot, self.results_included = samples, slot, results_included
        self.t_snapshot = time.time()
        self.step_at_snapshot = self.step_at_start if self.early_snapshot is not None else step
        return True

    def trigger(self, weight: float, local_nonfinite: bool) -> bool:
        """FILLED → TRIGGERED: hivemind may start the AllReduce. Scheduler thread, holding the averager's buffers."""
        if not self._move({S.FILLED}, S.TRIGGERED):
            return False
        self.weight, self.local_nonfinite = weight, local_nonfinite
        self.t_triggered, self.triggered_at = time.time(), time.monotonic()
        self.control.weight = weight
        self.control.allow_allreduce()
        return True

    def finish(self, group: list[str]) -> bool:
        """TRIGGERED → DONE: the slot holds the update. Scheduler thread, holding the averager's buffer lock."""
        if not self._move({S.TRIGGERED}, S.DONE):
            return False
        self.group, self.t_update_ready = group, time.time()
        return True

    def apply(self) -> bool:
        """DONE → APPLIED: the trainer added the update. Trainer thread, holding ``dsgd.lock``."""
        return self._move({S.DONE}, S.APPLIED)

    def discard(self, reason: str, group: list[str] | None = None) -> bool:
        """TRIGGERED or DONE → DISCARDED: the result is not used. Scheduler thread, or a state download."""
        if not self._move({S.TRIGGERED, S.DONE}, S.DISCARDED):
            return False
        self.error, self.group = reason, group if group is not None else self.group
        return True

    def cancel(self, reason: str) -> bool:
        """LOOKING, FORMED or FILLED → CANCELLED, and tell hivemind; refused (False) once triggered."""
        if self.state in (S.TRIGGERED, S.DONE) or not self._move({S.LOOKING, S.FORMED, S.FILLED}, S.CANCELLED):
            return False
        self.error = reason
        cancel_step_first(self.control)
        return True

    def fail(self, error: str) -> bool:
        """Any unresolved state but DONE (whose result is still applied) → FAILED: hivemind ended the step with an
        error, the averager failed, or shutdown."""
        if not self._move({S.LOOKING, S.FORMED, S.FILLED, S.TRIGGERED}, S.FAILED):
            return False
        self.error = error
        if not self.control.done():
            cancel_step_first(self.control)
        return True

    # --- observations of hivemind's progress (scheduler thread; timestamps only) ---
    def observe(self, stamps: Callable[[], tuple[float, float]] | None = None) -> None:
        """``stamps()``: (began, ended) of the averager's latest AllReduce (exact; ours lag a tick): this round's if
        they began after its trigger."""
        if self.t_allreduce_start is None and self.t_end is None and self.control.began_allreduce:
            self.t_allreduce_start, self.allreduce_started_at = time.time(), time.monotonic()
        if self.t_end is None and self.control.done():
            self.t_end = time.time()
            began, ended = stamps() if stamps is not None else (0.0, 0.0)
            if self.t_triggered is not None and self.t_triggered <= began <= ended:
                self.t_allreduce_start, self.t_end = began, ended
            elif stamps is not None:  # none of its own: no AllReduce ran (a group our vetting refused)
                self.t_allreduce_start = None

    @property
    def allreduce_s(self) -> float | None:
        """How long its AllReduce took: the averager's stamps where they are its own (see observe)."""
        return None if self.t_allreduce_start is None or self.t_end is None else self.t_end - self.t_allreduce_start

    def record(self, step_at_apply: int | None, peer: str) -> dict:
        """One JSON-able dict; t_applied/step_at_apply: when the round was resolved for good (None in flight)."""

        def span(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else b - a

        resolved = step_at_apply is not None
        return dict(
            round=self.index,
            state=self.state.name,
            group_size=None if self.group is None else len(self.group),
            group=self.group,
            applied=self.state is S.APPLIED,
            error=self.error,
            weight=self.weight,
            matchmaking_s=span(self.t_start, self.t_group_formed),
            awaiting_trigger_s=span(self.t_group_formed, self.t_triggered),
            allreduce_s=self.allreduce_s,
            t_start=self.t_start,
            t_group_formed=self.t_group_formed,
            t_triggered=self.t_triggered,
            t_allreduce_start=self.t_allreduce_start,
            t_end=self.t_end,
            t_snapshot=self.t_snapshot,
            t_update_ready=self.t_update_ready,
            t_applied=time.time() if resolved else None,
            step_at_start=self.step_at_start,
            step_at_group_formed=self.step_at_group_formed,
            step_at_snapshot=self.step_at_snapshot,
            step_at_apply=step_at_apply,
            results_included=self.results_included,
            staleness_steps=None
            if self.step_at_snapshot is None or not resolved
            else step_at_apply - self.step_at_snapshot,
            formed_during_prev_allreduce=self.formed_during_prev_allreduce,
            peer=peer,
            **self.extra,
        )


# what a resolved round adds to the counters
ROUND_COUNTS = (
    *"rounds_applied rounds_failed rounds_no_group rounds_discarded_nonfinite rounds_skipped_local_nonfinite".split(),
    "rounds_cancelled",
)
_COUNTED = {S.APPLIED: "rounds_applied", S.CANCELLED: "rounds_cancelled"}
_DISCARD_COUNTERS = {
    "local snapshot not finite": "rounds_skipped_local_nonfinite",
    "averaged result not finite": "rounds_discarded_nonfinite",
}


class RoundBook:
    """The rounds in flight (oldest first), the records of resolved ones, and the peer's ``counters``. ``lock``
    guards every round's state and the list. A resolved round leaves once every older one has (records stay in
    order), gives its slot back and becomes a record (appended to records_path); ``on_group`` is told its group."""

    def __init__(
        self,
        slots: ResultSlots,
        records_path: str | None,
        verbose: bool,
        peer: str,
        on_group: Callable[[list[str]], None] | None = None,
    ):
        self.lock = threading.Lock()
        self.rounds: list[Round] = []
        self.records: list[dict] = []
        self.counters: dict[str, float] = dict.fromkeys(ROUND_COUNTS, 0)
        self.slots, self.records_path, self.verbose, self.on_group = slots, records_path, verbose, on_group
        self.peer = peer  # in every record
        self.num_started = 0

    def retire(self, step: int) -> list[Round]:
        """With ``lock`` held (trainer or scheduler thread): record the resolved rounds at the head of the list."""
        retired = []
        while self.rounds and self.rounds[0].state.resolved:
            r = self.rounds.pop(0)
            if r.slot is not None:
                self.slots.give_back(r.slot)
                r.slot = None
            r.early_snapshot = None
            self._count(r)
            record = r.record(step, self.peer)
            self.records.append(record)
            if self.records_path is not None:
                with open(self.records_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            if self.verbose:
                logger.info(f"DecentralizedSGD round: {record}")
            if r.group and self.on_group is not None:
                self.on_group(r.group)
            retired.append(r)
        return retired

    def _count(self, r: Round) -> None:
        if r.state in _COUNTED:
            key = _COUNTED[r.state]
        elif r.state is S.DISCARDED:
            key = _DISCARD_COUNTERS.get(r.error or "")
        else:  # FAILED
            key = "rounds_failed" if r.t_group_formed is not None else "rounds_no_group"
        if key is not None:
            self.counters[key] += 1

    def in_flight(self) -> list[dict]:
        with self.lock:
            return [r.record(None, self.peer) for r in self.rounds]

    # --- transitions of several rounds (each takes lock) ---
    def cancel_untriggered(self, reason: str, states: tuple[RoundState, ...] = (S.LOOKING, S.FORMED, S.FILLED)) -> int:
        """The rounds in ``states`` (none triggered) → CANCELLED; returns how many."""
        with self.lock:
            return sum(r.cancel(reason) for r in self.rounds if r.state in states)

    def fail_in_flight(self, reason: str) -> int:
        """Every round not resolved and not DONE → FAILED (the averager failed); returns how many."""
        with self.lock:
            return sum(r.fail(reason) for r in self.rounds if not r.state.resolved and r.state is not S.DONE)

    def state_reloaded(self, step: int) -> None:
        """Holding ``dsgd.lock``, a donor's state replaced ours: discard a waiting update, mark filled rounds stale."""
        with self.lock:
            for r in self.rounds:
                if r.state is S.DONE:
                    r.discard("state reloaded since snapshot")
                elif r.state in (S.FILLED, S.TRIGGERED):
                    r.stale = True
            self.retire(step)

    def close(self, reason: str) -> None:
        """Shutdown, once the scheduler stopped: triggered rounds → FAILED, the others in flight → CANCELLED."""
        with self.lock:
            for r in self.rounds:
                if r.state is S.TRIGGERED:
                    r.fail(reason)
                elif not r.state.resolved and r.state is not S.DONE:
                    r.cancel(reason)
            self.rounds.clear()
