"""The DHT and averager processes end when the trainer that started them dies, even by SIGKILL. hivemind's
processes are ``multiprocessing`` daemons, which only helps when the parent exits normally: after a SIGKILL they and
the DHT's ``p2pd`` stay alive, holding the box's port and peer id, and the box cannot restart with the same command.
``end_with_parent()``, called first in such a child, starts a thread that stops this process's children and exits
once the parent is gone. Linux only (``/proc``); elsewhere it does nothing and says so.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CHECK_PERIOD_S = 1.0
KILL_GRACE_S = 2.0  # between SIGTERM and SIGKILL of our children


def child_pids(pid: int | None = None) -> list[int]:
    """The direct children of process ``pid`` (default: this one), from every thread's ``/proc`` children list."""
    tasks = Path(f"/proc/{pid or os.getpid()}/task")
    children: list[int] = []
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            children += [int(word) for word in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return children


def stop_children(pids: list[int], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM each, then SIGKILL those still alive after ``grace`` seconds."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(is_running(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def end_with_parent(period: float = CHECK_PERIOD_S) -> threading.Thread | None:
    """In a child process: start (and return) the thread "end-with-parent"; None where there is no /proc."""
    if not Path("/proc/self/task").is_dir():
        logger.info("no /proc here: a SIGKILLed trainer may leave its DHT and p2p daemon running")
        return None
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period)
        logger.warning(f"process {os.getpid()}: the trainer that started it (pid {parent}) is gone; stopping")
        stop_children(child_pids())
        os._exit(1)

    thread = threading.Thread(target=watch, name="end-with-parent", daemon=True)
    thread.start()
    return thread


def is_running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie, not yet reaped, has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel (a zombie counts as running there)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass
