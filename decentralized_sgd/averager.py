"""The averager process: hivemind's ``DecentralizedAverager`` with our work-arounds; built with hivemind's arguments
only, it is hivemind's. DecentralizedSGD adds ``state_fn`` (live state for joiners), AllReduce stamps, the ``guard``
that vets groups and the slow-peer fixes. Not ``TrainingStateAverager(delta_rule_averaging=True)``: it runs
``optimizer.step()`` itself (VISSL steps LARC/AMP), allows no overlapping rounds, serves state under the buffers' lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import multiprocessing as mp
import multiprocessing.sharedctypes
import os
import signal
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind's ServicerBase only parses typing hints)

import hivemind
import torch
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import achain, anext, as_aiter

from . import hivemind_fixes as fixes
from .hivemind_fixes import AveragerUnresponsive, LockedConnection, end_with_parent
from .hivemind_slow_peer_fixes import SharedCounts, install_slow_peer_fixes
from .vetting import GroupGuard

START_TIMEOUT_S = 120.0  # Averager(start=True): how long it may take to start (hivemind waits for ever)


def handler_address_slot() -> multiprocessing.sharedctypes.SynchronizedArray:
    """Shared memory for the address an averager registers its handlers from: one per peer, for each restart."""
    return mp.Array(ctypes.c_char, 1024)


class Averager(hivemind.DecentralizedAverager):
    """hivemind's averager, fixed; ``state_fn()`` (``(metadata, tensors, infos)``) is what joiners download,
    ``guard`` vets its groups (None: nobody does), ``slow_peer_fixes=False`` keeps hivemind's matchmaking."""

    _rpc_handlers = None  # hivemind caches handlers per class; the names "<prefix>::Averager.rpc_*" are the protocol
    _stub_type = None

    def __init__(
        self,
        *args: Any,
        start: bool = False,
        state_fn: Callable[[], tuple] | None = None,
        trigger_grace: float = 0.0,
        handler_address: multiprocessing.sharedctypes.SynchronizedArray | None = None,
        slow_peer_fixes: bool = True,
        slow_peer_counts: SharedCounts | None = None,
        guard: GroupGuard | None = None,
        **kwargs: Any,
    ):
        self.state_fn, self.trigger_grace = state_fn, trigger_grace
        self._handler_address = handler_address if handler_address is not None else handler_address_slot()
        self.guard = guard
        self._slow_peer_counts = (slow_peer_counts or SharedCounts()) if slow_peer_fixes else None
        self._withdrawals: Collection[asyncio.Task] = ()  # the slow-peer fixes' DHT requests still on their way
        self._stamps = torch.zeros(3, dtype=torch.float64).share_memory_()  # AllReduce began, ended; refused part
        self._live_steps: set[asyncio.Task] = set()
        self._installed = False  # the averager process's fixes on hivemind's objects (see _step)
        super().__init__(*args, start=False, **kwargs)
        if start:
            self.start_in_background(START_TIMEOUT_S)

    # --- averager process ---
    def run(self) -> None:
        """Ignore SIGINT (the trainer shuts us down in order); end with the trainer, even a SIGKILLed one."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        end_with_parent()
        fixes.quiet_hivemind_logs()
        super().run()

    async def add_p2p_handlers(
        self, p2p: P2P, wrapper: Any = None, *, namespace: str | None = None, balanced: bool = False
    ) -> None:
        """Remove the handlers a killed predecessor left in the p2p daemon first (see fixes.remove_handlers_of)."""
        stale = self._handler_address.value.decode()
        if stale:
            self._collect_rpc_handlers()
            names = [self._get_handle_name(namespace, handler.method_name) for handler in self._rpc_handlers]
            await fixes.remove_handlers_of(p2p, names, stale)
        self._handler_address.value = str(p2p._client_listen_maddr).encode()
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)

    async def _step(self, **kwargs: Any) -> None:
        """The first step installs the fixes on hivemind's matchmaking; every step is held until it ends."""
        if not self._installed:
            fixes.no_group_fails_at_once(self._matchmaking)
            if self._slow_peer_counts is not None:
                self._state_updated, self._withdrawals = install_slow_peer_fixes(
                    self._matchmaking, self._state_updated, self._slow_peer_counts
                )
            self._installed = True
        async with fixes.hold_step(self._live_steps, kwargs["step"]):
            await super()._step(**kwargs)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        refusal = None if self.guard is None else self.guard.refuse_join(self.serializer, request, context.remote_id)
        if refusal is not None:
            yield refusal
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        """hivemind calls this once a group formed. The guard's verdict (the same in every member) decides whom we
        average with; a group we are refused from, or left alone in, runs no AllReduce (and stamps none)."""
        if self.guard is None:
            return await self._allreduce(group_info, min_vector_size, **kwargs)
        gathered, kept = self.guard.vet(self.serializer, group_info, self.peer_id)
        if kept is None:
            self._running_groups[group_info.group_id].cancel()  # registered by hivemind: ends without an AllReduce
        else:
            await self._allreduce(kept, min_vector_size, **kwargs)
        return gathered  # the whole group's: the trainer reaches the same verdict (vetting.RoundVetting.judge)

    async def _allreduce(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        self._stamps[0] = time.time()
        try:
            return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        finally:
            self._stamps[1] = time.time()

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate's part may arrive before we registered the group (see fixes.wait_for_group)."""
        request, arrived = await anext(stream), time.time()
        if not await fixes.wait_for_group(self._running_groups, request.group_id, self.trigger_grace):
            self._stamps[2] = max(arrived, float(self._stamps[2]))
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _shutdown(self, timeout: float | None) -> None:
        await fixes.shut_down_averager(self, timeout, dht_requests=self._withdrawals)

    # --- trainer's process ---
    def allreduce_stamps(self) -> tuple[float, float]:
        """(began, ended) of the latest AllReduce (time.time()); ended < began while it runs."""
        began, ended = self._stamps[:2].tolist()
        return began, ended

    def early_part_refused_at(self) -> float:
        """When the latest groupmate's part that we refused arrived (time.time()); 0.0: none."""
        return float(self._stamps[2])

    def get_current_state(self) -> tuple:
        """hivemind's state-serving thread, when a peer downloads our state."""
        return self.state_fn() if self.state_fn is not None else super().get_current_state()

    def start_in_background(self, timeout: float) -> None:
        """Start, wait at most `timeout` s until it serves (hivemind's run_in_background ignores SIGINT in the caller
        and needs the main thread)."""
        self.start()
        try:
            self.wait_until_ready(timeout)
        except concurrent.futures.TimeoutError:
            raise AveragerUnresponsive(f"process did not start within {timeout:.0f}s") from None
        self._outer_pipe = LockedConnection(self._outer_pipe)  # after the fork: the parent's side only

    def start_step(self, *, scheduled_time: float, deadline: float, gather: Any, timeout: float) -> StepControl:
        """hivemind's ``step(require_trigger=True, wait=False, allow_retries=False)`` with deadlines: for the
        process's acknowledgement (`timeout`) and for matchmaking (`deadline`, DHT time); hivemind waits for ever."""
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
        """``get_tensors()`` with a deadline: an averager killed mid-AllReduce leaves the lock taken for good."""
        if not self.lock_averaged_tensors.acquire(timeout=timeout):
            raise AveragerUnresponsive(f"held its buffers for over {timeout:.0f}s")
        try:
            yield self._averaged_tensors
        finally:
            self.lock_averaged_tensors.release()

    def shutdown(self) -> None:
        """Stop within about shutdown_timeout + 7 s, even a SIGSTOPped process (hivemind's SIGTERM never reaches it):
        continue it first, kill what is left; for a dead one, only stop our state-serving thread."""
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
        """Stop a failed averager at once: continue it if stopped, then SIGKILL."""
        if self.is_alive():
            self._resume()
            self.kill()
            self.join(5.0)
        self._inner_pipe.send(("_SHUTDOWN", None))

    def _resume(self, grace: float = 0.5) -> None:
        """SIGCONT, and a moment to run: the DHT process may wait for a pipe handle from it (dies if it is killed)."""
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        self.join(grace)
