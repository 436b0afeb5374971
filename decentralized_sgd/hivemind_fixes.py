"""Work-arounds for hivemind 1.1.12 (the version requirements.txt pins), each naming the bug or missing feature.

Nothing here is applied at import. ``HivemindFixes`` is a ``DecentralizedAverager`` mixin: its overrides act on our
own averager only, in the trainer's process or in the forked averager process (each method says which).
``fixed_8bit_decoding`` and ``fixed_part_reducer`` are the process-wide patches, and only inside the averager
process (``HivemindFixes.run``): hivemind decodes every received part through a global registry keyed by the wire
type (``compression/serialization.py``), not through the averager's compression object, and creates its part
reducers inside ``AllReduceRunner``, so no narrower scope exists.
The averager process ends a round that found no group at once (``no_group_fails_at_once``) instead of reporting it
as formed; it also filters one misleading ERROR out of hivemind's log (``_NoGroupIsNoError``); it and the DHT
process log a departure (a groupmate's, or of our p2p daemon that Ctrl-C ended) in one line instead of a traceback
(``_DepartureIsOneLine``).
``cancel_step_first`` cancels a round's step in the order that does not make hivemind log our cancellation as an
error (``averager_shutdown.cancel_step`` is its counterpart inside the averager process); ``release_ended_step``
keeps a step that ended untriggered from a misleading warning.
``ServesStateAsCopies`` (``served_as_copies``) is for hivemind's own averagers (the baselines), which serve their live
tensors.
``keep_ctrl_c`` is for callers of hivemind's own ``run_in_background`` (the old design's TrainingAverager); our
averager does not need it. ``FixedDHT`` is for whoever creates the DHT: hivemind's dies when a process that sent it
a request dies at the wrong moment, e.g. an averager we restart; and it installs ``DeadHolderBreakingLock``, without
which such a death can block every process of the peer for good. Each work-around is tested on its own in
``tests/test_hivemind_fixes.py``.

Each docstring names the upstream hivemind issue or PR (hivemind#N: github.com/learning-at-home/hivemind, issues/N or
pull/N), or says that none was found, and whether hivemind's master still has the bug. All do as of 4bd43b7
(2026-01-05) except the 8-bit decoding, fixed there by hivemind#670 but in no release: drop ``fixed_8bit_decoding``
with the first release that holds it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import logging
import multiprocessing.sharedctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind's ServicerBase only parses typing hints)

import hivemind
import numpy as np
import torch
from hivemind.averaging.control import StepControl
from hivemind.averaging.partition import AllreduceException, TensorPartReducer
from hivemind.compression.quantization import Quantization
from hivemind.p2p import P2P, P2PContext
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import achain, anext, as_aiter
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr

from decentralized_sgd.averager_shutdown import shut_down_averager
from decentralized_sgd.end_with_parent import end_with_parent

logger = logging.getLogger(__name__)


START_TIMEOUT_S = 120.0  # Averager(start=True): how long it may take to start (hivemind waits for ever)


class AveragerUnresponsive(RuntimeError):
    """The averager process did not answer within its deadline (stopped, wedged, or killed holding a lock)."""


def shared_memory_manager_timed_out(error: BaseException) -> bool:
    """Whether ``error`` is torch's shared-memory manager not answering in time ("Shared memory manager connection
    has timed out"). Every hivemind MPFuture takes a byte of shared memory, and every 16th asks torch's manager
    process for a new block (``hivemind.utils.mpfuture.SharedBytes``); on a machine loaded far past its cores the
    manager can miss its deadline, and the call that made the future raises before anything was sent (seen: a state
    download started by a peer of a test swarm, with two busy processes beside the test suite). The call can be made
    again later. Upstream: pytorch/pytorch#2482 (open)."""
    return isinstance(error, RuntimeError) and "Shared memory manager connection has timed out" in str(error)


SHM_FUTURES_PER_BLOCK = 4096  # hivemind's default: 16


