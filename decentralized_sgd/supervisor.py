"""Keeps the averager process alive (starts, watches, restarts, stops it) and says whether this box can average now
(``starved``). A failure (process dead, a call past its deadline, a probe unanswered for ``timeout`` s) is logged once
and counted, not raised: the peer still trains; the process is killed and restarted at once, then after 2, 4, ... 60 s
while failures follow each other within ``QUIET_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hivemind.utils import MPFuture

from .averager import Averager
from .hivemind_fixes import AveragerUnresponsive
from .starvation import StarvationMonitor

logger = logging.getLogger(__name__)

PROBE_PERIOD_S = 5.0
QUIET_S = 300.0  # a failure this long after the last restart counts as a first failure again
AVERAGER_SHUTDOWN_S = 5.0  # hivemind's shutdown_timeout: how long the averager may take to leave its groups
AVERAGER_STOP_S = AVERAGER_SHUTDOWN_S + 7.0  # the averager's whole stop (see HivemindFixes.shutdown)
STARVATION_STOP_S = 6.0  # StarvationMonitor.stop: 5 s for a stopped sampler, 1 s for its reader
STOP_S = max(AVERAGER_STOP_S, STARVATION_STOP_S)  # shutdown(): the two stop side by side


class AveragerSupervisor:
    """Owns ``averager`` (replaced on restart) and the starvation monitor (None: never starved). ``check`` and
    ``failed`` run in the scheduler thread."""

    def __init__(
        self, make_averager: Callable[[], Averager], timeout: float, starvation: StarvationMonitor | None = None
    ):
        self.make_averager, self.timeout, self.starvation = make_averager, timeout, starvation
        self.averager = make_averager()
        self.failure: str | None = None  # what went wrong, until the averager has been restarted
        self.failures, self.restarts, self.last_failure = 0, 0, ""  # the scheduler fails the rounds of each failure
        self._failures_in_a_row, self._restart_at, self._last_restart = 0, 0.0, float("-inf")
        self._probe: MPFuture | None = None
        self._probe_sent_at = self._next_probe_at = 0.0
        self._closed = False

    def start(self) -> None:
        try:
            self.averager.start_in_background(self.timeout)
        except AveragerUnresponsive as e:  # at construction: nothing to fall back on yet
            raise RuntimeError(
                f"DecentralizedSGD: the averager {e}; is the DHT running, and the machine not "
                "overloaded? (averager_timeout sets this limit)"
            ) from None
        self._next_probe_at = time.monotonic() + PROBE_PERIOD_S
        if self.starvation is not None:
            self.starvation.start()

    @property
    def starved(self) -> bool:
        return self.starvation is not None and self.starvation.starved

    def check(self) -> bool:
        """Scheduler thread: is the averager usable now? Notices failures and restarts when due."""
        if self._closed:
            return False
        if self.failure is None:
            self._check_health()
        if self.failure is not None and time.monotonic() >= self._restart_at:
            self._restart()
        return self.failure is None

    def _check_health(self) -> None:
        averager, now = self.averager, time.monotonic()
        if not averager.is_alive():
            self.failed(f"process (pid {averager.pid}) died with exit code {averager.exitcode}")
        elif self._probe is not None and self._probe.done():
            self._probe, self._next_probe_at = None, now + PROBE_PERIOD_S
        elif self._probe is not None and now - self._probe_sent_at > self.timeout:
            self.failed(f"process (pid {averager.pid}) did not answer for {self.timeout:.0f}s (stopped or wedged)")
        elif self._probe is None and now >= self._next_probe_at:
            self._probe, self._probe_sent_at = averager.get_group_bits(wait=False), now

    def failed(self, what: str) -> None:
        """Scheduler thread: a failure was seen (by a check, or by a call that timed out). Logged once."""
        if self.failure is not None or self._closed:
            return
        now = time.monotonic()
        if now - self._last_restart > QUIET_S:
            self._failures_in_a_row = 0
        self._failures_in_a_row += 1
        self.failure, self.last_failure, self._restart_at = what, what, now + self._backoff()
        self.failures += 1
        self.averager.kill_now()
        self._probe = None
        logger.error(
            f"DecentralizedSGD: the averager {what}. This peer keeps training but does not average until the "
            f"averager is restarted, in {self._backoff():.0f}s (failure {self._failures_in_a_row} in a row). If it "
            "keeps failing, look above for its traceback, check memory (the OOM killer) and that nothing stops "
            "the process; `averager_failures` in the progress line counts these."
        )

    def _backoff(self) -> float:
        return 0.0 if self._failures_in_a_row <= 1 else min(2.0 ** (self._failures_in_a_row - 1), 60.0)

    def _restart(self) -> None:
        averager = None
        try:
            averager = self.make_averager()
            averager.start_in_background(self.timeout)
        except Exception as e:
            if averager is not None:
                averager.kill_now()
            self._failures_in_a_row += 1
            self._restart_at = time.monotonic() + self._backoff()
            logger.error(
                f"DecentralizedSGD: could not restart the averager ({e!r}); next try in {self._backoff():.0f}s"
            )
            return
        if self._closed:  # shutdown() ran meanwhile and stopped the old one
            averager.shutdown()
            return
        self.averager, self.failure, self._last_restart = averager, None, time.monotonic()
        self._next_probe_at = self._last_restart + PROBE_PERIOD_S
        self.restarts += 1
        logger.warning(f"DecentralizedSGD: averager restarted (pid {averager.pid}); averaging resumes")

    def shutdown(self) -> None:
        """Stop the averager and the starvation monitor side by side, within ``STOP_S``."""
        self._closed = True
        stopping = threading.Thread(target=self.starvation.stop if self.starvation else None, name="dsgd-stop")
        stopping.start()
        self.averager.shutdown()
        self.averager.state_fn = lambda: (None, [], None)
        stopping.join()
