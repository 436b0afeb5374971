"""Work-arounds for hivemind 1.1.12 (the version requirements.txt pins); ``docs/upstream.md`` is their table.

Each says what hivemind does wrong, where (its file and function in 1.1.12), and the upstream issue or the title of
the PR to file; each has a test in ``tests/test_hivemind_fixes.py`` that shows the bug on stock hivemind. Three kinds:

- process-wide patches (``PATCHES``), installed at import, each only while the installed hivemind has the bug
  (``Patch.fixed_in``: the first release without it; None: none yet); ``stock()`` restores hivemind's own for a test;
- helpers that ``averager.Averager`` and the round machine call on their own objects (the averager's overrides, the
  shutdown, the DHT's process: ``FixedDHT``);
- one log filter (``QuietHivemindLog``) for what only makes noise: hivemind logs expected outcomes as errors with
  tracebacks.

hivemind#N: github.com/learning-at-home/hivemind issues/N or pull/N. All are still so on hivemind's master (4bd43b7).
"""

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
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
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

from .end_with_parent import end_with_parent

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


def _has_died(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (killed, not yet reaped by its parent)."""
    if pid == os.getpid():
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel (a zombie counts as alive there)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


class DeadHolderBreakingLock:
    """hivemind's ``MPFuture._update_lock`` (utils/mpfuture.py, ``_send_update``), which a process that died holding it
    does not hold for ever.

    Every MPFuture update sent from another process than the future's origin is written under one lock shared by
    every process forked after hivemind's import (trainer, DHT, averager). A process killed inside that write (the
    OOM killer, our supervisor ending a wedged averager) leaves it taken, and every other process blocks at its next
    update for ever. Still hivemind's one lock (wrapped, so that a process forked before this was installed still
    takes it), but a waiter that waits longer than ``poll_s`` looks at the holder's pid (written right after
    acquiring) and releases the lock if that process died (one waiter at a time). A holder that is only stopped is
    waited for. PR to file: "MPFuture: recover the update lock from a dead holder"."""

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
            if holder == 0 or not _has_died(holder):
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
    """averaging/partition.py, ``TensorPartReducer.check_current_part_finished``: every sender of a part awaits the
    same unshielded future, so a sender cancelled at shutdown cancels it for all, and the next sender that fails sets
    a result on a cancelled future (``InvalidStateError``, "Task exception was never retrieved"). Set it only if
    not done. PR to file: "TensorPartReducer: do not set a result on a cancelled part future" (a few lines)."""
    assert self.current_part_accumulated_from <= self.num_current_senders
    if self.current_part_accumulated_from == self.num_current_senders:
        if not self.current_part_future.done():
            self.current_part_future.set_result(self.accumulator.div_(self.denominator))
        self.reset_accumulators()


def _step_control_del(stock_del: Callable[[StepControl], None]) -> Callable[[StepControl], None]:
    """averaging/control.py, ``StepControl.__del__`` asserts that a trigger is attached: a round whose step failed as
    it began (torch's shared-memory manager timed out between the control's creation and its trigger's,
    pytorch/pytorch#2482) printed "Exception ignored in StepControl.__del__" and a traceback. Nothing was lost: one
    warning. PR to file: "StepControl.__del__: tolerate a control without a trigger" (a few lines)."""

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
    """At import, in the trainer's process (forked processes inherit them). Also: hivemind allocates MPFuture bytes in
    shared-memory blocks of ``HIVEMIND_SHM_BUFFER_SIZE`` futures (16), each a round trip to torch's shared-memory
    manager, which times out on a loaded machine (pytorch/pytorch#2482): 4096 unless the user set a size."""
    os.environ.setdefault("HIVEMIND_SHM_BUFFER_SIZE", str(SHM_FUTURES_PER_BLOCK))
    for key, patch in PATCHES.items():
        if patch.needed() and key not in STOCK:
            STOCK[key] = patch.owner.__dict__[patch.name]
            setattr(patch.owner, patch.name, patch.make(STOCK[key]))


@contextlib.contextmanager
def stock(key: str) -> Iterator[None]:
    """hivemind's own version of a patch while the block runs (the tests show its bug)."""
    patch = PATCHES[key]
    fixed = patch.owner.__dict__[patch.name]
    setattr(patch.owner, patch.name, STOCK[key])
    try:
        yield
    finally:
        setattr(patch.owner, patch.name, fixed)


# --- the trainer's process ---


def shared_memory_manager_timed_out(error: BaseException) -> bool:
    """Whether ``error`` is torch's shared-memory manager not answering in time (see ``install``): the call that
    made an MPFuture raised before anything was sent, and can be made again later."""
    return isinstance(error, RuntimeError) and "Shared memory manager connection has timed out" in str(error)


def cancel_step_first(control: StepControl) -> bool:
    """Cancel a round's step, the step itself first. averaging/control.py, ``StepControl.cancel`` cancels the trigger,
    then the cancel future, then the step; the averager process (averager.py, ``_step``) awaits the first two and,
    when one ends before the step shows as cancelled, logs our cancellation as an ERROR with a traceback. PR to file:
    "StepControl.cancel: cancel the step before its trigger" (a few lines)."""
    cancelled = MPFuture.cancel(control)
    if control._trigger is not None:
        control._trigger.cancel()
    if control._cancel is not None and not control._cancel.done():
        control._cancel.set_result(None)
    return cancelled


def release_ended_step(control: StepControl) -> None:
    """A round whose step ended before we triggered it (no group, or its group broke up) has nothing to trigger:
    cancel the trigger, or ``StepControl.__del__`` (control.py) warns that the untriggered step "may cause other
    peers to fail", though no peer waits for a step that ended. PR to file: "StepControl.__del__: no warning for a
    step that is done" (a few lines)."""
    trigger = control._trigger
    if control.done() and trigger is not None and not trigger.done():
        trigger.cancel()


class LockedConnection:
    """The averager's control pipe with sends serialized. hivemind sends on it from whichever thread calls step(),
    load_state_from_peers() or a property setter (averager.py); concurrent sends on one connection interleave.
    PR to file: "DecentralizedAverager: lock the outer pipe" (a few lines)."""

    def __init__(self, connection: Any):
        self._connection, self._send_lock = connection, threading.Lock()

    def send(self, obj: Any) -> None:
        with self._send_lock:
            self._connection.send(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


# --- the averager's process ---


async def remove_handlers_of(p2p: P2P, names: Sequence[str], address: str) -> None:
    """hivemind cannot restart an averager on a running DHT: p2pd keeps the handlers a killed averager registered and
    refuses new ones ("handler ... already set"; hivemind#501 removes them in a clean shutdown only). Remove those
    that the client at `address` registered (p2pd matches a handler by protocol and client address).
    PR to file: "DecentralizedAverager: replace stale handlers of a killed predecessor"."""
    control = copy.copy(p2p._client.control)
    control.listen_maddr = Multiaddr(address)
    for name in names:
        control.handlers = {name: None}  # remove_stream_handler deletes its own entry afterwards
        try:
            await control.remove_stream_handler(name)
        except Exception as e:  # already gone (a clean shutdown removes its own handlers)
            logger.debug(f"stale handler {name}: {e!r}")


def no_group_fails_at_once(matchmaking: Any) -> None:
    """averager.py, ``_step`` (``find_peers_or_notify_cancel``) awaits the trigger after every matchmaking, also one
    that found no group, and raises "could not find a group" only once triggered: the stage says AWAITING_TRIGGER,
    so a round without a group looks formed to the trainer, which fills and triggers it for nothing. Fail it at once,
    with hivemind's own error. Upstream: the wait came with hivemind#403; PR to file: "_step: raise before awaiting
    the trigger when no group was found" (a few lines)."""
    look_for_group = matchmaking.look_for_group

    async def look_for_group_or_fail(step: StepControl) -> Any:
        group_info = await look_for_group(step)
        if group_info is None:
            raise AllreduceException("Averaging step failed: could not find a group")  # hivemind's words
        return group_info

    matchmaking.look_for_group = look_for_group_or_fail


@contextlib.asynccontextmanager
async def hold_step(live: set[asyncio.Task], step: StepControl) -> AsyncIterator[None]:
    """Around hivemind's ``_step``. averager.py, ``_run`` keeps no reference to the task it creates, and the trigger
    it awaits is held weakly: the garbage collector may destroy the round half-way ("Task was destroyed but it is
    pending!"), for us and our groupmates. Hold the task in `live` until it ends. And a step cancelled while its
    AllReduce ran has nowhere to put the result: ``set_result`` raises MPFuture's
    ``concurrent.futures.InvalidStateError``, which hivemind's ``asyncio.InvalidStateError`` clause misses. PR to
    file: "DecentralizedAverager: keep step tasks alive; catch concurrent InvalidStateError" (a few lines)."""
    task = asyncio.current_task()
    live.add(task)
    try:
        yield
    except concurrent.futures.InvalidStateError:
        if not step.cancelled():
            raise
        logger.debug("An averaging step was cancelled while its AllReduce ran; its result is dropped")
    finally:
        live.discard(task)


async def wait_for_group(running_groups: Mapping[Any, Any], group_id: bytes, grace: float) -> bool:
    """Groupmates trigger when they are ready, so their parts may arrive before we registered the group; averager.py,
    ``rpc_aggregate_part`` waits for it only while no other group (un)registers, and with pipelined rounds one always
    does (the early sender gets BAD_GROUP_ID and drops us). Wait up to `grace` s; False if it never came.
    Upstream: the single wait came with hivemind#432; PR to file: "rpc_aggregate_part: wait for the group until a
    deadline"."""
    deadline = time.monotonic() + grace
    while group_id not in running_groups and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return group_id in running_groups


def cancel_step(control: StepControl) -> None:
    """Cancel a step from inside the averager's process. Not ``StepControl.cancel()``: from another process than the
    step's, it sets the cancel future here and again there, which fails there (hivemind#411's order)."""
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


async def shut_down_averager(
    averager: Any,
    timeout: float | None,
    steps: Collection[StepControl] = (),
    dht_requests: Collection[asyncio.Task] = (),
) -> None:
    """The body of averager.py's ``DecentralizedAverager._shutdown`` without its crashes: it calls ``.finalize()`` on
    the asyncio Futures of ``_running_groups`` instead of the AllReduce runners they hold (hivemind#432 made them
    Futures), and ``remove_p2p_handlers`` raises when Ctrl-C already ended the p2p daemon (hivemind#501). It also
    leaves matchmaking first, so that the last withdrawal (matchmaking.py, ``_declare_averager_periodically``'s
    ``finally``) reaches the DHT while this process lives (after it, the DHT logs a reset connection). Takes at most
    80% of ``timeout`` (the averager's ``shutdown_timeout``). ``steps``: the steps in flight, for an owner that cannot
    cancel them itself; ``dht_requests``: DHT requests sent without waiting, waited for. PR to file:
    "DecentralizedAverager._shutdown: finalize the runners, tolerate a gone daemon" (a few lines)."""
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


# --- the DHT's process ---


class _RequestsOfTheDead:
    """The DHT process's end of its request pipe. Unpickling a request fetches its MPFuture pipes from the sender's
    resource sharer; a sender that died meanwhile raises EOFError, which dht/dht.py's ``DHT.run`` does not catch (it
    catches OSError): the DHT process dies, and averaging with it. Raise an OSError instead: hivemind drops that
    one request. Upstream: gensyn-ai/rl-swarm#77 and #102 report it; PR to file: "DHT.run: survive a request whose
    sender died" (a few lines)."""

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
    """``hivemind.DHT`` that survives the death of a process that sent it a request (``_RequestsOfTheDead``: an
    averager we restart), holds its request tasks until they end, ends with a SIGKILLed trainer and logs departures
    in one line. DHT owners create this (swarm.start_dht)."""

    def run(self) -> None:
        end_with_parent()
        self._requests_in_flight: set[asyncio.Task] = set()
        self._inner_pipe = _RequestsOfTheDead(self._inner_pipe)
        quiet_hivemind_logs()
        super().run()

    async def _run_coroutine(self, coro: Any, future: MPFuture) -> None:
        """dht/dht.py, ``DHT.run`` keeps no reference to the task of each request and asyncio holds tasks weakly: a
        request that waits long (a loaded box) can be collected half-way ("Task was destroyed but it is pending!"),
        and its caller never gets an answer. Hold it until it ends; the same for get and store. Upstream: hivemind#427
        fixed it for ``_put_items``; PR to file: "DHT.run: keep references to request tasks" (a few lines)."""
        async with self._held():
            await super()._run_coroutine(coro, future)

    async def _get(self, *args: Any, **kwargs: Any) -> None:
        async with self._held():
            await super()._get(*args, **kwargs)

    async def _store(self, *args: Any, **kwargs: Any) -> None:
        async with self._held():
            await super()._store(*args, **kwargs)

    @contextlib.asynccontextmanager
    async def _held(self) -> AsyncIterator[None]:
        task = asyncio.current_task()
        self._requests_in_flight.add(task)
        try:
            yield
        finally:
            self._requests_in_flight.discard(task)


# --- noise ---

# what a departure raises in hivemind: a groupmate that left mid-round, or our own p2p daemon gone (Ctrl-C reaches
# the whole process group and ends the daemon first: its control socket is missing, FileNotFoundError)
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
    """hivemind logs expected outcomes as errors with tracebacks; nothing is lost in any of them (each round's
    outcome is counted and recorded):

    - a round that found no group (averager.py, ``_step``): dropped (hivemind#519, #387 agree it should go);
    - a departure, wherever the request in flight was: an AllReduce broken off by a leaving groupmate (averager.py,
      ``_aggregate_with_group``), a stream its p2p daemon closed (p2p_daemon.py, ``_handle_stream``), a call on a p2p
      daemon that Ctrl-C already ended, what a task raised that hivemind cancelled on purpose (utils/asyncio.py,
      ``await_cancelled``), a state download from a donor too busy to answer in time (averager.py,
      ``_load_state_from_peers``: hivemind tries the next donor): one line;
    - a matchmaking task that ``_step`` cancelled and never awaited, ended on a departure (asyncio's "Task exception
      was never retrieved"): one warning line.

    Other errors keep their traceback. On hivemind's handlers and asyncio's logger (``quiet_hivemind_logs``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message, error = record.getMessage(), record.exc_info[1] if record.exc_info else None
        if record.name == "hivemind.averaging.averager" and "could not find a group" in message:
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
    """In this process (the DHT's or an averager's, at their start): ``QuietHivemindLog`` on hivemind's handlers and
    on asyncio's logger (its records reach the root logger's handlers, not hivemind's)."""
    for where in (*get_logger("hivemind").handlers, logging.getLogger("asyncio")):
        if not any(isinstance(f, QuietHivemindLog) for f in where.filters):
            where.addFilter(QuietHivemindLog())


install()
