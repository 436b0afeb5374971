"""swarm.start_dht on real hivemind DHTs on 127.0.0.1: a joiner started before the first peer listens joins once it
does, a joiner whose first pings a busy first peer misses joins once it answers, and a joiner that gives up leaves
no p2p daemon holding its port."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import hivemind
import pytest
from dsgd_swarm import port_is_free
from hivemind.p2p import P2P, PeerID

from vissl_swarm import swarm
from vissl_swarm.local_swarm import free_port


@pytest.mark.timeout(120)
def test_a_joiner_started_before_the_first_peer_joins_when_it_listens(tmp_path: Path) -> None:
    identity, port = tmp_path / "first.key", free_port()
    P2P.generate_identity(str(identity))
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{PeerID.from_identity(identity.read_bytes())}"
    started: list[hivemind.DHT] = []

    def first_peer_later() -> None:
        time.sleep(6.0)  # the joiner's first tries find nobody
        started.append(
            hivemind.DHT(start=True, host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], identity_path=str(identity))
        )

    thread = threading.Thread(target=first_peer_later)
    thread.start()
    joiner = None
    try:
        joiner = swarm.start_dht(
            swarm.SwarmSettings(initial_peers=[address], host_maddrs=["/ip4/127.0.0.1/tcp/0"], join_timeout=60)
        )
        thread.join()
        assert started and started[0].peer_id in joiner.run_coroutine(_neighbours)
    finally:
        thread.join()
        for dht in [*started, *([joiner] if joiner is not None else [])]:
            dht.shutdown()


async def _neighbours(dht: hivemind.DHT, node) -> list:
    return list(node.protocol.routing_table.uid_to_peer_id.values())


@pytest.mark.timeout(120)
def test_a_joiner_joins_a_first_peer_too_busy_to_answer_its_first_pings() -> None:
    """The first peer's DHT process answers nothing for a while (stopped, as a first box training on a loaded machine
    may be busy): its p2p daemon takes the joiner's connection, so the joiner's DHT starts, but hivemind's one
    bootstrap ping and start_dht's first pings go unanswered. The joiner keeps pinging and joins once the first peer
    answers (10 s after start_dht began), instead of failing on the first missed ping. The first peer is resumed by a
    timer started with start_dht, whatever start_dht does meanwhile: under load the joiner's DHT start itself can
    take those 10 s (then it joins at its first ping)."""
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    addresses = [str(address) for address in first.get_visible_maddrs()]
    joiner, resume = None, threading.Timer(10.0, os.kill, (first.pid, signal.SIGCONT))
    os.kill(first.pid, signal.SIGSTOP)  # the DHT process only: its p2p daemon still accepts connections
    try:
        resume.start()
        joiner = swarm.start_dht(
            swarm.SwarmSettings(initial_peers=addresses, host_maddrs=["/ip4/127.0.0.1/tcp/0"], join_timeout=60)
        )
        assert first.peer_id in joiner.run_coroutine(_neighbours)
    finally:
        resume.cancel()
        os.kill(first.pid, signal.SIGCONT)
        for dht in [*([joiner] if joiner is not None else []), first]:
            dht.shutdown()


@pytest.mark.timeout(120)
def test_a_joiner_nobody_answers_fails_clearly_and_frees_its_port() -> None:
    loop = asyncio.new_event_loop()
    silent = loop.run_until_complete(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))  # libp2p, but no DHT
    try:
        silent_address = str(loop.run_until_complete(silent.get_visible_maddrs())[0])
        for initial_peer in (silent_address, f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{silent.peer_id}"):
            port = free_port()  # a fixed port, as a user's --host_maddrs: a leftover daemon would hold it
            settings = swarm.SwarmSettings(
                initial_peers=[initial_peer], host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], join_timeout=4
            )
            with pytest.raises(
                swarm.SwarmError,
                match="could not join the swarm: none of --initial_peers answered.*first peer is running",
            ):
                swarm.start_dht(settings)
            deadline = time.monotonic() + 15
            while not port_is_free(port) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert port_is_free(port), f"a p2p daemon still holds port {port} after joining {initial_peer} failed"
    finally:
        loop.run_until_complete(silent.shutdown())
        loop.close()


@pytest.mark.timeout(120)
def test_the_join_line_runs_as_printed(tmp_path: Path) -> None:
    """The join line parses with run_trainer.py's own parser once its placeholders (each in angle brackets) are filled
    in: the same interpreter as the README's commands, a port, identity and checkpoint folder of its own, the swarm's
    recipe, and the addresses of this peer and of the initial peers it joined through (any of them lets a box in)."""
    import os
    import shlex

    import run_trainer

    first = swarm.start_dht(swarm.SwarmSettings(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    joiner = None
    try:
        first_addresses = [str(address) for address in first.get_visible_maddrs()]
        args = run_trainer.parse_args(
            ["--config", "swav_tiny", "--run_id", "joinline", "--swarm_lr", "box", "config.OPTIMIZER.num_epochs=12"]
        )
        settings = replace(
            run_trainer.swarm_settings(args), initial_peers=first_addresses, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
        )
        joiner = swarm.start_dht(settings)
        line = swarm.join_command(joiner, settings)
    finally:
        for dht in (joiner, first):
            if dht is not None:
                dht.shutdown()
    assert all(placeholder in line for placeholder in swarm.PLACEHOLDERS), line
    filled = dict(zip(swarm.PLACEHOLDERS, [str(tmp_path), "31337", "box.key", str(tmp_path / "ckpt")], strict=True))
    for placeholder, value in filled.items():
        line = line.replace(placeholder, value)
    words = shlex.split(line)
    assert words[0] == "python" or os.access(words[0], os.X_OK), words[0]
    assert words[1] == "run_trainer.py"
    args = run_trainer.parse_args(words[2:])
    assert args.config == "swav_tiny" and args.run_id == "joinline" and args.data_path == tmp_path
    assert args.host_maddrs == ["/ip4/0.0.0.0/tcp/31337"] and args.identity_path == "box.key"
    assert args.checkpoint_dir == tmp_path / "ckpt"
    assert set(first_addresses) < set(args.initial_peers)  # the joiner's own address too
    pasted = run_trainer.swarm_settings(args)
    assert pasted.initial_peers == args.initial_peers
    assert pasted.recipe == settings.recipe and pasted.run_prefix == settings.run_prefix  # the swarm's recipe
