"""The addresses of the peers a box has met, kept in its checkpoint folder, so that any box finds the swarm again
after a restart, the first box included: hivemind bootstraps a DHT only through ``initial_peers``, and the first box
has none. ``dht_rejoin`` dials them whenever our DHT is alone, and writes the book (``known_peers.json``: the ``keep``
most recently seen peers) atomically, from one thread per box.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import hivemind
from hivemind.dht import DHTNode

logger = logging.getLogger(__name__)

KNOWN_PEERS_FILE = "known_peers.json"


class AddressBook:
    """Peers met before, by peer id; ``path`` None: a book that remembers nothing (no checkpoint folder)."""

    def __init__(self, path: str | Path | None, keep: int = 16):
        self.path = Path(path) if path else None
        self.keep = keep
        self._peers: dict[str, dict] = self._read()

    def __len__(self) -> int:
        return len(self._peers)

    def addresses(self, exclude: Iterable[str] = ()) -> list[str]:
        """Every known multiaddr (with its ``/p2p/<id>``), most recently seen first, without ``exclude``'s peers."""
        excluded = {str(peer_id) for peer_id in exclude}
        peers = sorted(self._peers.items(), key=lambda item: -item[1]["seen"])
        return [
            f"{address}/p2p/{peer_id}"
            for peer_id, entry in peers
            if peer_id not in excluded
            for address in entry["addrs"]
        ]

    def remember(self, peers: dict[str, list[str]], now: float | None = None) -> bool:
        """Record these peers (peer id -> multiaddrs without /p2p) as seen now; True when the file changed."""
        now = time.time() if now is None else now
        changed = False
        for peer_id, addrs in peers.items():
            if not addrs:
                continue
            old = self._peers.get(peer_id)
            changed |= old is None or old["addrs"] != addrs
            self._peers[peer_id] = {"addrs": list(addrs), "seen": now}
        newest = sorted(self._peers.items(), key=lambda item: -item[1]["seen"])[: self.keep]
        changed |= len(newest) != len(self._peers)
        self._peers = dict(newest)
        if self.path is not None and changed:
            self._write()
        return changed

    def _read(self) -> dict[str, dict]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            peers = json.loads(self.path.read_text())["peers"]
            return {
                str(peer_id): {"addrs": [str(a) for a in entry["addrs"]], "seen": float(entry["seen"])}
                for peer_id, entry in peers.items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            logger.warning(
                f"ignoring the address book {self.path}, which cannot be read ({error!r}); "
                "this box will find the swarm through --initial_peers only"
            )
            return {}

    def _write(self) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps({"peers": self._peers}, indent=1))
        os.replace(partial, self.path)


async def routing_table_peers(_dht: hivemind.DHT, node: DHTNode) -> list[str]:
    """Runs in the DHT process: the peer ids in our routing table."""
    return [str(peer_id) for peer_id in node.protocol.routing_table.peer_id_to_uid]


async def dht_neighbours(dht: hivemind.DHT, node: DHTNode) -> dict[str, list[str]]:
    """Runs in the DHT process: {peer id: [multiaddr without /p2p]} of the peers in our routing table."""
    return await peer_addresses(dht, node, await routing_table_peers(dht, node))


async def peer_addresses(_dht: hivemind.DHT, node: DHTNode, peer_ids: list[str]) -> dict[str, list[str]]:
    """Runs in the DHT process: {peer id: [multiaddr without /p2p]} libp2p knows for these connected peers."""
    wanted = set(peer_ids)
    return {
        str(info.peer_id): [str(address) for address in info.addrs]
        for info in await node.p2p.list_peers()
        if str(info.peer_id) in wanted
    }
