"""When the trainer's step boundaries come, for the scheduler's one wait for a boundary (see scheduler, step 2)."""

from __future__ import annotations

import time


class StepClock:
    """When the trainer's step boundaries come: the last one and an average of the time between two (trainer thread
    writes at each boundary, the scheduler thread reads; a float each, no lock needed)."""

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