def fewer_shared_memory_requests() -> None:
    """Make the round trips to torch's shared-memory manager (see ``shared_memory_manager_timed_out``) rare: hivemind
    allocates the bytes of its MPFutures in blocks of ``HIVEMIND_SHM_BUFFER_SIZE`` (read at every new block), 16 by
    default, so a peer asks the manager for memory every 16th future, a few times a minute; with 4096 a block is 4 KiB
    of shared memory and lasts hours. A value the user set is kept. Trainer's process, before the averager process is
    forked (it inherits the value). Upstream: no hivemind issue found; the timeout itself is pytorch/pytorch#2482."""
    os.environ.setdefault("HIVEMIND_SHM_BUFFER_SIZE", str(SHM_FUTURES_PER_BLOCK))


def unattached_step_controls_are_one_line() -> None:
    """hivemind's ``StepControl.__del__`` asserts that the control has a trigger attached. A round whose
    ``averager.step(wait=False, require_trigger=True)`` failed as it began (torch's shared-memory manager timed out
    between the control's creation and its trigger's: pytorch/pytorch#2482) leaves a control without one, and Python
    prints "Exception ignored in: StepControl.__del__" with a traceback when it is collected. Nothing is lost (the
    round never started; the scheduler already said so): log one WARNING instead. Other unraisable errors go to the
    hook that was there. Trainer's process, once. Upstream: no hivemind issue found; still so on hivemind's master
    (control.py, 4bd43b7)."""
    previous = sys.unraisablehook
    if getattr(previous, "unattached_step_controls_are_one_line", False):
        return

    def hook(unraisable: Any) -> None:
        if unraisable.object is StepControl.__del__ and isinstance(
            unraisable.exc_value, AssertionError | AttributeError
        ):
            logger.warning(
                "hivemind's StepControl of a round that failed as it began was collected without a trigger "
                f"({unraisable.exc_value}); nothing to cancel"
            )
            return
        previous(unraisable)

    hook.unattached_step_controls_are_one_line = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def served_as_copies(state: tuple) -> tuple:
    """A ``get_current_state`` result whose tensors are copies, for an averager that would serve its live tensors.

    hivemind hands the served tensors from the trainer's process to the averager process through a multiprocessing
    pipe (``_background_thread_fetch_current_state``: ``.cpu().detach()``, a view, not a copy, of a tensor on the
    CPU). Pickled that way, torch moves each CPU tensor's storage into shared memory *in place*
    (``torch.multiprocessing.reductions.reduce_storage``: a new shared block, the data copied, the old block freed).
    The first time a peer downloads the state, every parameter, buffer and momentum buffer of the trainer moves, from
    hivemind's thread, while the trainer's thread may be running a kernel on it without the GIL: that kernel then
    writes into freed memory, and the trainer dies of a corrupted heap (seen: "free(): corrupted unsorted chunks" in
    a trainer with the old design, at its first step, as the other box downloaded its state). Tensors on a GPU are
    copied by ``.cpu()`` and are safe; CPU training, and state kept on the CPU, are not. hivemind's
    ``TrainingAverager`` and ``TrainingStateAverager`` both serve live tensors; our ``StateTransfer.serve`` already
    serves copies. Any thread; the copies are taken without the trainer's lock, as hivemind reads the state.
    Upstream: no hivemind issue found; still so on hivemind's master (averager.py, 4bd43b7)."""
    metadata, tensors, *rest = state
    with torch.no_grad():
        copies = [tensor.detach().clone() for tensor in tensors]
    return (metadata, copies, *rest)


class ServesStateAsCopies:
    """Mixin for hivemind's own averagers (the baselines' ``TrainingAverager`` and ``TrainingStateAverager``), put
    before the hivemind class: their ``get_current_state`` returns copies (see ``served_as_copies``). Runs in the
    trainer's process, in hivemind's state-serving thread."""

    def get_current_state(self) -> tuple:
        return served_as_copies(super().get_current_state())  # type: ignore[misc]


