"""Work-arounds for hivemind 1.1.12, each with what hivemind does wrong, where, and the upstream issue or PR to file
(hivemind#N: github.com/learning-at-home/hivemind; table: docs/upstream.md). Process-wide ``PATCHES`` (installed at
import while the installed hivemind needs them), helpers the averager and round machine call, ``FixedDHT``, and one
log filter (``QuietHivemindLog``) for what only makes noise."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import dataclasses
import logging
import multiprocessing
import multiprocessing.sharedctypes
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import hivemind
from hivemind.averaging.control import StepControl
from hivemind.averaging.partition import AllreduceException, TensorPartReducer
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils import MPFuture
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr
from packaging.version import Version

logger = logging.getLogger(__name__)

SHM_FUTURES_PER_BLOCK = 4096  # hivemind's default: 16 (see install)
LEAVE_POLL_S = 0.01


class AveragerUnresponsive(RuntimeError):
    """The averager process did not answer within its deadline (stopped, wedged, or killed holding a lock)."""


# --- process-wide patches ---


@dataclasses.dataclass(frozen=True)
class Patch:
    """``owner.name`` replaced by ``make(hivemind's own)``; ``fixed_in``: the first hivemind release without the bug."""

    owner: Any
    name: str
    make: Callable[[Any], Any]
    fixed_in: str | None = None

    def needed(self) -> bool:
        return self.fixed_in is None or Version(hivemind.__version__) < Version(self.fixed_in)


class DeadHolderBreakingLock:
    """utils/mpfuture.py, ``MPFuture._update_lock``: one lock shared by every process forked after hivemind's import;
    a process killed while holding it blocks every other one for ever. Still hivemind's lock (wrapped), but a waiter
    that waits over ``poll_s`` releases it if its holder (pid written on acquiring) died. PR to file: "MPFuture:
    recover the update lock from a dead holder"."""

    def __init__(self, lock: Any, poll_s: float = 1.0):
        self.poll_s = poll_s
        self._lock, self._breaking = lock, multiprocessing.Lock()
        self._holder = multiprocessing.sharedctypes.RawValue("q", 0)  # the holder's pid, 0 when free or unknown

    def __enter__(self) -> DeadHolderBreakingLock:
        while not self._lock.acquire(timeout=self.poll_s):
            self._release_if_its_holder_died()
        self._holder.value = os.getpid()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._holder.value = 0
        self._lock.release()

    def _release_if_its_holder_died(self) -> None:
        if not self._breaking.acquire(timeout=self.poll_s):
            return
        try:
            holder = self._holder.value
            if holder == 0 or is_running(holder):
                return
            self._holder.value = 0  # before the release: no other waiter can take a new holder's pid for this one's
            self._lock.release()
            logger.warning(
                f"process {holder} died while sending a hivemind MPFuture update; released the lock it held "
                f"(process {os.getpid()})"
            )
        finally:
            self._breaking.release()


def _check_current_part_finished(self: TensorPartReducer) -> None:
    """averaging/partition.py, ``TensorPartReducer.check_current_part_finished`` sets a result on a part future a
    cancelled sender cancelled for all (``InvalidStateError``). PR to file: "TensorPartReducer: do not set a result on
    a cancelled part future" (a few lines)."""
    assert self.current_part_accumulated_from <= self.num_current_senders
    if self.current_part_accumulated_from == self.num_current_senders:
        if not self.current_part_future.done():
            self.current_part_future.set_result(self.accumulator.div_(self.denominator))
        self.reset_accumulators()


def _step_control_del(stock_del: Callable[[StepControl], None]) -> Callable[[StepControl], None]:
    """averaging/control.py, ``StepControl.__del__`` asserts a trigger is attached: a step that failed as it began
    printed a traceback. PR to file: "StepControl.__del__: tolerate a control without a trigger" (a few lines)."""

    def __del__(self: StepControl) -> None:
        if getattr(self, "_trigger", None) is None:
            logger.warning("hivemind's StepControl of a round that failed as it began was collected without a trigger")
            MPFuture.__del__(self)
        else:
            stock_del(self)

    return __del__


PATCHES = {
    "mpfuture_lock": Patch(MPFuture, "_update_lock", DeadHolderBreakingLock),
    "part_reducer": Patch(TensorPartReducer, "check_current_part_finished", lambda _: _check_current_part_finished),
    "step_control_del": Patch(StepControl, "__del__", _step_control_del),
}
STOCK: dict[str, Any] = {}  # hivemind's own, for each patch installed


def install() -> None:
    """At import (forked processes inherit them). Also fewer round trips to torch's shared-memory manager, which
    times out on a loaded machine (pytorch/pytorch#2482): MPFutures in blocks of 4096, unless the user set a size."""
    os.environ.setdefault("HIVEMIND_SHM_BUFFER_SIZE", str(SHM_FUTURES_PER_BLOCK))
    for key, patch in PATCHES.items():
        if patch.needed() and key not in STOCK:
            STOCK[key] = patch.owner.__dict__[patch.name]
            setattr(patch.owner, patch.name, patch.make(STOCK[key]))


# --- the trainer's process ---


def shared_memory_manager_timed_out(error: BaseException) -> bool:
    """Whether ``error`` is torch's shared-memory manager not answering in time (nothing was sent: try again later)."""
    return isinstance(error, RuntimeError) and "Shared memory manager connection has timed out" in str(error)


def cancel_step_first(control: StepControl) -> bool:
    """averaging/control.py, ``StepControl.cancel`` cancels the step last, so the averager logs our cancellation as an
    ERROR with a traceback: cancel it first. PR to file: "StepControl.cancel: cancel the step before its trigger"."""
    cancelled = MPFuture.cancel(control)
    if control._trigger is not None:
        control._trigger.cancel()
    if control._cancel is not None and not control._cancel.done():
        control._cancel.set_result(None)
    return cancelled


def release_ended_step(control: StepControl) -> None:
    """control.py, ``StepControl.__del__`` warns about an untriggered step that already ended (nobody waits for it):
    cancel its trigger. PR to file: "StepControl.__del__: no warning for a step that is done" (a few lines)."""
    trigger = control._trigger
    if control.done() and trigger is not None and not trigger.done():
        trigger.cancel()


class LockedConnection:
    """averager.py sends on the averager's pipe from any thread (step, load_state_from_peers, setters); concurrent
    sends interleave. PR to file: "DecentralizedAverager: lock the outer pipe" (a few lines)."""

    def __init__(self, connection: Any):
        self._connection, self._send_lock = connection, threading.Lock()

    def send(self, obj: Any) -> None:
        with self._send_lock:
            self._connection.send(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


# --- the averager's process ---


async def remove_handlers_of(p2p: P2P, names: Sequence[str], address: str) -> None:
    """p2pd keeps the handlers of a killed averager and refuses a restarted one's ("handler ... already set";
    hivemind#501 removes them in a clean shutdown only): remove those the client at `address` registered. PR to file:
    "DecentralizedAverager: replace stale handlers of a killed predecessor"."""
    control = copy.copy(p2p._client.control)
    control.listen_maddr = Multiaddr(address)
    for name in names:
        control.handlers = {name: None}  # remove_stream_handler deletes its own entry afterwards
        try:
            await control.remove_stream_handler(name)
        except Exception as e:  # already gone (a clean shutdown removes its own handlers)
            logger.debug(f"stale handler {name}: {e!r}")


def no_group_fails_at_once(matchmaking: Any) -> None:
    """averager.py, ``_step`` awaits the trigger also after a matchmaking that found no group (the round looks formed:
    AWAITING_TRIGGER); fail it at once. Since hivemind#403; PR to file: "_step: raise before awaiting the trigger when
    no group was found" (a few lines)."""
    look_for_group = matchmaking.look_for_group

    async def look_for_group_or_fail(step: StepControl) -> Any:
        group_info = await look_for_group(step)
        if group_info is None:
            raise AllreduceException("Averaging step failed: could not find a group")  # hivemind's words
        return group_info

    matchmaking.look_for_group = look_for_group_or_fail


@contextlib.asynccontextmanager
async def hold_step(live: set[asyncio.Task], step: StepControl) -> AsyncIterator[None]:
    """averager.py, ``_run`` keeps no reference to a step's task (collected half-way: "Task was destroyed but it is
    pending!"), and misses MPFuture's ``concurrent.futures.InvalidStateError`` of a step cancelled mid-AllReduce. PR to
    file: "DecentralizedAverager: keep step tasks alive; catch concurrent InvalidStateError" (a few lines)."""
    async with held(live):
        try:
            yield
        except concurrent.futures.InvalidStateError:
            if not step.cancelled():
                raise
            logger.debug("An averaging step was cancelled while its AllReduce ran; its result is dropped")


@contextlib.asynccontextmanager
async def held(live: set[asyncio.Task]) -> AsyncIterator[None]:
    """The current task in ``live`` until it leaves: asyncio keeps only weak references to tasks."""
    task = asyncio.current_task()
    live.add(task)
    try:
        yield
    finally:
        live.discard(task)


async def wait_for_group(running_groups: Mapping[Any, Any], group_id: bytes, grace: float) -> bool:
    """averager.py, ``rpc_aggregate_part`` waits for a part's group only until another group (un)registers (with
    pipelined rounds, at once): wait up to `grace` s; False if it never came. Since hivemind#432; PR to file:
    "rpc_aggregate_part: wait for the group until a deadline"."""
    deadline = time.monotonic() + grace
    while group_id not in running_groups and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return group_id in running_groups


def cancel_step(control: StepControl) -> None:
    """Cancel a step from inside the averager's process (``StepControl.cancel()`` fails there, hivemind#411)."""
    if not control.done():
        MPFuture.cancel(control)


async def leave_matchmaking(averager: Any, timeout: float) -> bool:
    """Cancel every step that looks for a group until none does; True if matchmaking is idle within `timeout` s."""
    matchmaking = getattr(averager, "_matchmaking", None)  # None: the averager never finished starting
    if matchmaking is None:
        return True
    deadline = time.monotonic() + timeout
    while matchmaking.is_looking_for_group:
        if time.monotonic() >= deadline:
            return False
        if matchmaking.step_control is not None:
            cancel_step(matchmaking.step_control)
        await asyncio.sleep(LEAVE_POLL_S)
    return True


_leaving = False  # this process's averager is shutting down (shut_down_averager)


async def shut_down_averager(
    averager: Any,
    timeout: float | None,
    steps: Collection[StepControl] = (),
    dht_requests: Collection[asyncio.Task] = (),
) -> None:
    """averager.py, ``DecentralizedAverager._shutdown`` calls ``.finalize()`` on the Futures of ``_running_groups``
    (hivemind#432), and ``remove_p2p_handlers`` raises when Ctrl-C ended the daemon (hivemind#501). Also leaves
    matchmaking first, within 80% of ``timeout``, then awaits ``dht_requests``. PR to file:
    "DecentralizedAverager._shutdown: finalize the runners, tolerate a gone daemon" (a few lines)."""
    global _leaving
    _leaving = True  # the rounds this process abandons now are cancelled ones (QuietHivemindLog)
    deadline = time.monotonic() + 0.8 * (timeout if timeout is not None else averager.shutdown_timeout)
    if not averager.client_mode:
        try:
            await averager.remove_p2p_handlers(averager._p2p, namespace=averager.prefix)
        except (OSError, P2PDaemonError) as error:  # the daemon exited first (Ctrl-C), its handlers with it
            logger.debug(f"p2p daemon gone before the averager's handlers were removed: {error!r}")
    while True:
        for control in list(steps):
            cancel_step(control)
        idle = await leave_matchmaking(averager, max(0.0, deadline - time.monotonic()))
        for future in averager._running_groups.values():
            if future.done() and not future.cancelled():
                future.result().finalize(cancel=True)
        if (idle and not steps) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(LEAVE_POLL_S)
    if dht_requests:
        await asyncio.wait(list(dht_requests), timeout=max(0.0, deadline - time.monotonic()))


# --- processes that end with their parent ---

PARENT_CHECK_PERIOD_S = 1.0
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
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(is_running(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def end_with_parent(period: float = PARENT_CHECK_PERIOD_S) -> threading.Thread | None:
    """dht/dht.py:89, averaging/averager.py: hivemind's processes are ``multiprocessing`` daemons, which end only
    with a parent that exits normally: after a SIGKILL of the trainer they and ``p2pd`` hold the box's port and peer
    id. Called first in such a child: a thread that stops its children and exits once the parent is gone; None where
    there is no /proc. PR to file: "DHT, DecentralizedAverager: end with the parent process"."""
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
    except OSError:
        if Path("/proc/self/stat").exists():
            return False
        try:  # no /proc (not Linux): ask the kernel; a zombie counts as running there
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


# --- the DHT's process ---


class _RequestsOfTheDead:
    """dht/dht.py, ``DHT.run`` dies of the EOFError of a request whose sender died (it catches OSError): raise an
    OSError instead. Reported in gensyn-ai/rl-swarm#77, #102; PR to file: "DHT.run: survive a request whose sender
    died" (a few lines)."""

    def __init__(self, connection: Any):
        self._connection = connection

    def recv(self) -> Any:
        message = self._connection.recv_bytes()  # an EOFError here is the real end of the pipe
        try:
            return ForkingPickler.loads(message)
        except EOFError as e:
            raise ConnectionResetError(f"the sender of a DHT request died before it was read ({e!r})") from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


class FixedDHT(hivemind.DHT):
    """``hivemind.DHT`` that survives a dead requester, holds its request tasks, ends with a SIGKILLed trainer and
    logs departures in one line. DHT owners create this (swarm.start_dht)."""

    def run(self) -> None:
        end_with_parent()
        self._requests_in_flight: set[asyncio.Task] = set()
        self._inner_pipe = _RequestsOfTheDead(self._inner_pipe)
        quiet_hivemind_logs()
        super().run()

    async def _run_coroutine(self, coro: Any, future: MPFuture) -> None:
        """dht/dht.py, ``DHT.run`` keeps no reference to a request's task (collected half-way, never answered); the
        same for get and store. hivemind#427 fixed ``_put_items``; PR to file: "DHT.run: keep references to request
        tasks" (a few lines)."""
        async with held(self._requests_in_flight):
            await super()._run_coroutine(coro, future)

    async def _get(self, *args: Any, **kwargs: Any) -> None:
        async with held(self._requests_in_flight):
            await super()._get(*args, **kwargs)

    async def _store(self, *args: Any, **kwargs: Any) -> None:
        async with held(self._requests_in_flight):
            await super()._store(*args, **kwargs)


# --- noise ---

# what a departure raises in hivemind: a groupmate that left mid-round, or our own p2p daemon gone (Ctrl-C)
_DEPARTURE_ERRORS = (
    AllreduceException,
    ConnectionError,
    FileNotFoundError,
    asyncio.IncompleteReadError,
    P2PDaemonError,
)


def rewrite_as_one_line(record: logging.LogRecord, message: str, level: int | None = None) -> None:
    """Turn a log record with a traceback into one line, ``message``, at ``level`` if given."""
    record.msg, record.args, record.exc_info, record.exc_text = message, (), None, None
    if level is not None:
        record.levelno, record.levelname = level, logging.getLevelName(level)


class QuietHivemindLog(logging.Filter):
    """hivemind logs expected outcomes as errors with tracebacks (each round's outcome is counted anyway): a round
    without a group is dropped (hivemind#519, #387), a departure (a groupmate or our daemon gone, a cancelled task, a
    busy donor) is one line, and the parts a round we leave never received no warning. Others keep their traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        message, error = record.getMessage(), record.exc_info[1] if record.exc_info else None
        if record.name == "hivemind.averaging.averager" and "could not find a group" in message:
            return False
        if _leaving and record.name == "hivemind.averaging.partition" and message.startswith("Reducer: received"):
            return False
        if record.name == "asyncio":
            if message.startswith("Task exception was never retrieved") and isinstance(error, _DEPARTURE_ERRORS):
                task = "hivemind's matchmaking" if "find_peers_or_notify_cancel" in message else "a background"
                line = f"{task} task ended on a departure while its round was cancelled: {error!r}"
                rewrite_as_one_line(record, line, level=logging.WARNING)
            return True
        abandoned = (record.name, record.funcName) == ("hivemind.utils.asyncio", "await_cancelled")
        slow_donor = isinstance(error, TimeoutError) and record.funcName == "_load_state_from_peers"
        if record.name.startswith("hivemind") and (
            isinstance(error, _DEPARTURE_ERRORS) or slow_donor or abandoned and error
        ):
            message = message.rstrip(":")
            rewrite_as_one_line(
                record, message if message == str(error) or repr(error) in message else f"{message}: {error!r}"
            )
        return True


def quiet_hivemind_logs() -> None:
    """``QuietHivemindLog`` on hivemind's handlers and asyncio's logger, in this process."""
    for where in (*get_logger("hivemind").handlers, logging.getLogger("asyncio")):
        if not any(isinstance(f, QuietHivemindLog) for f in where.filters):
            where.addFilter(QuietHivemindLog())


install()
