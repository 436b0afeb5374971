"""Samples per second between two progress reports: what both progress hooks show."""

from __future__ import annotations

import time


class SamplesPerSecond:
    """Counts from the iteration and time of the previous report (monotonic clock)."""

    def __init__(self) -> None:
        self._time = time.monotonic()
        self._iteration = 0

    def start(self, iteration: int) -> None:
        self._time, self._iteration = time.monotonic(), iteration

    def update(self, iteration: int, global_batch_size: int) -> tuple[float, float]:
        """(samples/s, seconds) since the previous call or start()."""
        now = time.monotonic()
        interval = max(now - self._time, 1e-9)
        samples_per_s = (iteration - self._iteration) * global_batch_size / interval
        self._time, self._iteration = now, iteration
        return samples_per_s, interval