@contextlib.contextmanager
def keep_ctrl_c() -> Iterator[None]:
    """hivemind's ``DecentralizedAverager.run_in_background`` sets SIGINT to SIG_IGN in the *calling* process (so
    that its child inherits it): afterwards Ctrl-C no longer stops the trainer. Restore the handler we had.
    Upstream: the SIG_IGN came with hivemind#530 (for #382); no issue about the caller's handler; still so on hivemind's
    master (4bd43b7)."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def _extract_8bit(self: Quantization, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
    """hivemind 1.1.12's Quantization.extract with one fix: it calls int() on a 1-element array, an error in NumPy 2,
    so every 8-bit part failed to decode and silently stayed un-averaged.
    Upstream: no issue; fixed on hivemind's master (4bd43b7) by hivemind#670 (``.item()``), in no release yet."""
    codebook_size = int(np.frombuffer(serialized_tensor.buffer, count=1, dtype=np.int64)[0])
    codebook = np.frombuffer(serialized_tensor.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
    quantized = np.frombuffer(serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
    quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
    codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
    return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


@contextlib.contextmanager
def fixed_8bit_decoding() -> Iterator[None]:
    """Decode hivemind's 8-bit parts with the NumPy 2 fix while the block runs (process-wide: see the module)."""
    original, Quantization.extract = Quantization.extract, _extract_8bit
    try:
        yield
    finally:
        Quantization.extract = original


def _check_current_part_finished(self: TensorPartReducer) -> None:
    """hivemind 1.1.12's TensorPartReducer.check_current_part_finished with one fix: every sender of a part awaits
    the same future (``accumulate_part``, not shielded), so a sender's task cancelled at shutdown cancels it for all,
    and the next sender that fails then sets a result on a cancelled future: ``InvalidStateError`` in a task that
    nobody awaits ("Task exception was never retrieved" and two tracebacks when a peer is stopped).
    Upstream: none found (the reducer came with hivemind#272, its fault tolerance with #423); still so on hivemind's
    master (4bd43b7)."""
    assert self.current_part_accumulated_from <= self.num_current_senders
    if self.current_part_accumulated_from == self.num_current_senders:
        if not self.current_part_future.done():
            self.current_part_future.set_result(self.accumulator.div_(self.denominator))
        self.reset_accumulators()


@contextlib.contextmanager
def fixed_part_reducer() -> Iterator[None]:
    """Finish parts with the fix above while the block runs (process-wide, in the averager process only)."""
    original = TensorPartReducer.check_current_part_finished
    TensorPartReducer.check_current_part_finished = _check_current_part_finished
    try:
        yield
    finally:
        TensorPartReducer.check_current_part_finished = original


def no_group_fails_at_once(matchmaking: Any) -> None:
    """Averager process, on its ``Matchmaking`` object: a matchmaking that found no group by the round's deadline
    ends the round at once, with hivemind's own error.

    hivemind's ``_step`` (averager.py, ``find_peers_or_notify_cancel``) sets the stage to AWAITING_TRIGGER and
    awaits the trigger after *every* matchmaking, also one that found no group (``look_for_group`` returned None),
    and raises "could not find a group" only once triggered. The stage is all the trainer's process sees of a
    round, so a round without a group looked formed: the scheduler filled and triggered it, and it ended as a failed
    round (``rounds_failed``, a group formed and the AllReduce failed) instead of ``rounds_no_group``. Measured with
    ``benchmarks/bench_consensus.py`` at 16 peers: 38-54% of the rounds "failed" (999 of 2200 in five runs), every
    one of them this way (``benchmarks/results/consensus16.md``); a box alone counted all its rounds as failed. Each
    such round also took a snapshot under the trainer's lock and kept the next matchmaking waiting for its trigger.
    Upstream: none found; the wait came with hivemind#403 (before it, ``_step`` raised before awaiting the trigger);
    still so on hivemind's master (averager.py, 4bd43b7)."""
    look_for_group = matchmaking.look_for_group

    async def look_for_group_or_fail(step: StepControl) -> Any:
        group_info = await look_for_group(step)
        if group_info is None:
            raise AllreduceException("Averaging step failed: could not find a group")  # hivemind's words
        return group_info

    matchmaking.look_for_group = look_for_group_or_fail


class _NoGroupIsNoError(logging.Filter):
    """hivemind logs a round that found no group as an ERROR with a traceback (averager.py, _step). With a
    matchmaking deadline (see start_step) that is an expected outcome, counted as ``rounds_no_group``.
    Upstream: hivemind#519 reports this ERROR, hivemind#387 (open) agrees it should go; still so on hivemind's master
    (4bd43b7)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "could not find a group" not in record.getMessage()


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
    """Turn a log record with a traceback into one line, ``message``, at ``level`` if given (the filters of hivemind's
    records that say nothing was lost: here and in the benchmarks' baselines)."""
    record.msg, record.args, record.exc_info, record.exc_text = message, (), None, None
    if level is not None:
        record.levelno, record.levelname = level, logging.getLevelName(level)


class _DepartureIsOneLine(logging.Filter):
    """hivemind logs a departure with a full traceback, wherever the request in flight was: an AllReduce broken off
    by a leaving groupmate (``averager.py``, ``_aggregate_with_group``), a stream its p2p daemon closed
    (``p2p_daemon.py``, ``_handle_stream``), a join request or DHT call on a p2p daemon that Ctrl-C already ended
    (``utils/asyncio.py``, ``await_cancelled``; ``FileNotFoundError`` on the daemon's socket), ... On the groupmates of
    a peer that leaves mid-round and on a peer stopped with Ctrl-C. The round's failure is recorded and counted
    (``rounds_failed``): say it in one line. So is whatever a task raised that hivemind cancelled on purpose and
    then awaited (``await_cancelled``: e.g. matchmaking's ``assert not self.assembled_group.done()`` when a
    round is cancelled at shutdown while a leader answers), and a state download from a donor too busy to send
    its next part in time (``averager.py``, ``_load_state_from_peers``, TimeoutError: hivemind tries the next
    donor; seen when a whole swarm restarts on a loaded machine). Other errors keep their traceback. On the handlers
    of hivemind's package logger (every hivemind logger writes through them).
    Upstream: none found (hivemind#368 and #423 quieted other paths); still so on hivemind's master (4bd43b7)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        abandoned = (record.name, record.funcName) == ("hivemind.utils.asyncio", "await_cancelled")
        slow_donor = isinstance(error, TimeoutError) and record.funcName == "_load_state_from_peers"
        if record.name.startswith("hivemind") and (
            isinstance(error, _DEPARTURE_ERRORS) or slow_donor or abandoned and error
        ):
            message = record.getMessage().rstrip(":")
            rewrite_as_one_line(
                record, message if message == str(error) or repr(error) in message else f"{message}: {error!r}"
            )
        return True


class _AbandonedDepartureIsOneLine(logging.Filter):
    """A race in hivemind's ``_step`` (averager.py): when a round is cancelled (our shutdown cancels every step),
    hivemind cancels its matchmaking task (``find_peers_or_notify_cancel``) and never awaits it. If the task's join
    request then fails on a departure, e.g. on a p2p daemon that Ctrl-C already ended (``ConnectionResetError:
    Connection lost``), the task ends with that error instead of being cancelled, and asyncio logs "Task exception
    was never retrieved" with a traceback when the task is collected (seen on a box of a whole swarm stopped with
    Ctrl-C). The round was cancelled anyway, nothing is lost: one line, as a warning. Other abandoned errors keep
    their traceback. On asyncio's logger (its records reach the root logger's handlers, not hivemind's).
    Upstream: none found (hivemind#357 awaits the tasks it cancels inside matchmaking, not in ``_step``); still so on
    hivemind's master (4bd43b7)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if message.startswith("Task exception was never retrieved") and isinstance(error, _DEPARTURE_ERRORS):
            task = "hivemind's matchmaking" if "find_peers_or_notify_cancel" in message else "a background"
            message = f"{task} task ended on a departure while its round was cancelled: {error!r}"
            rewrite_as_one_line(record, message, level=logging.WARNING)
        return True


def release_ended_step(control: StepControl) -> None:
    """Trainer's process: a round whose hivemind step ended before we triggered it (it found no group, see
    ``no_group_fails_at_once``, or its group broke up first) has nothing left to trigger: cancel its trigger.
    Otherwise hivemind's ``StepControl.__del__`` warns, when the control is collected, that the untriggered step "may
    cause other peers to fail an averaging round" (control.py): every round without a group logged that once the
    fix above let such rounds end untriggered (1083 lines in three runs of 16 peers), and no peer waits for a step
    that ended. Upstream: none found; still so on hivemind's master (control.py, 4bd43b7)."""
    trigger = control._trigger
    if control.done() and trigger is not None and not trigger.done():
        trigger.cancel()


def cancel_step_first(control: StepControl) -> bool:
    """Trainer's process: cancel a round's hivemind step, the step itself first.

    hivemind's ``StepControl.cancel`` (control.py) cancels the trigger, then sets the cancel future, then the step.
    The averager process awaits the first two (averager.py, ``_step``); when one of them ends before the step shows
    as cancelled, hivemind takes our cancellation for a failure and logs it as an ERROR with a traceback (seen in
    ``make demo`` on a loaded machine: a formed round not filled within next_chunk_timeout). The step's state is
    shared memory: cancelled first, the averager process sees it as soon as it wakes.
    Upstream: none found (the order came with hivemind#411); still so on hivemind's master (4bd43b7)."""
    cancelled = MPFuture.cancel(control)
    if control._trigger is not None:
        control._trigger.cancel()
    if control._cancel is not None and not control._cancel.done():
        control._cancel.set_result(None)
    return cancelled


def log_departures_in_one_line() -> None:
    """In this process (the DHT's or the averager's, at their start): hivemind's handler gets the filter for
    departures, asyncio's logger the one for abandoned tasks."""
    for handler in get_logger("hivemind").handlers:  # get_logger: hivemind's handler exists from here on
        if not any(isinstance(f, _DepartureIsOneLine) for f in handler.filters):
            handler.addFilter(_DepartureIsOneLine())
    abandoned = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedDepartureIsOneLine) for f in abandoned.filters):
        abandoned.addFilter(_AbandonedDepartureIsOneLine())


class LockedConnection:
    """The averager's control pipe with sends serialized. hivemind sends on it from whichever thread calls step(),
    load_state_from_peers() or a property setter; concurrent sends on one multiprocessing connection interleave.
    Upstream: none found; still so on hivemind's master (4bd43b7)."""

    def __init__(self, connection: Any):
        self._connection, self._send_lock = connection, threading.Lock()

    def send(self, obj: Any) -> None:
        with self._send_lock:
            self._connection.send(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


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
    """hivemind's ``MPFuture._update_lock``, which a process that died holding it does not hold for ever.

    Every MPFuture update (a result, an exception, a cancel) sent from a process other than the future's origin is
    written under one ``multiprocessing.Lock``, created when hivemind is imported and shared by every process forked
    after that: the trainer, its DHT process and its averager process. A process killed inside that write (SIGKILL,
    the OOM killer, or our supervisor ending a wedged averager) leaves the lock taken, and every other process then
    blocks at its next update, for ever: the restarted averager and the DHT never answer again. Seen in the test
    suite on a loaded machine: after a test killed an averager, every later test of that pytest worker that started a
    DHT hung in ``DHT.__init__`` (its process blocked in ``MPFuture._send_update``).

    Still one lock for all, as hivemind means it; but a process that waits longer than ``poll_s`` looks at who holds
    it (a shared pid, written right after acquiring), and if that process has died, releases the lock in its place
    (one waiter at a time, under a second lock). A holder that is only stopped or slow is waited for: it may still be
    in the middle of its write. Left open: a holder killed between acquiring and writing its pid (a few instructions).
    Trainer's process, before the first hivemind process is forked (see ``dead_holders_release_mpfuture_locks``).
    Upstream: none found; still so on hivemind's master (mpfuture.py, 4bd43b7)."""

    def __init__(self, lock: Any, poll_s: float = 1.0):
        """``lock``: hivemind's own; processes forked before this wrapper was installed (a plain DHT started first)
        still take it as it is, so their updates stay serialized with ours."""
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


def dead_holders_release_mpfuture_locks() -> None:
    """Install ``DeadHolderBreakingLock`` as hivemind's ``MPFuture._update_lock``, once, around hivemind's own lock:
    a process forked before (e.g. a plain ``hivemind.DHT`` started first) keeps taking that lock, so its updates stay
    serialized with ours (it only cannot have its death noticed). Trainer's process."""
    if not isinstance(MPFuture._update_lock, DeadHolderBreakingLock):
        MPFuture._update_lock = DeadHolderBreakingLock(MPFuture._update_lock)


async def _remove_handlers_of(p2p: P2P, names: Sequence[str], address: Multiaddr) -> None:
    """Remove stream handlers that another client of this p2p daemon registered from `address` (p2pd matches a
    handler by protocol and the registering client's socket address), reusing hivemind's request code."""
    control = copy.copy(p2p._client.control)
    control.listen_maddr = address
    for name in names:
        control.handlers = {name: None}  # remove_stream_handler deletes its own entry afterwards
        try:
            await control.remove_stream_handler(name)
        except Exception as e:  # already gone (a clean shutdown removes its own handlers)
            logger.debug(f"stale handler {name}: {e!r}")


class _RequestsOfTheDead:
    """The DHT process's end of its request pipe. A request carries MPFuture pipes, which the DHT fetches from the
    sender's multiprocessing resource sharer while unpickling; if the sender dies meanwhile (an averager killed by
    the OOM killer or restarted by us), that raises EOFError, which hivemind's DHT.run does not catch (it catches
    OSError): the DHT process dies, and with it averaging for the whole peer. Raise an OSError instead: hivemind
    logs it and drops that one request, whose sender is gone anyway.
    Upstream: none in hivemind (gensyn-ai/rl-swarm#77 and #102 report this EOFError in ``DHT._run``); still so on
    hivemind's master (4bd43b7)."""

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
    """``hivemind.DHT`` that survives the death of a process that sent it a request (see _RequestsOfTheDead) and
    keeps its requests alive until they end (see _run_coroutine). DHT owners create this instead (swarm.start_dht
    does); an averager restart on a plain hivemind.DHT can kill it."""

    def __init__(self, *args: Any, **kwargs: Any):
        """Trainer's process: installs ``DeadHolderBreakingLock`` before hivemind forks the DHT process."""
        dead_holders_release_mpfuture_locks()
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        """DHT process. Departures are one log line here too (see _DepartureIsOneLine); it ends with its p2p daemon
        when the trainer is killed (end_with_parent)."""
        end_with_parent()
        self._requests_in_flight: set[asyncio.Task] = set()
        self._inner_pipe = _RequestsOfTheDead(self._inner_pipe)
        log_departures_in_one_line()
        super().run()

    async def _run_coroutine(self, coro: Any, future: MPFuture) -> None:
        """DHT process. hivemind's ``DHT.run`` keeps no reference to the task it makes for each request (its local
        variable is overwritten by the next request), and asyncio holds tasks only weakly: a request that waits long,
        such as a call to the p2p daemon on a loaded box, can be garbage-collected half-way. hivemind then logs
        "Task was destroyed but it is pending!" and a GeneratorExit traceback, and the caller never gets an answer
        (seen in the test suite, a routing-table read every 10 s at load 38 on 2 cores). Hold the task until it
        ends; the same for get and store.
        Upstream: none found (hivemind#427 fixed it on ``_put_items``); still so on hivemind's master (4bd43b7)."""
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


class HivemindFixes(hivemind.DecentralizedAverager):
    """``DecentralizedAverager`` plus the fixes below. Construct with ``start=False`` semantics: call
    ``start_in_background`` (hivemind's ``run_in_background`` changes the caller's SIGINT handler)."""

    _rpc_handlers = None  # the base class caches handlers per class: collect ours, or stubs may use another name
    _stub_type = None
    background_dht_requests: Collection[asyncio.Task] = ()  # sent without waiting (a mixin's): shutdown waits

    def __init__(
        self,
        *args,
        trigger_grace: float = 0.0,
        handler_address: multiprocessing.sharedctypes.SynchronizedArray | None = None,
        start: bool = False,
        **kwargs,
    ):
        """``handler_address``: shared by every averager this peer starts (see add_p2p_handlers); ``start``: as
        hivemind's, through start_in_background."""
        self.trigger_grace = trigger_grace
        self._handler_address = handler_address if handler_address is not None else multiprocessing.Array("c", 1024)
        self._live_steps: set[asyncio.Task] = set()
        self._no_group_fails_at_once = False  # installed by the first _step (averager process)
        super().__init__(*args, start=False, **kwargs)
        if start:
            self.start_in_background(START_TIMEOUT_S)

    # --- in the averager process ---
    def run(self) -> None:
        """Averager process. Ignore SIGINT here rather than in the parent (hivemind's run_in_background does the
        latter, so that the child inherits it): Ctrl-C reaches the whole process group, and the trainer shuts us
        down in order. Decode 8-bit parts with the NumPy 2 fix, finish parts without the cancelled-future error;
        do not log rounds without a group as errors, nor a departed groupmate with a traceback."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        end_with_parent()  # a SIGKILLed trainer leaves no averager behind
        logging.getLogger("hivemind.averaging.averager").addFilter(_NoGroupIsNoError())
        log_departures_in_one_line()
        with fixed_8bit_decoding(), fixed_part_reducer():
            super().run()

    async def add_p2p_handlers(
        self, p2p: P2P, wrapper: Any = None, *, namespace: str | None = None, balanced: bool = False
    ) -> None:
        """Averager process. hivemind cannot restart an averager on a running DHT: the p2p daemon keeps the
        handlers a killed averager registered and refuses new ones ("handler ... already set"). So each averager
        records the address it registers from, and its successor first removes what was registered from there.
        Upstream: none found (hivemind#501 removes handlers in a clean shutdown only); still so on hivemind's master
        (4bd43b7)."""
        stale = self._handler_address.value.decode()
        if stale:
            self._collect_rpc_handlers()
            names = [self._get_handle_name(namespace, handler.method_name) for handler in self._rpc_handlers]
            await _remove_handlers_of(p2p, names, Multiaddr(stale))
        self._handler_address.value = str(p2p._client_listen_maddr).encode()
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)

    async def _step(self, **kwargs) -> None:
        """Averager process. hivemind creates this task without keeping a reference to it (averager.py, _run), and
        the trigger it awaits is an MPFuture that hivemind holds only by weak reference: while a round awaits its
        trigger, the garbage collector may destroy the whole chain ("Task was destroyed but it is pending!") and the
        round never ends, for us and for our groupmates. Keep the task alive until it finishes.
        A step cancelled while its AllReduce ran (our shutdown cancels every step) has nowhere to put the result:
        hivemind's ``step.set_result`` then raises ``InvalidStateError`` in this task, which nobody awaits ("Task
        exception was never retrieved" and a traceback on a peer stopped with Ctrl-C). Nothing is lost: say so.
        Upstream: none found; still so on hivemind's master (4bd43b7), whose ``asyncio.InvalidStateError`` clause misses
        MPFuture's ``concurrent.futures.InvalidStateError``."""
        task = asyncio.current_task()
        self._live_steps.add(task)
        if not self._no_group_fails_at_once:  # hivemind's _run created _matchmaking before it serves any request
            no_group_fails_at_once(self._matchmaking)
            self._no_group_fails_at_once = True
        try:
            await super()._step(**kwargs)
        except concurrent.futures.InvalidStateError:
            if not kwargs["step"].cancelled():
                raise
            logger.debug("An averaging step was cancelled while its AllReduce ran; its result is dropped")
        finally:
            self._live_steps.discard(task)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Averager process. Groupmates trigger when they are ready, so their parts may arrive before we registered
        the group. hivemind waits for that only while no other group (un)registers; with pipelined rounds one
        always does, and the early sender would get BAD_GROUP_ID and drop us. Wait (bounded) for the group.
        Upstream: none found (the single wait came with hivemind#432); still so on hivemind's master (4bd43b7)."""
        request, arrived = await anext(stream), time.time()
        deadline = time.monotonic() + self.trigger_grace
        while request.group_id not in self._running_groups and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if request.group_id not in self._running_groups:
            self.early_part_refused(arrived)
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    def early_part_refused(self, arrived: float) -> None:
        """Averager process: a groupmate's part for a group we had not registered within ``trigger_grace`` (it
        arrived at ``arrived``, wall clock) is refused now; that groupmate drops us from the group."""

    async def _shutdown(self, timeout: float | None) -> None:
        """Averager process. hivemind's own ``_shutdown`` crashes on running groups and leaves a last DHT request
        behind: see ``averager_shutdown``."""
        await shut_down_averager(self, timeout, dht_requests=self.background_dht_requests)

    # --- in the trainer's process ---
    def start_in_background(self, timeout: float) -> None:
        """Start the averager process and wait (at most `timeout` s) until it serves. hivemind's run_in_background
        sets SIGINT to SIG_IGN in the caller and cannot run outside the main thread (our restarts do)."""
        self.start()
        try:
            self.wait_until_ready(timeout)
        except concurrent.futures.TimeoutError:
            raise AveragerUnresponsive(f"process did not start within {timeout:.0f}s") from None
        self._outer_pipe = LockedConnection(self._outer_pipe)  # after the fork: the parent's side only

    def start_step(self, *, scheduled_time: float, deadline: float, gather: Any, timeout: float) -> StepControl:
        """Begin matchmaking for one round that waits for our trigger (hivemind's ``step(require_trigger=True,
        wait=False, allow_retries=False)``). hivemind's step() then waits for the averager process to acknowledge
        with no timeout (``future_for_init.result()``): a stopped or wedged averager blocks its caller forever.
        The same request with a deadline (`timeout` s); raises AveragerUnresponsive.

        `deadline` (DHT time) ends the matchmaking: by default hivemind looks for a group forever, and a
        groupmate whose averager died while its p2p daemon lives on (a restart, a crash) leaves the others'
        matchmaking stuck for good (a join request to its dead handlers never ends).
        Upstream: none found; still so on hivemind's master (4bd43b7)."""
        data_for_gather = self.serializer.dumps([self.bandwidth, self.mode.value, self.serializer.dumps(gather)])
        step = StepControl(
            scheduled_time=scheduled_time,
            deadline=deadline,
            allow_retries=False,
            weight=1.0,
            data_for_gather=data_for_gather,
        )
        future_for_init = MPFuture()
        self._outer_pipe.send(("_step", [], dict(step=step, future_for_init=future_for_init)))
        try:
            step.attach(*future_for_init.result(timeout=timeout))
        except concurrent.futures.TimeoutError:
            trigger = MPFuture()
            trigger.cancel()
            step.attach(trigger, MPFuture())  # a StepControl without a trigger raises in its __del__
            step.cancel()
            raise AveragerUnresponsive(f"did not start a round within {timeout:.0f}s") from None
        return step

    @contextlib.contextmanager
    def buffers(self, timeout: float) -> Iterator[Sequence[torch.Tensor]]:
        """The averaged tensors under their lock, like get_tensors(); hivemind's waits for the lock forever, and an
        averager killed mid-AllReduce leaves it locked for good. Raises AveragerUnresponsive after `timeout` s.
        Upstream: none found; still so on hivemind's master (4bd43b7)."""
        if not self.lock_averaged_tensors.acquire(timeout=timeout):
            raise AveragerUnresponsive(f"held its buffers for over {timeout:.0f}s")
        try:
            yield self._averaged_tensors
        finally:
            self.lock_averaged_tensors.release()

    def shutdown(self) -> None:
        """Stop the averager process within about shutdown_timeout + 7 s, whatever its state. hivemind's shutdown()
        ends with terminate(): a SIGSTOPped process never handles that SIGTERM, lives on, and multiprocessing joins
        it at interpreter exit, so the program never ends. So continue a stopped process first (see _resume), and
        kill what is left. For a dead process, only stop our state-fetching thread (hivemind's shutdown() would log
        an exception).
        Upstream: none found (hivemind#301 made shutdown graceful); still so on hivemind's master (4bd43b7)."""
        if self.is_alive():
            self._resume()
            super().shutdown()
            self.join(1.0)
        else:
            self._inner_pipe.send(("_SHUTDOWN", None))
        if self.is_alive():
            self.kill()
            self.join(5.0)

    def kill_now(self) -> None:
        """Stop a failed averager at once (it has nothing left to finish): continue it if stopped (see _resume),
        then SIGKILL, the one signal a wedged process cannot miss; stop hivemind's state-fetching thread here."""
        if self.is_alive():
            self._resume()
            self.kill()
            self.join(5.0)
        self._inner_pipe.send(("_SHUTDOWN", None))

    def _resume(self, grace: float = 0.5) -> None:
        """SIGCONT, and a moment to run. hivemind hands every MPFuture's pipe to the DHT process through
        multiprocessing's resource sharer, a thread of the sending process: while the averager is stopped, its
        DHT process blocks waiting for such a handle, and if the averager is killed then, the DHT process dies
        (an EOFError that hivemind's DHT._run does not catch) and takes the peer's DHT with it."""
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        self.join(grace)
