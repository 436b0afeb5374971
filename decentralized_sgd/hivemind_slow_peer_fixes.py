"""Slow peers, an optional part: hivemind 1.1.12 work-arounds that keep healthy peers at their pace beside an
overloaded groupmate, whose time is lost in hivemind's DHT (every store waits for every replica; a slow node is never
late enough to be blacklisted), not in the AllReduce. Fixes: 1. ``CoalescedEvent``, 2. ``BackgroundDeclarations``,
3. ``LeaderAvoidance``, 4. ``SlowReplyBlacklist``; 3 and 4 judge a node against the others (``RelativeLateness``: a
swarm slow everywhere has no slow peer) and never exclude more than a share at once."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import hivemind
import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

STATE_DECLARE_MIN_PERIOD = 1.0  # seconds between two DHT stores of our state-sharing declaration (fix 1)
SLOW_PEER_COUNTS = (
    "slow_leader_timeouts",  # join requests a leader left unanswered for request_timeout (each: avoid it longer)
    "slow_leader_requests_skipped",  # join requests not sent, to a leader we avoid
    "slow_dht_node_bans",  # times our DHT blacklisted a node that answers late
)


class SharedCounts:
    """Counts that the averager and DHT processes add to and the trainer reads: a float64 tensor in torch's shared
    memory, still shared after a fork or pickling through hivemind's pipes. One writing process per name."""

    def __init__(self, names: Sequence[str] = SLOW_PEER_COUNTS):
        self.names = tuple(names)
        self._values = torch.zeros(len(self.names), dtype=torch.float64).share_memory_()

    def add(self, name: str, amount: float = 1.0) -> None:
        self._values[self.names.index(name)] += amount

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.names, self._values.tolist(), strict=True))


class CoalescedEvent(asyncio.Event):
    """An asyncio.Event whose set() wakes waiters at most once per `period` s (a set() in between is delayed, never
    lost): hivemind sets ``_state_updated`` per tensor (averager.py, hivemind#398), storing a declaration each."""

    def __init__(self, period: float):
        super().__init__()
        self.period, self._last_set, self._pending = period, -math.inf, None

    def set(self) -> None:
        now = time.monotonic()
        if now - self._last_set >= self.period:
            self._last_set = now
            super().set()
        elif self._pending is None:
            self._pending = asyncio.get_running_loop().call_later(self.period - (now - self._last_set), self._fire)

    def _fire(self) -> None:
        self._pending = None
        self._last_set = time.monotonic()
        super().set()


class BackgroundDeclarations:
    """hivemind's ``GroupKeyManager.declare_averager`` with its withdrawals in a task of their own, one in flight per
    group key: ``look_for_group`` otherwise waits for every replica (hivemind#357). Declarations stay awaited (queued,
    they expired before they landed); a withdrawal that would land after its declaration expired is not sent."""

    def __init__(self, declare_averager: Callable[..., Awaitable[bool]]):
        self._declare_averager = declare_averager
        self.pending: set[asyncio.Task] = set()
        self._next: dict[Any, tuple[tuple, dict]] = {}  # group key -> the newest withdrawal not sent yet
        self._senders: dict[Any, asyncio.Task] = {}  # group key -> the task sending its withdrawals, one at a time
        self.store_s = 0.0  # how long a declaration takes to store (moving average)

    async def declare_averager(
        self, group_key: Any, peer_id: PeerID, expiration_time: float, looking_for_group: bool = True
    ) -> bool:
        if looking_for_group:
            started = time.monotonic()
            try:
                return await self._declare_averager(group_key, peer_id, expiration_time)
            finally:
                self.store_s = 0.7 * self.store_s + 0.3 * (time.monotonic() - started)
        if expiration_time <= get_dht_time() + self.store_s:
            return True  # the declaration expires before a withdrawal could land: sending it only loads the DHT
        self._next[group_key] = ((group_key, peer_id, expiration_time), dict(looking_for_group=False))
        if group_key not in self._senders:
            task = asyncio.create_task(self._send(group_key))
            self._senders[group_key] = task
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)
        return True  # hivemind ignores the result

    async def _send(self, group_key: Any) -> None:
        try:
            while group_key in self._next:
                args, kwargs = self._next.pop(group_key)
                try:
                    await self._declare_averager(*args, **kwargs)
                except Exception as e:
                    logger.debug(f"withdrawing from the DHT failed: {e!r}")
        finally:
            del self._senders[group_key]


