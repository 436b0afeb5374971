"""Peers on this machine, each a real ``run_trainer.py`` process on 127.0.0.1: used by the demo, the tests and
the benchmarks, so that all of them exercise exactly what a user runs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vissl_swarm.preflight import read_jsonl  # noqa: F401  (re-exported: tests and benchmarks read records with it)

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def wait_until(
    condition: Callable[[], Any], timeout: float, what: str | Callable[[], object] = "the condition", poll: float = 0.5
) -> Any:
    """Poll ``condition`` until it returns something truthy, and return that. TimeoutError otherwise, naming ``what``
    (or, if it is a callable, what it returns then: the state worth seeing when a wait fails)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"{what() if callable(what) else what} did not happen within {timeout:.0f} s")


def free_port() -> int:
    """A free TCP port on the loopback, released for the caller's process to take (a fixed --host_maddrs port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class LocalPeer:
    """One ``run_trainer.py`` process with its own checkpoint folder (progress, rounds and checkpoints in it)."""

    name: str
    out_dir: Path
    config: str = "swav_tiny"
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    prefix: list[str] = field(default_factory=list)  # a command the trainer runs under (e.g. a network namespace's)
    script: Path = REPO / "run_trainer.py"  # or a script that runs its main() with other hooks (tests/paced_trainer.py)

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / self.name

    @property
    def log_path(self) -> Path:
        return self.out_dir / f"{self.name}.log"

    def start(self, data_path: Path, initial_peers: list[str], flags: list[str], overrides: list[str]) -> None:
        """Start (or restart) the trainer; its output goes to ``<out_dir>/<name>.log``."""
        assert self.process is None or self.process.poll() is not None, f"{self.name} is still running"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        command = [
            *self.prefix,
            sys.executable,
            str(self.script),
            "--config",
            self.config,
            "--data_path",
            str(data_path),
            "--checkpoint_dir",
            str(self.checkpoint_dir),
            "--host_maddrs",
            LOOPBACK,
            *flags,
        ]
        if initial_peers:
            command += ["--initial_peers", *initial_peers]
        command += overrides
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **self.env)
        env["PYTHONPATH"] = str(REPO)
        mode = "a" if self.process is not None else "w"
        # its own session: Ctrl-C and kill reach all of its processes, and Linux's autogroup gives it a session's share
        # of the CPU. Tried: its own process group in this session (a share per process); one run of the suite beside
        # two busy processes took 26:27 with it, the run before 23:20 without (the long scenarios waited for the CPU)
        with open(self.log_path, mode) as log:
            self.process = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started_at = time.time()
        self.restarts += mode == "a"

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def exit_message(self) -> str:
        """Why the process ended, for an error message: its exit code and the last error line of its log (VISSL
        logs more after an error), else its last line; a process that exited with 0 finished its training."""
        if self.process is not None and self.process.returncode == 0:
            return f"{self.name} finished its training (exit code 0; see {self.log_path})"
        lines = [line.strip() for line in self.log_text().splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error:" in line]
        last = (errors or lines or ["(empty log)"])[-1][:300]
        return f"{self.name} exited with code {self.process.returncode} ({last!r}; see {self.log_path})"

    def join_addresses(self, timeout: float = 240.0) -> list[str]:
        """The multiaddrs of the join line this peer printed."""

        def addresses() -> list[str] | None:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(self.exit_message())
            for line in self.log_text().splitlines():
                if "run_trainer.py" in line and "--initial_peers" in line:
                    return line.split("--initial_peers", 1)[1].split()
            return None

        return wait_until(addresses, timeout, f"the join line of {self.name}")

    def progress(self) -> list[dict]:
        return read_jsonl(self.checkpoint_dir / "progress.jsonl")

    def rounds(self) -> list[dict]:
        return read_jsonl(self.checkpoint_dir / "averaging_rounds.jsonl")

    def applied_rounds(self, since: float = 0.0) -> list[dict]:
        return [r for r in self.rounds() if r.get("applied") and (r.get("t_end") or 0) >= since]

    def last_step(self) -> int:
        progress = self.progress()
        return progress[-1]["step"] if progress else 0

    def kill(self) -> None:
        """SIGKILL, as a crash or a power cut would."""
        if self.is_running():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout: float = 30.0, interrupt: bool = True) -> None:
        """Ctrl-C (the peer leaves the swarm cleanly; `interrupt=False`: it was sent already), then SIGKILL if it
        does not exit in time."""
        if not self.is_running():
            return
        if interrupt:
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def start_swarm(
    peers: list[LocalPeer],
    data_path: Path,
    flags: list[str],
    overrides: list[str],
    per_peer_overrides: Callable[[LocalPeer], list[str]] | None = None,
    first_flags: list[str] = (),
    per_peer_flags: Callable[[LocalPeer], list[str]] | None = None,
) -> list[str]:
    """Start the first peer (with ``first_flags`` too), read its join line, start the others with it; return the
    join addresses. ``per_peer_flags``: flags of each peer's own after ``flags`` (e.g. ``fixed_address``'s)."""
    extra = per_peer_overrides or (lambda peer: [])
    own_flags = per_peer_flags or (lambda peer: [])
    peers[0].start(data_path, [], [*flags, *own_flags(peers[0]), *first_flags], overrides + extra(peers[0]))
    addresses = peers[0].join_addresses()
    for peer in peers[1:]:
        peer.start(data_path, addresses, [*flags, *own_flags(peer)], overrides + extra(peer))
    return addresses


def fixed_address(peer: LocalPeer) -> tuple[list[str], list[str]]:
    """The flags that give ``peer`` an identity file and a fixed port, as the README's first box has (the same join
    address across restarts), and that address: (flags, [multiaddr])."""
    from hivemind.p2p import P2P, PeerID

    peer.out_dir.mkdir(parents=True, exist_ok=True)
    identity = peer.out_dir / f"{peer.name}.identity"
    if not identity.exists():
        P2P.generate_identity(str(identity))
    port = free_port()
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{PeerID.from_identity(identity.read_bytes())}"
    return ["--identity_path", str(identity), "--host_maddrs", f"/ip4/127.0.0.1/tcp/{port}"], [address]


def start_swarm_together(
    peers: list[LocalPeer],
    data_path: Path,
    flags: list[str],
    overrides: list[str],
    per_peer_overrides: Callable[[LocalPeer], list[str]] | None = None,
    stagger: float = 1.5,
) -> list[str]:
    """Start all peers at about the same moment, so that none trains alone for the others' start-up (as after
    ``start_swarm``, which waits for the first peer's join line): the first peer gets an identity and port made
    here, so its address is known before it runs. A joiner whose DHT comes up before the first peer listens, or
    whose first pings the busy first peer misses, keeps dialing it (``swarm.start_dht``, for --join_timeout)."""
    extra = per_peer_overrides or (lambda peer: [])
    first = peers[0]
    first_flags, addresses = fixed_address(first)
    first.start(data_path, [], [*flags, *first_flags], overrides + extra(first))
    time.sleep(stagger)
    for peer in peers[1:]:
        peer.start(data_path, addresses, flags, overrides + extra(peer))
    for peer in peers:
        peer.join_addresses()  # a RuntimeError naming the peer and its last error line if it exited
    return addresses


def stop_all(peers: list[LocalPeer], timeout: float = 30.0) -> None:
    """One Ctrl-C each, all at once (a second one would stop a peer at once instead of after its step); a peer still
    running ``timeout`` s later (counted from the wait for it) is SIGKILLed."""
    for peer in peers:
        if peer.is_running():
            os.killpg(peer.process.pid, signal.SIGINT)
    for peer in peers:
        peer.stop(timeout=timeout, interrupt=False)
