"""hivemind 1.1.12 work-arounds that keep healthy peers at their pace when a groupmate's box is overloaded (issue 11,
item 3); the sibling of ``hivemind_fixes``, each naming the hivemind behaviour it covers.

Why (measured with ``benchmarks/bench_averaging.py --regimes straggler --trace``, 5 peers, one stopped 80% of the
time; ``benchmarks/results/straggler_evidence.md``): the healthy peers lose their time in hivemind's DHT, not in
AllReduce with the slow peer (it is in few groups) and hardly in join requests to it. With 5 peers every DHT key
lives on every node, each store waits for every replica's answer, and the slow node answers late but never late
enough (``wait_timeout``, 3 s) to be blacklisted. Four hivemind behaviours put that wait on every round:

1. ``DecentralizedAverager._run_allreduce_inplace_`` sets ``_state_updated`` once per averaged *tensor*, and
   ``_declare_for_download_periodically`` answers every set with a DHT store of the ``.all_averagers`` key: one
   store to every replica per tensor per round (21 for the benchmark's model, 267 for ResNet-50). Fix:
   ``CoalescedEvent``, at most one wake-up per second.
2. ``Matchmaking.look_for_group`` returns only after ``PotentialLeaders`` withdrew our declaration from the DHT
   (``GroupKeyManager.declare_averager(looking_for_group=False)``, awaited in a ``finally``): the group has formed,
   but the round waits for the slowest replica. Fix: ``BackgroundDeclarations`` runs hivemind's declare_averager in
   a task of its own and returns at once (hivemind ignores its result); shutdown waits for those tasks
   (``averager_shutdown``), so that none reaches the DHT after the averager process is gone.
3. A leader that does not answer a join request within ``request_timeout`` is asked again at the next declaration
   (``PotentialLeaders.past_attempts`` lives for one search only). Fix: ``LeaderAvoidance`` skips it for a while
   (exponential backoff), forgiven when a request to it gets a group.
4. DHT lookups wait for a node that answers late, but hivemind's ``Blacklist`` only takes nodes that did not answer
   at all. Fix: ``SlowReplyBlacklist`` puts a node that keeps answering late into that blacklist.

Where they are patched in: 1-3 by ``SlowPeerFixes``, a mixin of our averager (``averager.Averager``), in the
averager process and on that averager's own objects only; 4 by ``install_slow_reply_blacklist(dht)`` into the DHT a
DecentralizedSGD is given, once per DHT (the DHT process's own node). ``SharedCounts`` carries what they did to the
trainer's ``counters`` (names in ``SLOW_PEER_COUNTS``).
"""

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

logger = logging.getLogger(__name__)

STATE_DECLARE_MIN_PERIOD = 1.0  # seconds between two DHT stores of our state-sharing declaration (fix 1)
SLOW_PEER_COUNTS = (
    "slow_leader_timeouts",  # join requests a leader left unanswered for request_timeout (each: avoid it longer)
    "slow_leader_requests_skipped",  # join requests not sent, to a leader we avoid
    "slow_dht_node_bans",  # times our DHT blacklisted a node that answers late
)


class SharedCounts:
    """Counts that the averager and DHT processes add to and the trainer's process reads without a round trip: a
    float64 tensor in torch's shared memory (as hivemind's MPFuture keeps its state), still shared after a fork or
    after pickling through hivemind's pipes. Each name has one writing process at a time."""

    def __init__(self, names: Sequence[str] = SLOW_PEER_COUNTS):
        self.names = tuple(names)
        self._values = torch.zeros(len(self.names), dtype=torch.float64).share_memory_()

    def add(self, name: str, amount: float = 1.0) -> None:
        self._values[self.names.index(name)] += amount

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.names, self._values.tolist(), strict=True))


class CoalescedEvent(asyncio.Event):
    """An asyncio.Event whose set() wakes waiters at most once per `period` seconds; a set() in between is delayed
    to the end of the period (never lost). Runs in the averager's event loop (fix 1)."""

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
    """hivemind's ``GroupKeyManager.declare_averager``, run in a task of its own (fix 2). Averager process, event
    loop. ``pending``: the tasks not done yet (the averager's shutdown waits for them)."""

    def __init__(self, declare_averager: Callable[..., Awaitable[bool]]):
        self._declare_averager = declare_averager
        self.pending: set[asyncio.Task] = set()

    async def declare_averager(self, *args: Any, **kwargs: Any) -> bool:
        task = asyncio.create_task(self._declare_averager(*args, **kwargs))  # tasks start in order: a withdrawal
        self.pending.add(task)  # is sent after the declaration it withdraws
        task.add_done_callback(self._done)
        return True  # hivemind ignores the result; our own DHT node stores it at once

    def _done(self, task: asyncio.Task) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug(f"declaring in the DHT failed: {task.exception()!r}")


