"""The DHT-rejoin thread's first-sight watch looks often only while peers show up: once every peer it sees is in the
address book, it looks half as often after each look that finds nobody new (a look is a DHT round trip, and a swarm's
every box makes them)."""

from __future__ import annotations

import time
from pathlib import Path

import hivemind
import pytest

from vissl_swarm.address_book import AddressBook
from vissl_swarm.dht_rejoin import DHTRejoiner
from vissl_swarm.local_swarm import wait_until

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.mark.timeout(120)
def test_the_watch_backs_off_once_every_peer_is_noted(tmp_path: Path) -> None:
    """Watching every 0.2 s, a first box notes its joiner at first sight, then looks at most 6 times in the next
    8 s (at about 0.2, 0.6, 1.4, 3.0 and 6.2 s; without the back-off: 40 looks). Load only makes the looks fewer."""
    first = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
    joiner: hivemind.DHT | None = None
    book = AddressBook(tmp_path / "known_peers.json")
    rejoiner = DHTRejoiner(first, period=600, book=book, watch_period=0.2)
    looks: list[float] = []
    note_new_peers = rejoiner.note_new_peers

    def counted() -> list[str]:
        looks.append(time.monotonic())
        return note_new_peers()

    rejoiner.note_new_peers = counted  # type: ignore[method-assign]
    try:
        rejoiner.start()
        joiner = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=first.get_visible_maddrs())
        joined = f"/p2p/{joiner.peer_id}"
        wait_until(lambda: any(a.endswith(joined) for a in book.addresses()), 60, "the joiner noted at first sight")
        noted_at = time.monotonic()
        time.sleep(8.0)
        later = [t for t in looks if t > noted_at]
        assert len(later) <= 6, f"{len(later)} looks in 8 s after every peer was noted"
        assert rejoiner.is_alive()
    finally:
        rejoiner.stop()
        for dht in (joiner, first):
            if dht is not None:
                dht.shutdown()
