"""Re-bootstrap a hivemind DHT that lost every peer: the DHT's owner starts it (``swarm.start_dht``), as it owns the
DHT (the optimizer only uses one). hivemind 1.1.12 dials its initial peers only once, at start, so after an outage a
peer stays alone for good, and a restarted first box is dialed by nobody. ``keep_dht_connected`` starts one thread per
DHT that, when the routing table is empty, dials the initial peers and those of the address book (``address_book``)
and pings them; and notes every new peer in the book at first sight (routing table, groupmates:
``groupmates_listener``). No public API: it uses ``node.protocol.routing_table`` and ``node.p2p._client.connect``.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence

import hivemind
from hivemind.dht import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from vissl_swarm.address_book import AddressBook, dht_neighbours, peer_addresses, routing_table_peers

logger = logging.getLogger(__name__)

CHECK_PERIOD_S = 10.0
BOOK_PERIOD_S = 30.0  # the address book is brought up to date at the first check with peers, then this often
WATCH_PERIOD_S = 1.0  # how often the thread looks for peers it has not noted yet (first sight); while looks find
# none new, twice as long each time, up to the check period: each look is a DHT round trip, worth it while peers join
ADDRESS_TRIES = 10  # looks at a new peer whose addresses libp2p does not know yet, before the periodic note takes over
_rejoiners: weakref.WeakKeyDictionary[hivemind.DHT, DHTRejoiner] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


async def rejoin_if_alone(dht: hivemind.DHT, node: DHTNode, addresses: Sequence[str] | None = None) -> int | None:
    """Runs in the DHT process. If our routing table is empty, dial ``addresses`` (default: the initial peers) and
    ping each peer once. Returns how many answered, or None when not alone or nobody to dial. Upstream: none found."""
    addresses = [str(address) for address in ((dht.initial_peers or []) if addresses is None else addresses)]
    if node.protocol.routing_table.uid_to_peer_id or not addresses:
        return None
    by_peer: dict[str, list[Multiaddr]] = {}
    for maddr in map(Multiaddr, addresses):
        by_peer.setdefault(maddr["p2p"], []).append(maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}")))
    answered = 0
    for peer, maddrs in by_peer.items():
        peer_id = PeerID.from_base58(peer)
        if peer_id == node.peer_id:
            continue
        try:
            await node.p2p._client.connect(peer_id, maddrs)
            answered += await node.protocol.call_ping(peer_id) is not None
        except Exception as e:  # still unreachable: try again at the next check
            logger.debug(f"rejoin: {peer} did not answer at {maddrs}: {e!r}")
    return answered


class DHTRejoiner(threading.Thread):
    """Checks one DHT every ``period`` s; ``alone``: the last check found nobody. With a ``book``, it
    notes new peers in it (every ``watch_period`` s, less often while none shows up, and when ``note`` reports
    groupmates)."""

    def __init__(
        self,
        dht: hivemind.DHT,
        period: float = CHECK_PERIOD_S,
        addresses: Callable[[], Sequence[str]] | None = None,
        book: AddressBook | None = None,
        watch_period: float = WATCH_PERIOD_S,
    ):
        super().__init__(name="dht-rejoiner", daemon=True)
        self.dht, self.period = dht, period
        self.addresses = addresses or (lambda: [str(address) for address in dht.initial_peers or []])
        self.book, self.watch_period = book, watch_period
        self.alone = False
        self._noted_at = -math.inf  # when the address book was last brought up to date (this thread)
        self._own = str(dht.peer_id)
        self._lock = threading.Lock()  # guards the two below: note() runs in the scheduler thread
        self._sighted: set[str] = set()  # peers noted at first sight, or left to the periodic note
        self._pending: dict[str, int] = {}  # peers seen (groupmates, or without known addresses yet) -> looks so far
        self._stopping, self._wake = threading.Event(), threading.Event()

    def run(self) -> None:
        next_check = time.monotonic() + self.period
        watch = self.watch_period if self.book is not None else math.inf
        while self.dht.is_alive():
            self._wake.wait(max(0.0, min(watch, next_check - time.monotonic())))
            self._wake.clear()
            if self._stopping.is_set():
                return
            if self.book is not None:
                try:
                    found = self.note_new_peers()
                except Exception as e:  # the DHT is shutting down or busy: look again next time
                    logger.debug(f"address book: looking for new peers failed: {e!r}")
                    found = []
                with self._lock:  # alone, or peers waiting for their addresses: keep looking often
                    eager = bool(found) or not self._sighted or bool(self._pending)
                watch = self.watch_period if eager else min(2 * watch, max(self.period, self.watch_period))
            if time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + self.period
            try:
                answered = self.check(note_peers=time.monotonic() - self._noted_at >= BOOK_PERIOD_S)
            except Exception as e:  # the DHT is shutting down or busy: check again later
                logger.debug(f"rejoin check failed: {e!r}")
                continue
            if answered:
                logger.warning(f"Our DHT had lost every peer; rejoined through {answered} known peer(s)")
            elif answered == 0 and not self.alone:
                logger.warning(
                    f"Our DHT has lost every peer; dialing the initial and known peers every {self.period:.0f}s"
                )
            self.alone = answered == 0

    def check(self, note_peers: bool = True) -> int | None:
        """One check: rejoin if alone, else (``note_peers``) note our neighbours in the book; see rejoin_if_alone."""
        rejoin = functools.partial(rejoin_if_alone, addresses=list(self.addresses()))
        answered = self.dht.run_coroutine(rejoin, return_future=True).result(timeout=self.period)
        if answered is None and self.book is not None and note_peers:
            neighbours = self.dht.run_coroutine(dht_neighbours, return_future=True).result(timeout=self.period)
            if neighbours:  # a first box alone has nobody to note yet: look again at the next check
                self.book.remember(neighbours)
                self._noted_at = time.monotonic()
        return answered

    def note(self, peer_ids: Iterable[str]) -> None:
        """Peers a round showed us (any thread): noted in the book at the thread's next look."""
        with self._lock:
            new = {str(peer) for peer in peer_ids} - self._sighted - self._pending.keys() - {self._own}
            self._pending.update(dict.fromkeys(new, 0))
        if new:
            self._wake.set()

    def note_new_peers(self) -> list[str]:
        """First sight: new peers of our routing table and of ``note`` go into the book (one without known addresses
        is looked at again, ``ADDRESS_TRIES`` times). Returns the peers noted."""
        assert self.book is not None
        table = self.dht.run_coroutine(routing_table_peers, return_future=True).result(timeout=self.period)
        with self._lock:
            new = (set(table) | self._pending.keys()) - self._sighted - {self._own}
        if not new:
            return []
        lookup = functools.partial(peer_addresses, peer_ids=sorted(new))
        found = {
            peer: addrs
            for peer, addrs in self.dht.run_coroutine(lookup, return_future=True).result(timeout=self.period).items()
            if addrs
        }
        if found:
            self.book.remember(found)
        with self._lock:
            for peer in new:
                tries = self._pending.pop(peer, 0) + 1
                if peer in found or tries >= ADDRESS_TRIES:
                    self._sighted.add(peer)
                else:
                    self._pending[peer] = tries
        return sorted(found)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()


def keep_dht_connected(
    dht: hivemind.DHT,
    period: float = CHECK_PERIOD_S,
    addresses: Callable[[], Sequence[str]] | None = None,
    book: AddressBook | None = None,
    watch_period: float = WATCH_PERIOD_S,
) -> DHTRejoiner:
    """Start (once per DHT) and return the thread that re-bootstraps `dht` and keeps ``book`` up to date."""
    with _registry_lock:
        rejoiner = _rejoiners.get(dht)
        if rejoiner is None or not rejoiner.is_alive():
            rejoiner = _rejoiners[dht] = DHTRejoiner(dht, period, addresses, book, watch_period)
            rejoiner.start()
        return rejoiner


def rejoiner_of(dht: hivemind.DHT) -> DHTRejoiner | None:
    """The thread that keeps `dht` connected, if any (its ``alone`` tells whether our DHT knows anybody)."""
    return _rejoiners.get(dht)


def groupmates_listener(dht: hivemind.DHT) -> Callable[[Iterable[str]], None] | None:
    """What a ``DecentralizedSGD`` on `dht` passes as ``on_group``: the address book of the thread keeping `dht`
    connected learns whom our rounds averaged with (None: no such book)."""
    rejoiner = _rejoiners.get(dht)
    return rejoiner.note if rejoiner is not None and rejoiner.book is not None else None


def dht_peer_count(dht: hivemind.DHT | None, timeout: float = 3.0) -> int | None:
    """How many other peers our DHT knows (its routing table); None when there is no DHT or it did not answer."""
    if dht is None:
        return None
    try:
        return len(dht.run_coroutine(routing_table_peers, return_future=True).result(timeout=timeout))
    except Exception as error:  # busy or shutting down: the caller says it does not know
        logger.debug(f"routing table size: {error!r}")
        return None
