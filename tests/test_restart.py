"""A box comes back after a crash with the command it was started with, at the DHT level:

1. the address book keeps the peers a box met (newest first, at most ``keep``), in a file that survives it, and
   learns a peer at first sight: as soon as our DHT or a round's group shows it;
2. a first box (no --initial_peers) started again dials the peers of its book and is back in their DHT;
3. a SIGKILLed DHT owner leaves neither its DHT process nor its p2p daemon behind holding its port;
4. a first box killed seconds after the others joined comes back with its own command and averages again.
The whole scenarios with run_trainer.py processes are in test_swarm_training: the first box killed and restarted,
then the whole swarm stopped with Ctrl-C and started again in another order.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import fault_peer
import hivemind
import pytest
import torch
from dsgd_swarm import FAST, Swarm, make_model, port_is_free
from hivemind.p2p import P2P, PeerID

from decentralized_sgd import DecentralizedSGD
from decentralized_sgd.hivemind_fixes import child_pids, is_running
from tests.conftest import REPO
from vissl_swarm import swarm
from vissl_swarm.address_book import AddressBook, routing_table_peers
from vissl_swarm.dht_rejoin import dht_peer_count, keep_dht_connected, rejoiner_of
from vissl_swarm.local_swarm import free_port, wait_until

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def test_address_book_keeps_the_newest_peers_in_a_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "box" / "known_peers.json"
    book = AddressBook(path, keep=2)
    assert len(book) == 0 and book.addresses() == [] and not path.exists()
    assert book.remember({"QmA": ["/ip4/10.0.0.1/tcp/1"], "QmB": ["/ip4/10.0.0.2/tcp/2"]}, now=1.0)
    assert not book.remember({"QmA": ["/ip4/10.0.0.1/tcp/1"]}, now=2.0)  # seen again, same address: no new file
    book.remember({"QmC": ["/ip4/10.0.0.3/tcp/3", "/ip4/10.0.0.3/tcp/4"], "QmEmpty": []}, now=3.0)
    again = AddressBook(path, keep=2)  # what a restarted box reads: the two most recently seen, newest first
    assert again.addresses() == [
        "/ip4/10.0.0.3/tcp/3/p2p/QmC",
        "/ip4/10.0.0.3/tcp/4/p2p/QmC",
        "/ip4/10.0.0.1/tcp/1/p2p/QmA",
    ]
    assert again.addresses(exclude=["QmC"]) == ["/ip4/10.0.0.1/tcp/1/p2p/QmA"]  # our own id is never dialed
    path.write_text("{not json")
    assert len(AddressBook(path)) == 0 and "cannot be read" in caplog.text  # a broken file: a warning, no crash
    memory_only = AddressBook(None)  # no checkpoint folder: remembers for this run only, writes nothing
    memory_only.remember({"QmA": ["/ip4/10.0.0.1/tcp/1"]})
    assert memory_only.addresses() == ["/ip4/10.0.0.1/tcp/1/p2p/QmA"]


def book_ids(path: Path) -> set[str]:
    """The peer ids in the address book at ``path``, as a restarted box would read it."""
    return {address.rsplit("/p2p/", 1)[1] for address in AddressBook(path).addresses()}


@pytest.mark.timeout(120)
def test_the_address_book_notes_a_peer_at_first_sight(tmp_path: Path) -> None:
    """The book's thread checks every 600 s here (a box's: 10 s), so only first sight can write the book: a joiner
    our DHT shows, and a groupmate a round reported (a client-mode DHT, which never enters our routing table)."""
    book_path = tmp_path / "known_peers.json"
    first = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
    others: list[hivemind.DHT] = []
    try:
        rejoiner = keep_dht_connected(first, period=600, book=AddressBook(book_path))
        addresses = [str(address) for address in first.get_visible_maddrs()]
        others.append(swarm.start_dht(swarm.SwarmSettings(host_maddrs=LOOPBACK, initial_peers=addresses)))
        joiner = str(others[0].peer_id)
        wait_until(lambda: joiner in book_ids(book_path), 60, "the joiner in the first box's address book")
        assert all("/p2p/" in address for address in AddressBook(book_path).addresses())
        others.append(hivemind.DHT(start=True, client_mode=True, host_maddrs=LOOPBACK, initial_peers=addresses))
        groupmate = str(others[1].peer_id)
        rejoiner.note([groupmate, str(first.peer_id)])  # a round's group: ourselves included
        wait_until(lambda: groupmate in book_ids(book_path), 60, "the groupmate in the first box's address book")
        assert book_ids(book_path) == {joiner, groupmate}  # never our own id
    finally:
        for dht in [*others, first]:
            dht.shutdown()


@pytest.mark.timeout(180)
def test_a_restarted_first_box_dials_the_peers_it_met(tmp_path: Path) -> None:
    book_path = str(tmp_path / "known_peers.json")
    first = swarm.start_dht(swarm.SwarmSettings(host_maddrs=LOOPBACK, address_book=book_path))
    joiners, again = [], None
    try:
        addresses = [str(address) for address in first.get_visible_maddrs()]
        joiners = [
            swarm.start_dht(swarm.SwarmSettings(host_maddrs=LOOPBACK, initial_peers=addresses)) for _ in range(2)
        ]
        rejoiner = rejoiner_of(first)
        wait_until(
            lambda: rejoiner.check() is None and len(AddressBook(book_path)) == 2,
            60,
            "both joiners in the first box's address book",
        )
        first.shutdown()
        # the joiners still have each other: nobody dials the first box again
        again = swarm.start_dht(swarm.SwarmSettings(host_maddrs=LOOPBACK, address_book=book_path))
        assert (dht_peer_count(again) or 0) >= 1  # back in the swarm at start, without --initial_peers
        wait_until(
            lambda: all(str(again.peer_id) in neighbours(joiner) for joiner in joiners),
            60,
            "the joiners knowing the restarted first box",
        )
    finally:
        for dht in [*joiners, again]:
            if dht is not None:
                dht.shutdown()
        first.shutdown()


@pytest.mark.timeout(240)
def test_the_whole_swarm_restarts_in_another_order(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """Three boxes as the README starts them (fixed ports, identity files; the others join through the first) are
    all stopped, then started again last-joined first: the first to come back finds nobody and starts anyway (it met
    peers before), the next joins it through its address book though its --initial_peers is still down, and the
    first box, back last, dials them."""
    from hivemind.p2p import P2P, PeerID

    boxes = []
    for index in range(3):
        identity = tmp_path / f"box{index}.key"
        P2P.generate_identity(str(identity))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        boxes.append(
            {
                "identity": str(identity),
                "port": port,
                "address": f"/ip4/127.0.0.1/tcp/{port}/p2p/{PeerID.from_identity(identity.read_bytes())}",
            }
        )

    def start(index: int):
        box = boxes[index]
        return swarm.start_dht(
            swarm.SwarmSettings(
                host_maddrs=[f"/ip4/127.0.0.1/tcp/{box['port']}"],
                identity_path=box["identity"],
                join_timeout=5,
                initial_peers=[] if index == 0 else [boxes[0]["address"]],
                address_book=str(tmp_path / f"box{index}" / "known_peers.json"),
            )
        )

    dhts: dict[int, object] = {}
    try:
        for index in range(3):
            dhts[index] = start(index)
        for index in range(3):  # each has noted the two others (the rejoiner does it every 10 s; here at once)
            wait_until(
                lambda index=index: (
                    rejoiner_of(dhts[index]).check() is None
                    and len(AddressBook(tmp_path / f"box{index}" / "known_peers.json")) == 2
                ),
                60,
                f"box{index}'s address book",
            )
        for index in range(3):
            dhts.pop(index).shutdown()
        for index in (2, 1, 0):
            dhts[index] = start(index)
        assert "nobody answered yet" in capfd.readouterr().err  # box2, back first, found nobody and started anyway
        ids = {index: str(dht.peer_id) for index, dht in dhts.items()}
        wait_until(
            lambda: all(set(ids.values()) - {ids[index]} <= neighbours(dht) for index, dht in dhts.items()),
            60,
            "every box knowing the two others again",
        )
    finally:
        for dht in dhts.values():
            dht.shutdown()


def neighbours(dht) -> set[str]:
    return set(dht.run_coroutine(routing_table_peers))


DHT_OWNER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from decentralized_sgd import FixedDHT
dht = FixedDHT(start=True, host_maddrs=[f"/ip4/127.0.0.1/tcp/{sys.argv[1]}"], startup_timeout=60)
print("up", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_a_killed_dht_owner_leaves_no_daemon_holding_its_port(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    owner = subprocess.Popen(
        [sys.executable, "-c", DHT_OWNER, str(port), str(REPO)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert owner.stdout.readline().strip() == "up", "the DHT owner did not start"
        dht_processes = child_pids(owner.pid)
        assert dht_processes and not port_is_free(port)
        os.kill(owner.pid, signal.SIGKILL)  # the owner only, as the OOM killer would: not its process group
        owner.wait()
        wait_until(
            lambda: port_is_free(port) and not any(is_running(pid) for pid in dht_processes),
            60,
            "the DHT process and its p2p daemon ending with their owner",
        )
    finally:
        try:
            os.killpg(owner.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class FirstBox:
    """tests/fault_peer.py as a swarm's first box (no --initial_peers, an identity file, a fixed port, an address book
    in its folder: ``swarm.start_dht`` as run_trainer.py calls it, without VISSL's start-up), in its own process group
    (the box and its DHT, averager and p2p daemon die together); started again with the same command."""

    def __init__(self, out: Path):
        self.out, self.port = out, free_port()
        out.mkdir(parents=True)
        identity = out / "box.key"
        P2P.generate_identity(str(identity))
        self.peer_id = str(PeerID.from_identity(identity.read_bytes()))
        self.address = f"/ip4/127.0.0.1/tcp/{self.port}/p2p/{self.peer_id}"
        self.book = out / "known_peers.json"
        self.command = fault_peer.command(
            out,
            [],
            "applied",
            *("--host_maddrs", f"/ip4/127.0.0.1/tcp/{self.port}", "--identity_path", str(identity)),
            *("--address_book", str(self.book), "--value", "4", "--step_s", "0.05"),
        )
        self.process: subprocess.Popen | None = None

    def start(self) -> float:
        with open(self.out / "log.txt", "a") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return time.time()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def running(self) -> bool:
        assert self.process is not None and self.process.poll() is None, self.log_tail()
        return True

    def log_tail(self) -> str:
        return (self.out / "log.txt").read_text()[-3000:]

    def rounds(self) -> list[dict]:
        """Its round records so far; a last line still being written is left for the next look."""
        path = self.out / "rounds.jsonl"
        return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


@pytest.mark.timeout(300)
def test_a_first_box_killed_seconds_after_the_others_joined_comes_back(tmp_path: Path) -> None:
    """The README's first box, two others joined through it, killed as soon as its address book lists them (a
    second or so after they joined: first sight, not the check 10 s after its start), then started again with its
    own command: it dials the peers it met and averages with them again. Before first sight, such a box had no
    address book yet and came back alone for good. The two others are DecentralizedSGD peers in this process."""
    first, others = FirstBox(tmp_path / "first"), Swarm()
    try:
        first.start()
        wait_until(lambda: first.running() and (first.out / "peer_id.txt").exists(), 120, first.log_tail)
        for value in (0.0, 2.0):
            settings = swarm.SwarmSettings(host_maddrs=LOOPBACK, initial_peers=[first.address], join_timeout=60)
            others.dhts.append(swarm.start_dht(settings, startup_timeout=60))
            model = make_model(value)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
            others.peers.append(DecentralizedSGD(optimizer, others.dhts[-1], prefix="test", model=model, **FAST))
        joiners = {str(peer.peer_id) for peer in others.peers}
        wait_until(lambda: first.running() and joiners <= book_ids(first.book), 60, "the joiners in the book")
        first.kill()
        for peer in others.peers:
            others.train(peer, update=lambda peer=peer: peer.model[0].weight.add_(1e-3), period=0.05)
        wait_until(lambda: port_is_free(first.port), 60, "the killed first box's port free again")

        restarted_at = first.start()  # the same command: no --initial_peers

        def averaged_again() -> bool:
            return first.running() and any(
                r["applied"] and r["t_start"] > restarted_at and joiners & set(r["group"] or []) for r in first.rounds()
            )

        wait_until(averaged_again, 180, lambda: (first.rounds()[-3:], first.log_tail()))
        assert "peers this box met before" in first.log_tail()  # it dialed its address book at start
        others.stop_training()
    finally:
        first.kill()
        others.close()
