"""DecentralizedSGD: wrap any torch optimizer and keep averaging its parameters with peers in the background.

Built on ``hivemind.DecentralizedAverager`` (hivemind 1.1.12 no longer ships DecentralizedSGD). Compared with the old
design, each round (1) fills the averager with the *latest* local parameters only once its group has formed,
(2) applies the result as a delta (``w += averaged - snapshot``) so local steps made during the round are kept and
(3) looks for the next group while the current AllReduce is still running. Plain PyTorch + hivemind, no VISSL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind's ServicerBase only parses typing hints)

import hivemind
import numpy as np
import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    SizeAdaptiveCompression,
    Uniform8BitQuantization,
)
from hivemind.compression.quantization import Quantization
from hivemind.dht import DHTNode
from hivemind.optim.state_averager import dump_optimizer_state, initialize_optimizer_state_, load_optimizer_state
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time, nested_flatten
from hivemind.utils.asyncio import achain, anext, as_aiter
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)

_FORMED = (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE)
_MIN_PIPELINED_MATCHMAKING = 0.5  # seconds: shortest matchmaking scheduled for a round started during an AllReduce
_REJOIN_CHECK_PERIOD = 10.0  # seconds between checks that our DHT still knows somebody


class _LockedConnection:
    """The averager's control pipe with sends serialized: the trainer and the watcher thread both call step()."""

    def __init__(self, connection: Any):
        self._connection, self._send_lock = connection, threading.Lock()

    def send(self, obj: Any) -> None:
        with self._send_lock:
            self._connection.send(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


def _extract_8bit(self: Quantization, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
    """hivemind 1.1.12's Quantization.extract with one fix: it calls int() on a 1-element array, an error in NumPy 2,
    so every 8-bit part failed to decode and silently stayed un-averaged. Patched in before averagers fork."""
    codebook_size = int(np.frombuffer(serialized_tensor.buffer, count=1, dtype=np.int64)[0])
    codebook = np.frombuffer(serialized_tensor.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
    quantized = np.frombuffer(serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
    quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
    codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
    return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


Quantization.extract = _extract_8bit


def make_compression(name: str) -> CompressionBase:
    """Map the CLI-friendly names onto hivemind compression classes."""
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return Float16Compression()
    if name == "uint8":  # 8-bit quantization needs many values for its statistics: small tensors travel as fp16
        return SizeAdaptiveCompression(2**16, less=Float16Compression(), greater_equal=Uniform8BitQuantization())
    raise ValueError(f"compression must be 'none', 'fp16' or 'uint8', got {name!r}")


@contextlib.contextmanager
def keep_ctrl_c() -> Iterator[None]:
    """hivemind's ``DecentralizedAverager.run_in_background`` sets SIGINT to SIG_IGN in the *calling* process (so
    that its child inherits it): afterwards Ctrl-C no longer stops the trainer. Restore the handler we had."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def schema_fingerprint(tensors: Sequence[torch.Tensor]) -> str:
    """Short hash of shapes/dtypes; put into the prefix so that peers with different models never even meet."""
    schema = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
    return hashlib.sha256(schema.encode()).hexdigest()[:16]


async def _rejoin_if_alone(dht: hivemind.DHT, node: DHTNode) -> int | None:
    """Runs in the DHT process. hivemind's DHT drops peers that stop answering and bootstraps only once, at start:
    after a network outage a peer stays alone for good (and its matchmaking never ends). If our routing table is
    empty, dial the initial peers again and ping them, which puts us back into each other's tables.
    Returns how many initial peers answered, or None when we were not alone."""
    if node.protocol.routing_table.uid_to_peer_id:
        return None
    answered = 0
    for maddr in map(Multiaddr, map(str, dht.initial_peers or ())):
        peer_id = PeerID.from_base58(maddr["p2p"])
        try:
            await node.p2p._client.connect(peer_id, [maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}"))])
            answered += await node.protocol.call_ping(peer_id) is not None
        except Exception as e:  # still unreachable: try again at the next check
            logger.debug(f"rejoin: {maddr} did not answer: {e!r}")
    return answered


class _Averager(hivemind.DecentralizedAverager):
    """A DecentralizedAverager that serves the trainer's live state and tolerates groupmates that trigger first."""

    _rpc_handlers = None  # the base class caches handlers per class: collect ours, or stubs may use another name
    _stub_type = None

    def __init__(self, *args, state_fn: Callable[[], tuple], trigger_grace: float, **kwargs):
        self.state_fn, self.trigger_grace = state_fn, trigger_grace
        self._live_steps: set[asyncio.Task] = set()
        super().__init__(*args, **kwargs)

    def get_current_state(self) -> tuple:
        return self.state_fn()

    async def _step(self, **kwargs) -> None:
        # hivemind creates this task without keeping a reference to it (averager.py, _run), and the trigger it awaits
        # is an MPFuture that hivemind holds only by weak reference: while a round awaits its trigger, the garbage
        # collector may destroy the whole chain ("Task was destroyed but it is pending!") and the round never ends,
        # for us and for our groupmates. Keep the task alive until it finishes.
        task = asyncio.current_task()
        self._live_steps.add(task)
        try:
            await super()._step(**kwargs)
        finally:
            self._live_steps.discard(task)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        # Groupmates trigger at their own step boundaries, so their parts may arrive before we registered the group.
        # hivemind only waits for that while no other group (un)registers; with pipelined rounds one always does,
        # and the early sender would get BAD_GROUP_ID and drop us. So wait (bounded) for the group to appear.
        request = await anext(stream)
        deadline = time.monotonic() + self.trigger_grace
        while request.group_id not in self._running_groups and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _shutdown(self, timeout: float | None) -> None:
        # hivemind 1.1.12 calls .finalize() on the Futures of running groups and crashes; finalize their runners
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for future in self._running_groups.values():
            if future.done() and not future.cancelled():
                future.result().finalize(cancel=True)


@dataclass
class _Round:
    """Book-keeping for one averaging round; times are time.time(), steps are DecentralizedSGD.local_step."""

    index: int
    control: StepControl
    prev_control: StepControl | None  # the round that was running when this one started (pipelining)
    t_start: float
    step_at_start: int
    snapshot: list[torch.Tensor] | None = None  # exact values put into the averager buffers
    t_group_formed: float | None = None
    step_at_group_formed: int | None = None
    formed_during_prev_allreduce: bool = False
    t_triggered: float | None = None
    step_at_snapshot: int | None = None
    t_allreduce_start: float | None = None
    t_end: float | None = None
    weight: float | None = None
    local_nonfinite: bool = False
    stale: bool = False  # params were replaced by load_state_from_peers after the snapshot
    fill_requested: bool = False  # the trainer passed a step boundary after the group formed
    filled: bool = False  # that boundary's params are in the averager's buffers; the trigger follows
    delta_ready: bool | None = None  # buffers hold the update to add (averaged - snapshot); False: not finite
    resolved: bool = False


class DecentralizedSGD:
    """Wraps any torch optimizer; averages params (+ BN buffers) with peers all the time.

    Call ``step()`` (or ``optimizer.step()`` then ``on_step_end()``) once per local step; averaging runs in the
    background and its results are applied at step boundaries in the trainer's thread.

    The contract: change the parameters only while holding ``dsgd.lock`` (``step()`` does; if you call
    ``optimizer.step()`` yourself, do it and ``on_step_end()`` under ``with dsgd.lock:``). At the first step
    boundary after a group formed, the background thread copies them into the averager under that lock while the
    trainer computes its next step; late joiners download them under it too, so neither sees half an update.
    LR schedulers should be given ``dsgd.optimizer``.

    Non-finite values: a peer whose own snapshot is not finite contributes zeros with weight 0 (its groupmates
    average without it) and keeps its local params; a round whose averaged result is not finite is discarded.
    A peer that stops calling on_step_end joins at most one group without triggering it; its groupmates drop it
    after ``next_chunk_timeout``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dht: hivemind.DHT,
        *,
        prefix: str,
        model: torch.nn.Module | None = None,
        target_group_size: int = 4,
        min_group_size: int = 2,
        min_matchmaking_time: float = 5.0,
        request_timeout: float = 3.0,
        allreduce_timeout: float = 60.0,
        next_chunk_timeout: float = 10.0,
        max_staleness: int | None = None,
        staleness_timeout: float = 60.0,
        average_buffers: bool = True,
        average_optimizer_state: bool = False,
        weight_by_samples: bool = False,
        compression: str = "none",
        delta_rule: bool = True,
        refresh_before_allreduce: bool = True,
        pipeline: bool = True,
        records_path: str | None = None,
        client_mode: bool | None = None,
        get_extra_state: Callable[[], dict] | None = None,
        before_allreduce: Callable[[], None] | None = None,
        verbose: bool = False,
        start: bool = True,
    ):
        assert "." not in prefix, "prefix may not contain '.'"
        self.optimizer, self.dht, self.model = optimizer, dht, model
        self.min_matchmaking_time, self.next_chunk_timeout = min_matchmaking_time, next_chunk_timeout
        self.allreduce_timeout = allreduce_timeout
        self.max_staleness, self.staleness_timeout = max_staleness, staleness_timeout
        self.weight_by_samples, self.delta_rule = weight_by_samples, delta_rule
        self.refresh_before_allreduce, self.pipeline = refresh_before_allreduce, pipeline
        self.records_path, self.get_extra_state = records_path, get_extra_state
        self.before_allreduce = before_allreduce  # hivemind has no such hook: run right before the buffers are filled
        self.verbose = verbose

        self.lock = threading.RLock()  # guards local params/optimizer: trainer step vs. serving state to peers
        self.local_step = self.samples = 0
        self.records: list[dict] = []
        self.counters: dict[str, float] = dict.fromkeys(
            ("rounds_applied", "rounds_failed", "rounds_no_group", "rounds_discarded_nonfinite",
             "rounds_skipped_local_nonfinite", "rounds_cancelled", "ssp_waits", "ssp_timeouts", "ssp_wait_s",
             "trainer_s", "dht_rejoins"), 0
        )  # fmt: skip
        self._rounds: deque[_Round] = deque()  # oldest first; at most two: one in AllReduce, one matchmaking
        # _rounds is changed by the trainer (under self.lock) and by the watcher, which starts the next round as soon
        # as the current one's AllReduce began; both hold _rounds_lock while they change it (order: lock, then this)
        self._rounds_lock = threading.Lock()
        self._watched: tuple[_Round, ...] = ()
        self._num_rounds = self._last_sync_step = self._samples_since_fill = 0
        self._starting = False  # a round is being launched (the averager RPC runs outside _rounds_lock)
        self._round_wanted = False  # the trainer stepped with no round in flight: the watcher starts one
        self._rejoin_future: Any = None
        self._allreduce_ema: float | None = None
        self._closed, self._stop, self._observe_lock = False, threading.Event(), threading.Lock()
        self._wake = threading.Event()  # the trainer filled a round: the watcher should trigger it now
        # the averager's buffers are shared by the trainer (fill, apply) and the watcher (trigger, prepare the delta)
        self._buffers_lock = threading.Lock()

        # what we average: the params (fixed objects), float buffers by name, param-shaped optimizer state by key
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._buffer_names = [
            name for name, buf in (model.named_buffers() if model is not None and average_buffers else ())
            if buf.is_floating_point()
        ]  # fmt: skip
        if average_optimizer_state and not any(optimizer.state.values()):
            self._init_optimizer_state()
        self._opt_keys = [
            (i, key) for i, p in enumerate(self._params) for key, value in sorted(optimizer.state.get(p, {}).items())
            if average_optimizer_state and key != "step" and torch.is_tensor(value)
            and value.is_floating_point() and value.shape == p.shape
        ]  # fmt: skip
        local = self._local_tensors()
        self.prefix = f"{prefix}_{schema_fingerprint(local)}"
        self.averager = _Averager(
            [torch.zeros(t.shape, dtype=torch.float32) for t in local],
            dht,
            start=False,
            prefix=self.prefix,
            target_group_size=target_group_size,
            min_group_size=min_group_size,
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            compression=make_compression(compression),
            client_mode=client_mode,
            state_fn=self._serve_state,
            trigger_grace=next_chunk_timeout,
        )
        # the exact values put into the averager for the round in flight: only the oldest round fills, and its
        # snapshot is released when it resolves, so one preallocated set serves every round (no clone per round)
        self._snapshot_buffers = [torch.zeros(t.shape, dtype=torch.float32) for t in local]
        self._watcher = threading.Thread(target=self._watch, name="dsgd-watcher", daemon=True)
        if start:
            self.start()

    # --- torch.optim.Optimizer passthrough ---
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        with self.lock:
            self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        logger.warning("Parameters added after DecentralizedSGD was created are trained locally but not averaged")
        self.optimizer.add_param_group(param_group)

    @property
    def peer_id(self) -> PeerID:
        return self.dht.peer_id

    def start(self) -> None:
        """Start the averager process (only needed if created with start=False)."""
        with keep_ctrl_c():
            self.averager.run_in_background(await_ready=True)
        self.averager._outer_pipe = _LockedConnection(self.averager._outer_pipe)  # after the fork: parent side only
        self._watcher.start()

    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:
        with self.lock:  # one hold: the step and its count are seen together by the watcher and by late joiners
            loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
            self._count_step_and_poll(batch_size)
        self._enforce_staleness_bound()
        return loss

    def on_step_end(self, batch_size: int | None = None) -> None:
        """Call once per local step, after the optimizer step (VISSL hooks call this when they don't use .step()).
        Polls the averager: applies a finished round (delta rule), fills+triggers a formed group with fresh params,
        schedules the next matchmaking, enforces max_staleness. Cheap when nothing happened (no tensor copies)."""
        with self.lock:
            self._count_step_and_poll(batch_size)
        self._enforce_staleness_bound()

    def _count_step_and_poll(self, batch_size: int | None) -> None:
        t0 = time.perf_counter()
        self.local_step += 1
        self.samples += batch_size or 1
        self._samples_since_fill += batch_size or 1
        self._poll()
        self.counters["trainer_s"] += time.perf_counter() - t0  # what averaging costs the training loop

    def _enforce_staleness_bound(self) -> None:
        if self.max_staleness is not None and self.local_step - self._last_sync_step > self.max_staleness:
            self._wait_for_round()

    # --- the round state machine (trainer thread) ---
    def _poll(self) -> None:
        if self._closed or not self.averager.is_alive():
            return
        while self._rounds and self._rounds[0].control.done():
            if self._delta_pending(self._rounds[0]):  # the watcher is preparing it: apply at a later step
                self._wake.set()
                break
            self._resolve(self._pop_head())
        if self._rounds:  # only the oldest round may touch the buffers: a newer one waits for its result
            head = self._rounds[0]
            self._observe(head)
            if head.t_triggered is None and head.control.stage == AveragingStage.AWAITING_TRIGGER:
                if time.time() - (head.t_group_formed or time.time()) > self.next_chunk_timeout:
                    head.control.cancel()  # groupmates have dropped us by now; triggering would only stall us
                    self._resolve(self._pop_head())
                elif not head.fill_requested:  # the watcher copies this step boundary's params while we compute
                    head.fill_requested = True
                    self._wake.set()
        if not self._rounds and not self._round_wanted:  # the watcher starts it: the RPC never blocks the trainer
            self._round_wanted = True
            self._wake.set()

    def _delta_pending(self, r: _Round) -> bool:
        """A finished round whose update the watcher has not prepared yet (but will: give it a moment, at most a
        second, after which the trainer prepares it itself)."""
        if r.delta_ready is not None or r.stale or r.local_nonfinite or r.t_triggered is None:
            return False
        if r.control.cancelled() or r.control.exception() is not None:
            return False
        return r.t_end is None or time.time() - r.t_end < 1.0

    def _pop_head(self) -> _Round:
        with self._rounds_lock:
            r = self._rounds.popleft()
            self._watched = tuple(self._rounds)
        return r

    def _claim_next_round(self) -> float | None:
        """Watcher, under _rounds_lock: the matchmaking delay of a round to start now, or None. A claim must be
        followed by _launch_round; one launch at a time. With no round in flight, a round starts only when the
        trainer asked for one at a step: a peer whose trainer stalls stops joining groups (its groupmates would
        wait for its trigger)."""
        if self._starting or self._closed:
            return None
        if not self._rounds:
            delay = self.min_matchmaking_time if self._round_wanted else None
            self._round_wanted = False
        else:
            delay = self._pipelined_delay()
        self._starting = delay is not None
        return delay

    def _pipelined_delay(self) -> float | None:
        """Pipelining: once the only round's group has formed (hivemind's matchmaking is free again), look for the
        next group, scheduled to form about when this round's AllReduce ends (expected remaining time from the EMA
        of past AllReduce durations). The next round is triggered only after this round's result is applied."""
        if not (self.pipeline and len(self._rounds) == 1):
            return None
        head = self._rounds[0]
        if head.t_group_formed is None and not head.control.began_allreduce:
            return None
        if self._allreduce_ema is None:
            remaining = 0.0
        else:
            started = head.t_allreduce_start if head.t_allreduce_start is not None else time.time()
            remaining = max(self._allreduce_ema - (time.time() - started), 0.0)
        # hivemind never lets a group that is not full form before min_matchmaking_time (matchmaking.py): a full
        # group forms as early as this schedule, with a short floor so that groupmates a few ms apart still meet
        return max(remaining, min(self.min_matchmaking_time, _MIN_PIPELINED_MATCHMAKING))

    def _launch_round(self, delay: float) -> None:
        """Watcher, after a claim: ask the averager process for a step (an RPC of up to a few hundred ms on a busy
        machine, done outside _rounds_lock so that the trainer never waits for it), then queue the round."""
        t_start, step_at_start, snapshot = time.time(), self.local_step, None
        if not self.refresh_before_allreduce:  # ablation, the old behaviour: snapshot when matchmaking starts
            with self.lock, torch.no_grad():  # between two trainer steps
                snapshot = [t.detach().to("cpu", torch.float32, copy=True) for t in self._local_tensors()]
                step_at_start = self.local_step
        try:
            control = self.averager.step(
                scheduled_time=get_dht_time() + delay, require_trigger=True, allow_retries=False, wait=False
            )
        except BaseException:
            with self._rounds_lock:
                self._starting = False
            raise
        control.add_done_callback(lambda _: self._wake.set())  # the watcher prepares the result right away
        with self._rounds_lock:
            self._starting = False
            if self._closed:
                control.cancel()
                return
            prev = self._rounds[-1].control if self._rounds else None
            r = _Round(self._num_rounds, control, prev, t_start, step_at_start)
            self._num_rounds += 1
            if snapshot is not None:
                r.snapshot, r.step_at_snapshot = snapshot, step_at_start
            self._rounds.append(r)
            self._watched = tuple(self._rounds)

    def _fill(self, r: _Round) -> bool:
        """Watcher thread, right after the trainer's first step boundary since the group formed: copy the params
        into the averager while the trainer computes its next step. Under self.lock, which the trainer holds
        whenever it changes them (optimizer step, apply), so the copy is exactly that step boundary's. Only the
        oldest round fills: a newer one waits until its predecessor's result is applied."""
        if r.filled or not r.fill_requested or not self._rounds or self._rounds[0] is not r:
            return False
        with self.lock:
            if r.filled or self._closed or not self._rounds or self._rounds[0] is not r:
                return False
            if self.before_allreduce is not None:
                self.before_allreduce()
            source = r.snapshot if r.snapshot is not None else self._local_tensors()
            with self._buffers_lock, torch.no_grad(), self.averager.get_tensors() as buffers:
                self._copy(buffers, source)
            r.weight = float(max(self._samples_since_fill, 1) if self.weight_by_samples else 1)
            self._samples_since_fill = 0
            if r.step_at_snapshot is None:
                r.step_at_snapshot = self.local_step
            r.filled = True
        return True

    def _trigger(self, r: _Round) -> None:
        """Watcher thread: check and keep the filled values, then let the AllReduce begin."""
        with self._buffers_lock, torch.no_grad(), self.averager.get_tensors() as buffers:
            if r.t_triggered is not None or r.resolved or r.control.done():
                return
            r.local_nonfinite = not self._all_finite(buffers)  # checked on the CPU copies: no GPU syncs
            if r.local_nonfinite:  # contribute zeros with weight 0 rather than poison the group
                logger.warning(f"Round {r.index}: local params are not finite, contributing with weight 0")
                torch._foreach_zero_(buffers)
                r.weight = 0.0
            if r.snapshot is None:
                torch._foreach_copy_(self._snapshot_buffers, buffers)
                r.snapshot = self._snapshot_buffers
            r.control.weight = r.weight
            r.t_triggered = time.time()
            r.control.allow_allreduce()

    def _prepare_delta(self, r: _Round) -> None:
        """Turn the averaged buffers into the update to add (averaged - snapshot) and check it is finite; the watcher
        does this as soon as the AllReduce ends, so that applying costs the trainer a single add."""
        with self._buffers_lock:
            if r.delta_ready is not None or r.resolved or r.stale or r.local_nonfinite or r.t_triggered is None:
                return
            if not r.control.done() or r.control.cancelled() or r.control.exception() is not None:
                return
            with torch.no_grad(), self.averager.get_tensors() as buffers:
                if self.delta_rule:  # the snapshot is finite, so the delta is iff the average is
                    torch._foreach_sub_(buffers, r.snapshot)
                r.delta_ready = self._all_finite(buffers)

    def _resolve(self, r: _Round) -> None:
        """Record a finished (or cancelled) round and apply its result if it is usable."""
        self._observe(r)
        record = self._base_record(r)
        try:
            group = r.control.result()
            record.update(group_size=len(group), group=[str(peer) for peer in group])
            if r.stale or r.local_nonfinite:
                record["error"] = "state reloaded since snapshot" if r.stale else "local snapshot not finite"
                self.counters["rounds_skipped_local_nonfinite"] += r.local_nonfinite
            elif self._apply(r):
                record["applied"] = True
            else:
                record["error"] = "averaged result not finite"
                self.counters["rounds_discarded_nonfinite"] += 1
                logger.warning(f"Round {r.index}: averaged result is not finite, keeping local params")
        except (Exception, asyncio.CancelledError) as e:
            record["error"] = repr(e)
            if r.control.cancelled():
                self.counters["rounds_cancelled"] += 1
            else:
                self.counters["rounds_failed" if r.t_group_formed else "rounds_no_group"] += 1
        if record["applied"]:
            self.counters["rounds_applied"] += 1
            self._last_sync_step = self.local_step
            if record["allreduce_s"] is not None:
                ema, new = self._allreduce_ema, record["allreduce_s"]
                self._allreduce_ema = new if ema is None else 0.7 * ema + 0.3 * new
            if not self.averager.client_mode:  # let late joiners prefer the most trained peer
                self.averager.state_sharing_priority = float(self.local_step)
        with self._buffers_lock:
            r.resolved, r.snapshot = True, None
        self.records.append(record)
        if self.records_path is not None:
            with open(self.records_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.verbose:
            logger.info(f"DecentralizedSGD round: {record}")

    def _apply(self, r: _Round) -> bool:
        """Apply the averaged buffers: w <- w + averaged - snapshot (or overwrite without delta_rule)."""
        self._prepare_delta(r)  # normally the watcher has done it already
        if not r.delta_ready:
            return False
        # the round is finished: the buffers are ours until the next fill overwrites them
        with self._buffers_lock, torch.no_grad(), self.averager.get_tensors() as buffers:
            if not self.delta_rule:
                self._copy(self._local_tensors(), buffers)
                return True
            local = self._local_tensors()
            if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in local):
                torch._foreach_add_(local, buffers)
            else:
                for t, delta in zip(local, buffers, strict=True):
                    t.add_(delta.to(t.device, t.dtype))
        return True

    @staticmethod
    def _copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        assert len(dst) == len(src)
        if all(a.device == b.device and a.dtype == b.dtype for a, b in zip(dst, src, strict=True)):
            torch._foreach_copy_(list(dst), list(src))
        else:
            for a, b in zip(dst, src, strict=True):
                a.copy_(b)

    @staticmethod
    def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
        """One pass per tensor, one sync: an L2 norm is nan/inf iff an element is (or exceeds ~1e19, whose square
        overflows: no trained weight is that large, so it is rejected too). ~15x faster than isfinite or max |x|."""
        tensors = [t for t in tensors if t.numel() > 0]
        if not tensors:
            return True
        return bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all())

    def _wait_for_round(self) -> None:
        """SSP: block until a round is applied, at most staleness_timeout seconds."""
        t0 = time.monotonic()
        self.counters["ssp_waits"] += 1
        while self.local_step - self._last_sync_step > self.max_staleness and not self._closed:
            if time.monotonic() - t0 > self.staleness_timeout:
                logger.warning(
                    f"SSP: no round applied for {self.local_step - self._last_sync_step} steps and "
                    f"{self.staleness_timeout}s, continuing without averaging"
                )
                self.counters["ssp_timeouts"] += 1
                self._last_sync_step = self.local_step
                break
            time.sleep(0.01)
            with self.lock:
                self._poll()
        self.counters["ssp_wait_s"] += time.monotonic() - t0

    # --- timestamps for records (trainer thread and watcher thread; shared-memory reads only) ---
    def _observe(self, r: _Round) -> None:
        with self._observe_lock:
            stage = r.control.stage
            if r.t_group_formed is None and (stage in _FORMED or r.control.began_allreduce):
                r.t_group_formed, r.step_at_group_formed = time.time(), self.local_step
                # stage was read before prev.done(): if prev still runs, this group formed during its AllReduce
                r.formed_during_prev_allreduce = r.prev_control is not None and not r.prev_control.done()
            if r.t_allreduce_start is None and r.control.began_allreduce:
                r.t_allreduce_start = time.time()
            if r.t_end is None and r.control.done():
                r.t_end = time.time()

    def _watch(self) -> None:
        """Background thread: timestamps, trigger of filled rounds, delta preparation, pipelined matchmaking,
        and a periodic check that the DHT still knows somebody."""
        next_rejoin_check = time.monotonic() + _REJOIN_CHECK_PERIOD
        while not self._stop.is_set():
            self._wake.wait(0.02)
            self._wake.clear()
            try:
                for r in self._watched:
                    self._observe(r)
                    if r.fill_requested and not r.filled:
                        self._fill(r)
                    if r.filled and r.t_triggered is None:
                        self._trigger(r)
                    if r.t_end is not None:
                        self._prepare_delta(r)
                if self.averager.is_alive():
                    with self._rounds_lock:
                        delay = self._claim_next_round()
                    if delay is not None:
                        self._launch_round(delay)
                if time.monotonic() > next_rejoin_check:
                    next_rejoin_check = time.monotonic() + _REJOIN_CHECK_PERIOD
                    self._check_dht_connected()
            except Exception as e:  # the averager may be shutting down; the trainer retries at its next step
                logger.debug(f"watcher: {e!r}")

    def _check_dht_connected(self) -> None:
        """Watcher thread, every few seconds: if our DHT lost every peer (network outage), rejoin via initial peers."""
        if self._rejoin_future is not None and not self._rejoin_future.done():
            return
        if self._rejoin_future is not None and not self._rejoin_future.exception():
            answered = self._rejoin_future.result()
            if answered is not None:
                self.counters["dht_rejoins"] += bool(answered)
                logger.warning(f"Our DHT had lost every peer; rejoined through {answered} initial peer(s)"
                               if answered else "Our DHT has lost every peer and no initial peer answers yet")
        self._rejoin_future = self.dht.run_coroutine(_rejoin_if_alone, return_future=True)

    def _base_record(self, r: _Round) -> dict:
        """One JSON-able dict per resolved round; t_applied/step_at_apply: when the trainer processed the result."""

        def span(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else b - a

        return dict(
            round=r.index, group_size=None, group=None, applied=False, error=None, weight=r.weight,
            matchmaking_s=span(r.t_start, r.t_group_formed), awaiting_trigger_s=span(r.t_group_formed, r.t_triggered),
            allreduce_s=span(r.t_allreduce_start, r.t_end), t_start=r.t_start, t_group_formed=r.t_group_formed,
            t_triggered=r.t_triggered, t_allreduce_start=r.t_allreduce_start, t_end=r.t_end, t_applied=time.time(),
            step_at_start=r.step_at_start, step_at_group_formed=r.step_at_group_formed,
            step_at_snapshot=r.step_at_snapshot, step_at_apply=self.local_step,
            staleness_steps=None if r.step_at_snapshot is None else self.local_step - r.step_at_snapshot,
            formed_during_prev_allreduce=r.formed_during_prev_allreduce, peer=str(self.peer_id),
        )  # fmt: skip

    def last_record(self) -> dict | None:
        return self.records[-1] if self.records else None

    def last_applied_record(self) -> dict | None:
        return next((record for record in reversed(self.records) if record["applied"]), None)

    # --- local tensors and state sharing ---
    def _local_tensors(self) -> list[torch.Tensor]:
        """Current references (optimizer.load_state_dict may replace state tensors) in the averager's order."""
        buffers = dict(self.model.named_buffers()) if self._buffer_names else {}
        return (
            self._params
            + [buffers[name] for name in self._buffer_names]
            + [self.optimizer.state[self._params[i]][key] for i, key in self._opt_keys]
        )

    def _init_optimizer_state(self) -> None:
        """Create lazily-initialized optimizer state (e.g. momentum) with a zero-gradient step; params are kept."""
        with torch.no_grad():
            backup = [p.detach().clone() for p in self._params]
            initialize_optimizer_state_(self.optimizer)
            for p, saved in zip(self._params, backup, strict=True):
                p.copy_(saved)

    def _serve_state(self) -> tuple[dict, list[torch.Tensor], None]:
        """Runs in hivemind's background thread when a peer downloads our state; copies under the trainer lock."""
        with self.lock, torch.no_grad():
            params = [p.detach().to("cpu", copy=True) for p in self._params]
            buffers = [b.detach().to("cpu", copy=True) for b in (self.model.buffers() if self.model else ())]
            opt_metadata, opt_tensors = dump_optimizer_state(self.optimizer)
            opt_tensors = [t.clone() for t in opt_tensors]
            metadata = dict(
                local_step=self.local_step, samples=self.samples, num_params=len(params), num_buffers=len(buffers),
                optimizer=opt_metadata, extra_state=self.get_extra_state() if self.get_extra_state else {},
            )  # fmt: skip
        return metadata, params + buffers + opt_tensors, None

    def load_state_from_peers(
        self, timeout: float | None = None, accept: Callable[[dict], bool] | None = None
    ) -> dict | None:
        """Download params/buffers/optimizer state/progress from a peer.

        Returns the donor's extra-state dict (its training progress, see get_extra_state) or None if nobody answered
        or ``accept(extra_state)`` said no (e.g. the donor is not ahead of our checkpoint): then nothing changes.
        The optimizer's hyperparameters (lr, momentum...) and local_step are taken over from the donor too.
        """
        timeout = self.allreduce_timeout if timeout is None else timeout
        try:
            loaded = self.averager.load_state_from_peers(timeout=timeout)
        except TimeoutError:
            loaded = None
        if loaded is None:
            logger.info("load_state_from_peers: no peer could share its state")
            return None
        metadata, tensors = loaded
        num_params, num_buffers = metadata["num_params"], metadata["num_buffers"]
        local_buffers = list(self.model.buffers()) if self.model is not None else []
        params, buffers = tensors[:num_params], tensors[num_params : num_params + num_buffers]
        if [p.shape for p in params] != [p.shape for p in self._params] or (
            [b.shape for b in buffers] != [b.shape for b in local_buffers]
        ):
            logger.warning("load_state_from_peers: the peer's model does not match ours, ignoring its state")
            return None
        if accept is not None and not accept(metadata.get("extra_state") or {}):
            logger.info("load_state_from_peers: keeping our own state (the peer's was not accepted)")
            return None
        with self.lock, torch.no_grad():
            opt_metadata, opt_tensors = metadata["optimizer"], tensors[num_params + num_buffers :]
            if not any(self.optimizer.state.values()):
                self._init_optimizer_state()  # the peer's momentum etc. needs a place to go
            if len(opt_metadata) == len(list(nested_flatten(self.optimizer.state_dict()))):
                load_optimizer_state(self.optimizer, opt_metadata, opt_tensors)
            else:
                logger.warning("load_state_from_peers: optimizer state layout differs, keeping local optimizer state")
            for local, loaded_tensor in zip(self._params + local_buffers, params + buffers, strict=True):
                local.copy_(loaded_tensor)
            self.local_step = self._last_sync_step = int(metadata["local_step"])
            self.samples = int(metadata["samples"])
            with self._rounds_lock:  # the watcher may append a round meanwhile
                rounds = tuple(self._rounds)
            for r in rounds:
                r.stale = r.stale or r.filled or r.snapshot is not None  # their delta is against the old params
        return metadata.get("extra_state") or {}

    # --- lifecycle ---
    def shutdown(self) -> None:
        """Cancel pending rounds and stop the averager; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        with self.lock, self._rounds_lock:  # the watcher starts no round once _closed is set
            for r in self._rounds:
                if not r.control.done():
                    r.control.cancel()
            self._rounds.clear()
            self._watched = ()
        if self._watcher.is_alive():
            self._watcher.join()
        if self.averager.is_alive():
            self.averager.shutdown()
        self.averager.state_fn = lambda: (None, [], None)  # drop the reference cycle to self

    def __enter__(self) -> DecentralizedSGD:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
