"""The DHT and averager processes end when the trainer that started them dies, even by SIGKILL.

Why (hivemind 1.1.12): ``hivemind.DHT`` and ``DecentralizedAverager`` are ``multiprocessing`` daemon processes,
and the DHT process runs the libp2p daemon (``p2pd``) as a child of its own. ``daemon=True`` only helps when the
parent exits normally: after a SIGKILL (the OOM killer, ``kill -9``, a crashed job scheduler) both stay alive for
good, reparented to init, and ``p2pd`` keeps the box's port (``--host_maddrs``) and its peer id
(``--identity_path``). The box then cannot restart with the command it was started with: the port is taken
(measured here: a SIGKILLed DHT owner left its DHT process and p2pd listening 30 s later and beyond).

``end_with_parent()`` is called first thing in such a child process. A daemon thread checks every ``period``
seconds whether the parent is still the one that started us; once it is gone it stops this process's own children
(``p2pd``: SIGTERM, then SIGKILL) and exits. Linux only (``/proc``); elsewhere it does nothing and says so once.
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
    """The direct children of process ``pid`` (default: this one), from every thread's ``/proc`` children list
    (asyncio starts ``p2pd`` from the event loop's thread)."""
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
    """In a child process: start the thread "end-with-parent" (returned), which stops this process's children and
    exits this process once the parent that started it is gone. None where there is no /proc to see children."""
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
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended (its parent, this process, has not reaped it yet)


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass
