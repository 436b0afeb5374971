"""Re-bootstrap a hivemind DHT that lost every peer: a small helper whoever owns a DHT starts.

Missing in hivemind 1.1.12: the DHT drops peers that stop answering and dials its initial peers only once, at
start, so after a network outage a peer stays alone for good (and its matchmaking never finds anybody).
``keep_dht_connected(dht)`` starts one thread per DHT (``swarm.start_dht`` does it for the trainer and the
monitor); every ``period`` seconds it checks, inside the DHT process, whether the routing table is empty, and if
so dials the initial peers again and pings them, which puts us back into each other's tables. There is no public
API for this: it uses ``node.protocol.routing_table`` and ``node.p2p._client.connect``.
"""

from __future__ import annotations

import logging
import threading
import weakref

import hivemind
from hivemind.dht import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)

CHECK_PERIOD_S = 10.0
_rejoiners: weakref.WeakKeyDictionary[hivemind.DHT, DHTRejoiner] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


async def rejoin_if_alone(dht: hivemind.DHT, node: DHTNode) -> int | None:
    """Runs in the DHT process. If our routing table is empty, dial the initial peers and ping them. Returns how
    many answered, or None when we were not alone (or have no initial peers: we are the first peer)."""
    if node.protocol.routing_table.uid_to_peer_id or not dht.initial_peers:
        return None
    answered = 0
    for maddr in map(Multiaddr, map(str, dht.initial_peers)):
        peer_id = PeerID.from_base58(maddr["p2p"])
        try:
            await node.p2p._client.connect(peer_id, [maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}"))])
            answered += await node.protocol.call_ping(peer_id) is not None
        except Exception as e:  # still unreachable: try again at the next check
            logger.debug(f"rejoin: {maddr} did not answer: {e!r}")
    return answered


class DHTRejoiner(threading.Thread):
    """Checks one DHT every ``period`` s until stopped or the DHT is shut down; counts successful rejoins."""

    def __init__(self, dht: hivemind.DHT, period: float = CHECK_PERIOD_S):
        super().__init__(name="dht-rejoiner", daemon=True)
        self.dht, self.period, self.rejoins = dht, period, 0
        self._stopping = threading.Event()

    def run(self) -> None:
        alone = False
        while not self._stopping.wait(self.period) and self.dht.is_alive():
            try:
                answered = self.dht.run_coroutine(rejoin_if_alone, return_future=True).result(timeout=self.period)
            except Exception as e:  # the DHT is shutting down or busy: check again later
                logger.debug(f"rejoin check failed: {e!r}")
                continue
            if answered:
                self.rejoins += 1
                logger.warning(f"Our DHT had lost every peer; rejoined through {answered} initial peer(s)")
            elif answered == 0 and not alone:
                logger.warning(f"Our DHT has lost every peer; dialing the initial peers every {self.period:.0f}s")
            alone = answered == 0

    def stop(self) -> None:
        self._stopping.set()


def keep_dht_connected(dht: hivemind.DHT, period: float = CHECK_PERIOD_S) -> DHTRejoiner:
    """Start (once per DHT) the thread that re-bootstraps `dht` after it lost every peer; returns it."""
    with _registry_lock:
        rejoiner = _rejoiners.get(dht)
        if rejoiner is None or not rejoiner.is_alive():
            rejoiner = _rejoiners[dht] = DHTRejoiner(dht, period)
            rejoiner.start()
        return rejoiner


def rejoin_count(dht: hivemind.DHT) -> int:
    """How often `dht` rejoined the swarm (0 if nobody keeps it connected)."""
    rejoiner = _rejoiners.get(dht)
    return 0 if rejoiner is None else rejoiner.rejoins