class RelativeLateness:
    """Who is late *compared with the others* (fixes 3 and 4): a node's share of late answers over its last `window`,
    against the median share of the nodes seen within `memory_s`; an outlier answered at least `min_answers` times,
    late in at least `min_share` of them and `margin` above that median. Callers ``cap`` how many they exclude."""

    def __init__(
        self,
        window: int = 16,
        min_answers: int = 8,
        min_share: float = 0.6,
        margin: float = 0.35,
        memory_s: float = 60.0,
    ):
        self.window, self.min_answers, self.min_share, self.margin = window, min_answers, min_share, margin
        self.memory_s = memory_s
        self.late: dict[PeerID, deque[bool]] = {}
        self.last_seen: dict[PeerID, float] = {}

    def record(self, peer: PeerID, late: bool) -> None:
        self.late.setdefault(peer, deque(maxlen=self.window)).append(late)
        self.last_seen[peer] = time.monotonic()

    def forget(self, peer: PeerID) -> None:
        self.late.pop(peer, None)

    def known(self) -> list[PeerID]:
        horizon = time.monotonic() - self.memory_s
        return [peer for peer, seen in self.last_seen.items() if seen >= horizon]

    def share(self, peer: PeerID) -> float:
        late = self.late.get(peer)
        return sum(late) / len(late) if late else 0.0

    def outlier(self, peer: PeerID) -> bool:
        late = self.late.get(peer)
        if late is None or len(late) < self.min_answers or self.share(peer) < self.min_share:
            return False
        others = sorted(self.share(other) for other in self.known() if other != peer and other in self.late)
        median = others[len(others) // 2] if others else 0.0
        return self.share(peer) >= median + self.margin

    @staticmethod
    def cap(known: int, max_share: float) -> int:
        """How many of `known` nodes may be excluded at once: `max_share` of them, at least one, never all."""
        return max(0, min(known - 1, max(1, math.floor(max_share * known))))


class LeaderAvoidance:
    """Fix 3: a leader that times out far more often than the others is skipped for base_s, doubled per further
    time-out up to max_s (a group forgives), never more than `max_share` of the leaders we know. hivemind forgets
    after one search (matchmaking.py, ``PotentialLeaders.past_attempts``); hivemind#676 asks for such deadlines."""

    def __init__(
        self,
        request_timeout: float,
        counts: SharedCounts | None = None,
        base_s: float = 5.0,
        max_s: float = 30.0,
        max_share: float = 0.25,
    ):
        self.request_timeout, self.base_s, self.max_s, self.max_share = request_timeout, base_s, max_s, max_share
        self.counts = counts if counts is not None else SharedCounts()
        # join requests are fewer than DHT answers: a shorter memory, and two time-outs in a row may decide
        self.lateness = RelativeLateness(window=8, min_answers=2, min_share=0.5, margin=0.3)
        self._until: dict[PeerID, float] = {}
        self._strikes: dict[PeerID, int] = {}

    def avoided(self, leader: PeerID) -> bool:
        return time.monotonic() < self._until.get(leader, -math.inf)

    def record(self, leader: PeerID, got_group: bool, seconds: float) -> None:
        timed_out = not got_group and seconds >= self.request_timeout  # a quick "no" (e.g. group full) is no reason
        self.lateness.record(leader, timed_out)
        if got_group:
            self._until.pop(leader, None)
            self._strikes.pop(leader, None)
        elif timed_out:  # it timed out, or accepted and then went silent
            self.counts.add("slow_leader_timeouts")
            cap = RelativeLateness.cap(len(self.lateness.known()) + 1, self.max_share)  # +1: ourselves
            avoiding = sum(until > time.monotonic() for until in self._until.values())
            if not self.lateness.outlier(leader) or avoiding >= cap:
                return  # late like the others, or already avoiding as many as we may: keep asking it
            strikes = self._strikes.get(leader, 0)
            self._strikes[leader] = strikes + 1
            self._until[leader] = time.monotonic() + min(self.base_s * 2**strikes, self.max_s)
            self.lateness.forget(leader)
            logger.debug(f"leader {leader} did not answer within {seconds:.2f}s: avoiding it for a while")

    def wrap(self, request_join_group: Callable[[PeerID], Awaitable[Any]]) -> Callable[[PeerID], Awaitable[Any]]:
        """``Matchmaking._request_join_group`` that skips avoided leaders (None: "no group", as hivemind's own)."""

        async def request_join_group_avoiding(leader: PeerID) -> Any:
            if self.avoided(leader):
                self.counts.add("slow_leader_requests_skipped")
                return None
            started = time.monotonic()
            group = await request_join_group(leader)
            self.record(leader, group is not None, time.monotonic() - started)
            return group

        return request_join_group_avoiding


class SlowReplyBlacklist:
    """Fix 4, DHT process: a node late (over `factor` times the others' median answer time, and `min_s`) far more often
    than the others goes into hivemind's blacklist (dht/node.py takes only nodes silent for ``wait_timeout``), while
    fewer than `max_share` of the known nodes are in it. hivemind#676, #624."""

    def __init__(
        self, counts: SharedCounts | None = None, factor: float = 4.0, min_s: float = 0.1, max_share: float = 0.2
    ):
        self.counts = counts if counts is not None else SharedCounts()
        self.factor, self.min_s, self.max_share = factor, min_s, max_share
        self.lateness = RelativeLateness()
        self.recent: deque[tuple[PeerID, float]] = deque(maxlen=200)  # (node, answer time) of every node
        self.bans: dict[PeerID, int] = {}
        self.blacklisted: Callable[[PeerID], bool] | None = None  # install: hivemind's (it is pickled before)

    def answered(self, peer_id: PeerID, seconds: float) -> bool:
        """Record one answer (late: over ``factor`` x the others' median and ``min_s``); True: blacklist it now."""
        others = sorted(taken for peer, taken in self.recent if peer != peer_id)
        median = others[len(others) // 2] if others else 0.0
        self.lateness.record(peer_id, seconds > max(self.min_s, self.factor * median))
        self.recent.append((peer_id, seconds))
        if not self.lateness.outlier(peer_id):
            return False
        known = self.lateness.known()
        banned = 0 if self.blacklisted is None else sum(map(self.blacklisted, known))
        if banned >= RelativeLateness.cap(len(known), self.max_share):
            return False  # as many banned as we may: waiting for it beats having no one to ask
        self.lateness.forget(peer_id)
        self.bans[peer_id] = self.bans.get(peer_id, 0) + 1
        self.counts.add("slow_dht_node_bans")
        return True

    async def install(self, _dht: Any, node: Any) -> None:
        """Through DHT.run_coroutine: wraps the node's finds; on a node that has one, only its counts move to ours."""
        installed = getattr(node, "slow_reply_blacklist", None)
        if installed is not None:
            installed.counts = self.counts
            return
        node.slow_reply_blacklist = self
        self.blacklisted = node.blacklist.__contains__
        original = node._call_find_with_blacklist

        async def call_find(peer_id: PeerID, keys: Any) -> Any:
            started = time.monotonic()
            response = await original(peer_id, keys)
            if response is not None and self.answered(peer_id, time.monotonic() - started):
                node.blacklist.register_failure(peer_id)
            return response

        node._call_find_with_blacklist = call_find


def install_slow_reply_blacklist(dht: hivemind.DHT, counts: SharedCounts, timeout: float) -> bool:
    """Fix 4 into `dht` (once per DHT); False, with a warning, if the DHT did not answer within `timeout` s."""
    try:
        dht.run_coroutine(SlowReplyBlacklist(counts).install, return_future=True).result(timeout)
        return True
    except Exception as e:
        logger.warning(
            f"DecentralizedSGD: could not install the slow-reply DHT blacklist ({e!r}); DHT lookups will "
            "wait for a DHT node that answers late"
        )
        return False


def install_slow_peer_fixes(
    matchmaking: Any, state_updated: asyncio.Event, counts: SharedCounts
) -> tuple[asyncio.Event, Collection[asyncio.Task]]:
    """Fixes 1-3 on the averager's ``matchmaking``, at its first step: returns the event to use instead of
    ``state_updated``, and the withdrawals still on their way (the averager's shutdown waits for them)."""
    state_updated.set()  # the declaring loop may wait on the old event: wake it once, it uses the new one then
    key_manager = matchmaking.group_key_manager
    declarations = BackgroundDeclarations(key_manager.declare_averager)
    key_manager.declare_averager = declarations.declare_averager
    avoidance = LeaderAvoidance(matchmaking.request_timeout, counts)
    matchmaking._request_join_group = avoidance.wrap(matchmaking._request_join_group)
    return CoalescedEvent(STATE_DECLARE_MIN_PERIOD), declarations.pending
