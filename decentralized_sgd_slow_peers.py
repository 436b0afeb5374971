"""Healthy peers keep their pace when a groupmate's box is overloaded (issue 11, item 3): hivemind work-arounds.

Why: measured with ``benchmarks/bench_averaging.py --regimes straggler --trace`` (5 peers, one stopped 80% of the
time), the healthy peers lose their time in hivemind's DHT, not in AllReduce with the slow peer (it is in few
groups) and hardly in join requests to it: with 5 peers every DHT key lives on every node, each store waits for
every replica's answer, and the slow node answers late but never late enough (``wait_timeout``, 3 s) to be
blacklisted. Three hivemind 1.1.12 behaviours put that wait on every round:

1. ``DecentralizedAverager._run_allreduce_inplace_`` sets ``_state_updated`` once per averaged *tensor*, and
   ``_declare_for_download_periodically`` answers every set with a DHT store of the ``.all_averagers`` key: one
   store to every replica per tensor per round (21 for the benchmark's model, 267 for ResNet-50), which queues
   behind the slow replica and loads every DHT node. Fix: ``CoalescedEvent``, at most one wake-up per second.
2. ``Matchmaking.look_for_group`` returns only after ``PotentialLeaders`` withdrew our declaration from the DHT
   (``declare_averager(looking_for_group=False)``, awaited in a ``finally``), and a store first looks up the
   nearest nodes and then awaits every replica: the group has formed, but the round waits for the slowest DHT node.
   Fix: ``declare_averager`` hands the store to the DHT process and returns (hivemind ignores its result anyway).
3. A leader that does not answer a join request within ``request_timeout`` is asked again at the next declaration
   (``PotentialLeaders.past_attempts`` lives for one search only). Fix: ``LeaderAvoidance`` skips it for a while
   (exponential backoff), forgiven when a request to it succeeds.
4. DHT lookups wait for a node that answers late; see ``SlowReplyBlacklist``.

``SlowPeerFixes.install_slow_peer_fixes(matchmaking)`` applies 1-3 to one averager, in the averager process. Hook
point: the averager subclass calls it once its ``_matchmaking`` exists (e.g. at the start of ``_step``).
``dht.run_coroutine(SlowReplyBlacklist().install)`` applies 4 to the DHT a DecentralizedSGD is given.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.averaging.key_manager import GroupKey
from hivemind.p2p import PeerID

logger = logging.getLogger(__name__)

STATE_DECLARE_MIN_PERIOD = 1.0  # seconds between two DHT stores of our state-sharing declaration (fix 1)


class CoalescedEvent(asyncio.Event):
    """An asyncio.Event whose set() wakes waiters at most once per `period` seconds; a set() in between is delayed
    to the end of the period (never lost). Runs in the averager's event loop."""

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


class LeaderAvoidance:
    """Leaders that left a join request unanswered for request_timeout are skipped for base_s, doubled after each
    further time-out up to max_s; a request that gets a group forgives. Used by the averager process only."""

    def __init__(self, request_timeout: float, base_s: float = 5.0, max_s: float = 60.0):
        self.request_timeout, self.base_s, self.max_s = request_timeout, base_s, max_s
        self._until: dict[PeerID, float] = {}
        self._strikes: dict[PeerID, int] = {}
        self.skipped = self.penalized = 0

    def avoided(self, leader: PeerID) -> bool:
        return time.monotonic() < self._until.get(leader, -math.inf)

    def record(self, leader: PeerID, got_group: bool, seconds: float) -> None:
        if got_group:
            self._until.pop(leader, None)
            self._strikes.pop(leader, None)
        elif seconds >= self.request_timeout:  # not a quick "no": it timed out, or accepted and then went silent
            strikes = self._strikes.get(leader, 0)
            self._strikes[leader] = strikes + 1
            self._until[leader] = time.monotonic() + min(self.base_s * 2**strikes, self.max_s)
            self.penalized += 1
            logger.debug(f"leader {leader} did not answer within {seconds:.2f}s: avoiding it for a while")

    def wrap(self, request_join_group: Callable[[PeerID], Awaitable[Any]]) -> Callable[[PeerID], Awaitable[Any]]:
        async def request_join_group_avoiding(leader: PeerID) -> Any:
            if self.avoided(leader):
                self.skipped += 1
                return None
            started = time.monotonic()
            group = await request_join_group(leader)
            self.record(leader, group is not None, time.monotonic() - started)
            return group

        return request_join_group_avoiding