class LeaderAvoidance:
    """Leaders that left a join request unanswered for request_timeout are skipped for base_s, doubled after each
    further time-out up to max_s; a request that gets a group forgives (fix 3). Averager process, event loop."""

    def __init__(self, request_timeout: float, counts: SharedCounts | None = None, base_s: float = 5.0,
                 max_s: float = 60.0):  # fmt: skip
        self.request_timeout, self.base_s, self.max_s = request_timeout, base_s, max_s
        self.counts = counts if counts is not None else SharedCounts()
        self._until: dict[PeerID, float] = {}
        self._strikes: dict[PeerID, int] = {}

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
            self.counts.add("slow_leader_timeouts")
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
    """DHT process: a DHT node that answered `late_of_last[0]` of its last `late_of_last[1]` find requests late
    (more than `factor` times the median answer time of the *other* nodes, and more than `min_s`) goes into
    hivemind's own blacklist, as if it had not answered (fix 4). hivemind blacklists a node only after wait_timeout
    (3 s) without an answer, but a node that answers late, by up to a second, delays every DHT get and store (each
    waits for every replica). The blacklist's backoff does the rest; one slow answer of a busy but healthy node is
    no reason, and neither are slow answers from every node (a slow network: the median moves with them). A
    blacklisted node still stores its own declarations on us: we still see it as a groupmate, we just do not wait
    for its answers."""

    def __init__(self, counts: SharedCounts | None = None, factor: float = 4.0, min_s: float = 0.1,
                 late_of_last: tuple[int, int] = (2, 4)):  # fmt: skip
        self.counts = counts if counts is not None else SharedCounts()
        self.factor, self.min_s, self.late_of_last = factor, min_s, late_of_last
        self.recent: deque[tuple[PeerID, float]] = deque(maxlen=200)  # (node, answer time) of every node
        self.late: dict[PeerID, deque[bool]] = {}
        self.bans: dict[PeerID, int] = {}

    def threshold(self, peer_id: PeerID) -> float:
        """How long `peer_id` may take: compared with the other nodes (its own late answers must not count)."""
        others = sorted(seconds for peer, seconds in self.recent if peer != peer_id)
        median = others[len(others) // 2] if others else 0.0
        return max(self.min_s, self.factor * median)

    def answered(self, peer_id: PeerID, seconds: float) -> bool:
        """Record one answer; True if the node should be blacklisted now."""
        late = self.late.setdefault(peer_id, deque(maxlen=self.late_of_last[1]))
        late.append(seconds > self.threshold(peer_id))
        self.recent.append((peer_id, seconds))
        if sum(late) < self.late_of_last[0]:
            return False
        late.clear()
        self.bans[peer_id] = self.bans.get(peer_id, 0) + 1
        self.counts.add("slow_dht_node_bans")
        return True

    async def install(self, _dht: Any, node: Any) -> None:
        """Run through DHT.run_coroutine: wraps this DHT node's finds (the lookups behind every get and store). On a
        node that has one already, only its counts move to ours (the newest DecentralizedSGD reports them)."""
        installed = getattr(node, "slow_reply_blacklist", None)
        if installed is not None:
            installed.counts = self.counts
            return
        node.slow_reply_blacklist = self
        original = node._call_find_with_blacklist

        async def call_find(peer_id: PeerID, keys: Any) -> Any:
            started = time.monotonic()
            response = await original(peer_id, keys)
            if response is not None and self.answered(peer_id, time.monotonic() - started):
                node.blacklist.register_failure(peer_id)
            return response

        node._call_find_with_blacklist = call_find


def install_slow_reply_blacklist(dht: hivemind.DHT, counts: SharedCounts, timeout: float) -> bool:
    """Trainer's process: fix 4 into `dht` (once per DHT). False, with a warning, if the DHT did not answer within
    `timeout` s (then the DHT works as hivemind's own)."""
    try:
        dht.run_coroutine(SlowReplyBlacklist(counts).install, return_future=True).result(timeout)
        return True
    except Exception as e:
        logger.warning(f"DecentralizedSGD: could not install the slow-reply DHT blacklist ({e!r}); DHT lookups will "
                       "wait for a DHT node that answers late")  # fmt: skip
        return False


class SlowPeerFixes:
    """DecentralizedAverager mixin, before ``HivemindFixes`` in the bases: fixes 1-3, in the averager process.
    ``slow_peer_fixes=False`` leaves hivemind's behaviour (the benchmark's ablation)."""

    _state_updated: asyncio.Event
    _matchmaking: Any
    request_timeout: float

    def __init__(self, *args: Any, slow_peer_fixes: bool = True, slow_peer_counts: SharedCounts | None = None,
                 **kwargs: Any):  # fmt: skip
        self.slow_peer_fixes = slow_peer_fixes
        self.slow_peer_counts = slow_peer_counts if slow_peer_counts is not None else SharedCounts()
        self._declarations: BackgroundDeclarations | None = None
        super().__init__(*args, **kwargs)

    @property
    def background_dht_requests(self) -> Collection[asyncio.Task]:
        """Averager process: declarations still on their way to the DHT (see HivemindFixes._shutdown)."""
        return () if self._declarations is None else self._declarations.pending

    async def _step(self, **kwargs: Any) -> None:
        """Averager process: the first round installs the fixes (hivemind's ``_run`` creates ``_matchmaking`` and
        ``_state_updated`` before it serves any request), then runs as ``HivemindFixes._step``."""
        if self.slow_peer_fixes and self._declarations is None:
            self._install_slow_peer_fixes()
        await super()._step(**kwargs)  # type: ignore[misc]

    def _install_slow_peer_fixes(self) -> None:
        previous, self._state_updated = self._state_updated, CoalescedEvent(STATE_DECLARE_MIN_PERIOD)
        previous.set()  # the declaring loop may wait on the old event: wake it once, it uses the new one from then
        key_manager = self._matchmaking.group_key_manager
        self._declarations = BackgroundDeclarations(key_manager.declare_averager)
        key_manager.declare_averager = self._declarations.declare_averager
        avoidance = LeaderAvoidance(self.request_timeout, self.slow_peer_counts)
        self._matchmaking._request_join_group = avoidance.wrap(self._matchmaking._request_join_group)
