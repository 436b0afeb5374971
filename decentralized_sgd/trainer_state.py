"""What the trainer's thread changes at its step boundaries and the other parts read: the lock of the contract,
the step and sample counts, the step-boundary count and clock. The optimizer owns one and hands it to the parts
(``scheduler``, ``exchange``, ``vetting``, ``state_transfer``), so that none of them needs the optimizer."""

from __future__ import annotations

import threading

from .step_clock import StepClock


class TrainerState:
    """Written by the trainer's thread holding ``lock`` (``count_step``, ``count_wait``, ``synced``,
    ``took_over``), and by the thread that loads a donor's state, holding it too; the scheduler reads the counts
    without it (an int each: a read is atomic) and takes ``lock`` only to read the tensors the counts describe."""

    def __init__(self) -> None:
        # guards the local parameters and optimizer state: the trainer's step vs. a fill vs. serving our state.
        # Re-entrant: a caller of on_step_end may already hold it (the README's contract)
        self.lock = threading.RLock()
        self.local_step = 0
        self.samples = 0
        self.boundaries = 0  # step boundaries passed: one per step, and one per poll while waiting for SSP
        self.clock = StepClock()  # when the next step boundary is due (scheduler, step 2)
        self.last_sync_step = 0  # the step at which a round was last applied (SSP)
        self._samples_since_fill = 0
        # SSP: the trainer waits on it for a round to change; Condition.wait releases ``lock`` entirely, also the
        # holds of a caller of on_step_end inside ``with dsgd.lock:`` (the README's contract)
        self._round_changed = threading.Condition(self.lock)
        self.round_changes = 0  # written by the scheduler thread only
        self.waiting = False  # the trainer sleeps in wait_for_round_change (set holding ``lock``)

    def count_step(self, batch_size: int | None) -> None:
        """Trainer thread, holding ``lock``: one local step of ``batch_size`` samples (1 if unknown) ended."""
        self.local_step += 1
        self.samples += batch_size or 1
        self._samples_since_fill += batch_size or 1
        self.boundaries += 1
        self.clock.tick()

    def count_wait(self) -> None:
        """Trainer thread, holding ``lock``: one poll while waiting for SSP is a step boundary too (no step)."""
        self.boundaries += 1

    def synced(self) -> None:
        """Trainer thread, holding ``lock``: a round was applied now (or SSP gave up waiting for one)."""
        self.last_sync_step = self.local_step

    @property
    def steps_since_sync(self) -> int:
        return self.local_step - self.last_sync_step

    def take_samples_since_fill(self) -> int:
        """Scheduler thread, holding ``lock``: the samples seen since the previous fill (weight_by_samples)."""
        samples, self._samples_since_fill = self._samples_since_fill, 0
        return samples

    def wait_for_round_change(self, seen: int, timeout: float) -> None:
        """Trainer thread, holding ``lock``: sleep (``lock`` released) until a round changed after ``round_changes``
        was ``seen``, or ``timeout`` passed."""
        self.waiting = True
        try:
            if self.round_changes == seen:
                self._round_changed.wait(timeout)
        finally:
            self.waiting = False

    def round_changed(self, lock_timeout: float) -> bool:
        """Scheduler thread: a round changed state; wakes an SSP wait. False if the lock was busy for
        ``lock_timeout`` while the trainer waits (call again later)."""
        self.round_changes += 1
        if not self.waiting:  # it sees the count before it sleeps (wait_for_round_change)
            return True
        if not self.lock.acquire(timeout=lock_timeout):
            return False
        try:
            self._round_changed.notify_all()
        finally:
            self.lock.release()
        return True

    def took_over(self, local_step: int, samples: int) -> None:
        """Holding ``lock``, after a donor's state replaced ours: continue from these counts."""
        self.local_step = self.last_sync_step = local_step
        self.samples = samples