def _declare_in_background(key_manager: Any) -> Callable[..., Awaitable[bool]]:
    """GroupKeyManager.declare_averager's DHT store, handed to the DHT process without waiting for it (fix 2)."""

    async def declare_averager(
        group_key: GroupKey, peer_id: PeerID, expiration_time: float, looking_for_group: bool = True
    ) -> bool:
        if not looking_for_group:  # withdrawn strictly after the declaration it replaces, as hivemind does
            expiration_time = math.nextafter(expiration_time, math.inf)
        future = key_manager.dht.store(key=group_key, subkey=peer_id.to_bytes(), value=looking_for_group,
                                       expiration_time=expiration_time, return_future=True)  # fmt: skip
        future.add_done_callback(_log_failed_declaration)
        return True  # hivemind ignores the result; our own DHT node stores it at once

    return declare_averager


def _log_failed_declaration(future: Any) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.debug(f"declaring in the DHT failed: {future.exception()!r}")


class SlowReplyBlacklist:
    """DHT process: a DHT node that answered `late_of_last[0]` of its last `late_of_last[1]` find requests late
    (`factor` times the median answer time, and at least `min_s`) goes into hivemind's own blacklist, as if it had
    not answered (fix 4). hivemind blacklists a node only after wait_timeout (3 s) without an answer, but a node that
    answers late, by up to a second, delays every DHT get and store (each waits for every replica). The blacklist's
    backoff does the rest; one slow answer of a busy but healthy node is no reason."""

    def __init__(self, factor: float = 4.0, min_s: float = 0.1, late_of_last: tuple[int, int] = (2, 4)):
        self.factor, self.min_s, self.late_of_last = factor, min_s, late_of_last
        self.recent: deque[float] = deque(maxlen=200)  # answer times of every node
        self.late: dict[PeerID, deque[bool]] = {}
        self.bans: dict[PeerID, int] = {}

    def threshold(self) -> float:
        median = sorted(self.recent)[len(self.recent) // 2] if self.recent else 0.0
        return max(self.min_s, self.factor * median)

    def answered(self, peer_id: PeerID, seconds: float) -> bool:
        """Record one answer; True if the node should be blacklisted now."""
        late = self.late.setdefault(peer_id, deque(maxlen=self.late_of_last[1]))
        late.append(seconds > self.threshold())
        self.recent.append(seconds)
        if sum(late) < self.late_of_last[0]:
            return False
        late.clear()
        self.bans[peer_id] = self.bans.get(peer_id, 0) + 1
        return True

    async def install(self, _dht: Any, node: Any) -> None:
        """Run through DHT.run_coroutine: wraps this DHT node's finds (the lookups behind every get and store)."""
        original = node._call_find_with_blacklist
        if getattr(node, "slow_reply_blacklist", None) is not None:
            return
        node.slow_reply_blacklist = self

        async def call_find(peer_id: PeerID, keys: Any) -> Any:
            started = time.monotonic()
            response = await original(peer_id, keys)
            if response is not None and self.answered(peer_id, time.monotonic() - started):
                node.blacklist.register_failure(peer_id)
            return response

        node._call_find_with_blacklist = call_find


class SlowPeerFixes:
    """DecentralizedAverager mixin: fixes 1-3 above, installed in the averager process."""

    _state_updated: asyncio.Event
    request_timeout: float
    leader_avoidance: LeaderAvoidance | None = None

    def install_slow_peer_fixes(self, matchmaking: Any) -> None:
        """Averager process, in its event loop, once: after hivemind created `_matchmaking` and `_state_updated`."""
        if self.leader_avoidance is not None:
            return
        previous, self._state_updated = self._state_updated, CoalescedEvent(STATE_DECLARE_MIN_PERIOD)
        previous.set()  # the declaring loop may wait on the old event: wake it once, it uses the new one from then
        matchmaking.group_key_manager.declare_averager = _declare_in_background(matchmaking.group_key_manager)
        self.leader_avoidance = LeaderAvoidance(self.request_timeout)
        matchmaking._request_join_group = self.leader_avoidance.wrap(matchmaking._request_join_group)
