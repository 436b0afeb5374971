"""Starvation, part of the slow-peer fixes: a peer whose box starves it of CPU stays out of groups (they would wait
for it) until it recovers. A sleeper that measures how late it wakes up tells, in a process of its own (this file as
a script; a trainer's thread also wakes late while the interpreter is busy). ``starved``: over ``enter_share`` of the
last ``window_s`` lost; until ``recover_s`` in a row below ``exit_share``, or ``max_starved_s``."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque

logger = logging.getLogger(__name__)

STARVATION_COUNTS = ("starvation_episodes", "starved_s")  # times this peer left averaging starved; seconds starved
_BLIND = "this peer will not notice when its box starves it of CPU"  # said when the sampler cannot run


class StarvationMonitor:
    """Thread "starvation-monitor" samples wake-up lateness; `starved`, `lost_share()` are read by any thread."""

    def __init__(
        self,
        period: float = 0.1,
        window_s: float = 5.0,
        enter_share: float = 0.5,
        exit_share: float = 0.1,
        recover_s: float = 5.0,
        max_starved_s: float = 60.0,
        start: bool = True,
    ):
        self.period, self.window_s, self.recover_s, self.max_starved_s = period, window_s, recover_s, max_starved_s
        self.enter_share, self.exit_share = enter_share, exit_share
        self._samples: deque[tuple[float, float]] = deque()  # (wake-up time, seconds lost), monitor thread only
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._calm_since: float | None = None
        self._first: float | None = None
        self.starved = False
        self.episodes = 0  # times it turned starved
        self.starved_s = 0.0  # seconds spent starved (updated when it recovers; counts() adds the live episode)
        self._starved_at: float | None = None
        self._sampler: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._read_samples, name="starvation-monitor", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        """Start the sampler process and the thread that reads it (if created with ``start=False``)."""
        try:
            self._sampler = subprocess.Popen(
                [sys.executable, "-I", __file__, repr(self.period)],
                text=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
            )
        except OSError as error:
            logger.warning(f"The starvation monitor could not start its sampler process ({error}): {_BLIND}")
            return
        self._thread.start()

    def _read_samples(self) -> None:
        """One line "<monotonic time> <seconds late>" per wake-up of the sampler (monitor thread)."""
        assert self._sampler is not None and self._sampler.stdout is not None
        for line in self._sampler.stdout:
            now, lost = (float(field) for field in line.split())
            self.observe(now, lost)
        if not self._stop.is_set():
            logger.warning(
                f"The starvation monitor's sampler process ended (exit code {self._sampler.wait()}): {_BLIND}"
            )

    def observe(self, now: float, lost: float) -> None:
        """One wake-up `lost` seconds late at monotonic time `now`; updates `starved` (monitor thread)."""
        with self._lock:
            self._samples.append((now, lost))
            while self._samples and self._samples[0][0] < now - self.window_s:
                self._samples.popleft()
            share = self._lost_share(now)
            if self._first is None:
                self._first = now
            full_window = now - self._first >= self.window_s  # no verdict on a start-up burst alone
            if not self.starved and full_window and share > self.enter_share:
                self.starved, self._starved_at, self._calm_since = True, now, None
                self.episodes += 1
                logger.warning(
                    f"This peer's processes are starved of CPU ({share:.0%} of the last "
                    f"{self.window_s:.0f}s lost): leaving averaging groups until it recovers"
                )
            elif self.starved:
                self._calm_since = (self._calm_since or now) if share < self.exit_share else None
                if self._calm_since is not None and now - self._calm_since >= self.recover_s:
                    self._end_episode(now)
                    logger.warning(f"This peer gets CPU again ({share:.0%} lost): rejoining averaging groups")
                elif now - (self._starved_at or now) >= self.max_starved_s:
                    self._end_episode(now)
                    self._samples.clear()
                    self._first = now  # leaves again only after a new full window
                    logger.warning(
                        f"This peer has been starved of CPU for {self.max_starved_s:.0f}s ({share:.0%} "
                        "lost): trying to average again"
                    )

    def _end_episode(self, now: float) -> None:
        self.starved = False
        self.starved_s += now - (self._starved_at or now)

    def _lost_share(self, now: float) -> float:
        """Seconds lost / seconds covered by the samples in the window (at least one period)."""
        if not self._samples:
            return 0.0
        covered = max(now - self._samples[0][0] + self.period + self._samples[0][1], self.period)
        return min(1.0, sum(lost for _, lost in self._samples) / covered)

    def lost_share(self) -> float:
        with self._lock:
            return self._lost_share(time.monotonic())

    def counts(self) -> dict[str, float]:
        """For DecentralizedSGD.counters: how often this peer was starved, and for how long in all."""
        with self._lock:
            live = time.monotonic() - self._starved_at if self.starved and self._starved_at is not None else 0.0
            return dict(zip(STARVATION_COUNTS, (self.episodes, self.starved_s + live), strict=True))

    def stop(self) -> None:
        self._stop.set()
        if self._sampler is not None and self._sampler.poll() is None:
            self._sampler.terminate()
            try:
                self._sampler.wait(timeout=5.0)
            except subprocess.TimeoutExpired:  # stopped by a SIGSTOP of the process group, say
                self._sampler.kill()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)


def sample_wakeups(period: float) -> None:
    """The sampler process: sleep `period`, print how late it woke up; ends when its reader terminates it (not on
    Ctrl-C: the reader decides), when the reader is gone (EPIPE), or when its parent died."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    expected = time.monotonic() + period
    try:
        while os.getppid() == parent:
            time.sleep(max(0.0, expected - time.monotonic()))
            now = time.monotonic()
            print(f"{now:.6f} {max(0.0, now - expected):.6f}", flush=True)
            expected = now + period
    except BrokenPipeError:
        sys.stderr.close()  # no "Exception ignored" noise at exit


if __name__ == "__main__":
    sample_wakeups(float(sys.argv[1]))
