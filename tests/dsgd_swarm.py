"""A swarm of DecentralizedSGD peers on 127.0.0.1 for tests: hivemind DHTs, peers, trainer threads, teardown."""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import hivemind
import torch

from decentralized_sgd import DecentralizedSGD
from decentralized_sgd.scheduler import RoundSettings
from vissl_swarm import local_swarm
from vissl_swarm.swarm import SwarmSettings, start_dht

REPO = Path(__file__).resolve().parent.parent
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
JOIN_TIMEOUT_S = 60.0
FAST = dict(min_matchmaking_time=1.0, request_timeout=0.5, next_chunk_timeout=2.0, allreduce_timeout=15.0)
# For tests that check an exact mean: hivemind averages a part without a sender that missed next_chunk_timeout (and a
# peer uses its own part where a reducer did), so on a loaded machine FAST's 2 s chunk deadline can end a round
# differently on each side and move the mean for good ("Averaging: received 33.3% results"). Deadlines far above the
# load's delays keep every round whole.
WHOLE_ROUNDS = dict(next_chunk_timeout=20.0, allreduce_timeout=40.0)


def make_model(value: float | None = None, width: int = 3) -> torch.nn.Sequential:
    """Linear + BatchNorm, optionally with every parameter and float buffer set to `value`."""
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.BatchNorm1d(width))
    if value is not None:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point():
                    tensor.fill_(value)
    return model


def averaged_tensors(peer: DecentralizedSGD) -> list[torch.Tensor]:
    return [*peer.model.parameters(), peer.model[1].running_mean, peer.model[1].running_var]


def all_equal_to(peers: list[DecentralizedSGD], value: float, atol: float = 1e-5) -> bool:
    return all(torch.allclose(t, torch.full_like(t, value), atol=atol) for p in peers for t in averaged_tensors(p))


def port_is_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:``port`` (a socket of a closed connection in TIME_WAIT does not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# the tests of the optimizer poll often: their conditions are cheap and their rounds take about a second
wait_until = functools.partial(local_swarm.wait_until, poll=0.05)


def drive(peer: DecentralizedSGD, until: Callable[[], bool], timeout: float = 60.0) -> None:
    """Run the trainer loop in this thread (no local updates) until `until()` holds."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out driving {peer.peer_id}: {peer.counters}"
        peer.on_step_end()
        time.sleep(0.01)


class Trainer(threading.Thread):
    """A training loop in a thread: `step()` every `period` seconds until stopped or `until()` holds."""

    def __init__(self, step: Callable[[], None], period: float = 0.01, until: Callable[[], bool] | None = None):
        super().__init__(daemon=True)
        self.step, self.period, self.until = step, period, until
        self.stopped, self.error = threading.Event(), None

    def run(self) -> None:
        try:
            while not self.stopped.is_set() and not (self.until is not None and self.until()):
                self.step()
                time.sleep(self.period)
        except BaseException as e:  # surfaced by Swarm.stop_training
            self.error = e

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=60)


class Swarm:
    """Creates DHT nodes (all bootstrapped from the first) and peers; tears everything down afterwards."""

    def __init__(self, host_maddrs: list[str] = LOCAL):
        self.host_maddrs = host_maddrs
        self.dhts: list[hivemind.DHT] = []
        self.peers: list[DecentralizedSGD] = []
        self.trainers: list[Trainer] = []

    def dht(self) -> hivemind.DHT:
        """A DHT as a box starts it (``swarm.start_dht``: a FixedDHT that dials the first one again for up to
        ``JOIN_TIMEOUT_S``, then keeps connected), bootstrapped from the first: hivemind's own bootstrap pings once,
        and a first DHT busy on a loaded machine can miss it (seen at load 37)."""
        initial_peers = [str(address) for address in self.dhts[0].get_visible_maddrs()] if self.dhts else []
        settings = SwarmSettings(host_maddrs=self.host_maddrs, initial_peers=initial_peers, join_timeout=JOIN_TIMEOUT_S)
        self.dhts.append(start_dht(settings, startup_timeout=60))  # 16 p2p daemons at once on 2 loaded cores
        return self.dhts[-1]

    def peer(
        self, model: torch.nn.Module, lr: float = 0.0, momentum: float = 0.0, prefix: str = "test", **kwargs
    ) -> DecentralizedSGD:
        """A peer on a new DHT; peers of one ``prefix`` average together. ``RoundSettings``' fields among ``kwargs``
        go into its ``settings``."""
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        tuned = {key: kwargs.pop(key) for key in list(kwargs) if key in RoundSettings.__dataclass_fields__}
        kwargs = {**FAST, **kwargs, **({"settings": RoundSettings(**tuned)} if tuned else {})}
        peer = DecentralizedSGD(optimizer, self.dht(), prefix=prefix, model=model, **kwargs)
        self.peers.append(peer)
        return peer

    def train(self, peer: DecentralizedSGD, update: Callable[[], None] | None = None, **kwargs) -> Trainer:
        def step() -> None:
            with peer.lock:  # a local update and its step count, seen together (as DecentralizedSGD.step does)
                if update is not None:
                    with torch.no_grad():
                        update()
                peer.on_step_end()

        self.trainers.append(Trainer(step, **kwargs))
        self.trainers[-1].start()
        return self.trainers[-1]

    def stop_training(self) -> None:
        for trainer in self.trainers:
            trainer.stop()
        errors = [t.error for t in self.trainers if t.error is not None]
        assert not errors, f"a trainer thread failed: {errors!r}"

    def close(self) -> None:
        for trainer in self.trainers:
            trainer.stop()
        for peer in self.peers:
            peer.shutdown()
        for dht in reversed(self.dhts):
            dht.shutdown()
