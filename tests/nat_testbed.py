"""A NAT test bed in network namespaces: public boxes on one bridge, NATed boxes each behind a router of its own.

Why: users' boxes sit behind home/office routers. The flags meant for them (``--client_mode``, ``--use_auto_relay``)
can only be judged through a real NAT: the box dials out, nobody dials in. Everything lives in namespaces this
module creates inside a user + network namespace (``unshare -rn``, see ``reexec_inside``); no real interface or
address is touched.

    "internet": the bridge br0 (10.80.0.254/24) in the orchestrator's namespace
    public box i:  eth0 10.80.0.<i+1>/24 on br0
    NATed box k:   eth0 192.168.<k>.2/24 --- lan 192.168.<k>.1 [router k] wan 10.80.0.<100+k>/24 on br0

Each router forwards (ip_forward=1), masquerades what leaves through ``wan`` (as a home router does) and, as its
stateful firewall does, drops new connections from ``wan`` into the LAN. The public boxes even get a route to every
LAN through its router, so only the router's NAT + firewall keeps them out, not a missing route.
A namespace is held by a ``sleep`` process (``unshare -n``); commands enter it with ``nsenter --net``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ENV_FLAG = "NAT_TESTBED_INSIDE"  # set when this process was re-executed inside `unshare -rn`
PUBLIC_SUBNET = "10.80.0"
BRIDGE = "br0"
_link_numbers = itertools.count()


def missing_tools() -> list[str]:
    """Tools the test bed needs; iptables is in the `iptables` package (apt-get install -y iptables)."""
    return [tool for tool in ("unshare", "nsenter", "ip", "iptables") if shutil.which(tool) is None]


def inside() -> bool:
    return os.environ.get(ENV_FLAG) == "1"


def reexec_inside(argv: Sequence[str]) -> None:
    """Replace this process by itself inside a new user + network namespace (root there, nobody outside)."""
    os.environ[ENV_FLAG] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp("unshare", ["unshare", "-rn", sys.executable, *argv])


def _run(*args: str) -> str:
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {result.stderr.strip()}")
    return result.stdout


class Namespace:
    """A network namespace held by a `sleep` process; `run`/`popen` execute commands inside it."""

    def __init__(self, name: str):
        self.name = name
        self.holder = subprocess.Popen(["unshare", "-n", "sleep", "infinity"], start_new_session=True)
        ours, deadline = os.readlink("/proc/self/ns/net"), time.monotonic() + 30
        while os.readlink(f"/proc/{self.holder.pid}/ns/net") == ours:  # unshare(2) not called yet (busy machine)
            if self.holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"namespace {name}: `unshare -n` did not start (run inside `unshare -rn`)")
            time.sleep(0.01)
        self.run("ip", "link", "set", "lo", "up")

    def prefix(self) -> list[str]:
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net"]

    def run(self, *args: str) -> str:
        return _run(*self.prefix(), *args)

    def popen(self, args: Sequence[str], **kwargs) -> subprocess.Popen:
        """A process inside the namespace, in a process group of its own (its p2pd and averager die with it)."""
        return subprocess.Popen([*self.prefix(), *args], start_new_session=True, **kwargs)

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait(timeout=10)


@dataclass
class Box:
    """A box a peer runs on: its namespace and its own address (private for a NATed box)."""

    name: str
    ns: Namespace
    address: str
    router: Namespace | None = None  # None: a public box
    router_address: str | None = None  # the router's public (wan) address: what others see a NATed box come from

    @property
    def natted(self) -> bool:
        return self.router is not None


def _veth(a: Namespace | None, a_name: str, b: Namespace, b_name: str) -> None:
    """A veth pair with end `a_name` in `a` (None: the orchestrator's namespace) and end `b_name` in `b`."""
    tmp = f"nat{next(_link_numbers)}"  # a unique temporary name in our namespace
    _run("ip", "link", "add", tmp, "type", "veth", "peer", "name", f"{tmp}x")
    _run("ip", "link", "set", f"{tmp}x", "netns", str(b.holder.pid))
    b.run("ip", "link", "set", f"{tmp}x", "name", b_name)
    if a is None:
        _run("ip", "link", "set", tmp, "name", a_name)
    else:
        _run("ip", "link", "set", tmp, "netns", str(a.holder.pid))
        a.run("ip", "link", "set", tmp, "name", a_name)


class NatTestbed:
    """Create with the orchestrator inside `unshare -rn`; add boxes; `close()` removes every namespace."""

    def __init__(self) -> None:
        _run("ip", "link", "set", "lo", "up")
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{PUBLIC_SUBNET}.254/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        self.boxes: list[Box] = []
        self.namespaces: list[Namespace] = []

    def _namespace(self, name: str) -> Namespace:
        self.namespaces.append(Namespace(name))
        return self.namespaces[-1]

    def _on_bridge(self, ns: Namespace, device: str, address: str) -> None:
        outer = f"h{len(self.namespaces)}"
        _veth(None, outer, ns, device)
        _run("ip", "link", "set", outer, "master", BRIDGE)
        _run("ip", "link", "set", outer, "up")
        ns.run("ip", "addr", "add", f"{address}/24", "dev", device)
        ns.run("ip", "link", "set", device, "up")

    def public_box(self, name: str) -> Box:
        ns = self._namespace(name)
        address = f"{PUBLIC_SUBNET}.{1 + sum(not b.natted for b in self.boxes)}"
        self._on_bridge(ns, "eth0", address)
        for box in self.boxes:  # as if the ISPs routed private addresses: only the routers keep us out
            if box.natted:
                ns.run("ip", "route", "add", box.address.rsplit(".", 1)[0] + ".0/24", "via", box.router_address)
        self.boxes.append(Box(name, ns, address))
        return self.boxes[-1]

    def natted_box(self, name: str) -> Box:
        k = 1 + sum(b.natted for b in self.boxes)
        router, ns = self._namespace(f"{name}-router"), self._namespace(name)
        wan, lan, address = f"{PUBLIC_SUBNET}.{100 + k}", f"192.168.{k}.1", f"192.168.{k}.2"
        self._on_bridge(router, "wan", wan)
        _veth(router, "lan", ns, "eth0")
        router.run("ip", "addr", "add", f"{lan}/24", "dev", "lan")
        router.run("ip", "link", "set", "lan", "up")
        ns.run("ip", "addr", "add", f"{address}/24", "dev", "eth0")
        ns.run("ip", "link", "set", "eth0", "up")
        ns.run("ip", "route", "add", "default", "via", lan)
        router.run("sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        router.run("iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        router.run(
            "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP"
        )
        for box in self.boxes:
            if not box.natted:
                box.ns.run("ip", "route", "add", f"192.168.{k}.0/24", "via", wan)
        self.boxes.append(Box(name, ns, address, router, wan))
        return self.boxes[-1]

    def close(self) -> None:
        for ns in reversed(self.namespaces):
            ns.close()


def can_connect(box: Box, host: str, port: int, timeout: float = 3.0) -> bool:
    """Whether `box` can open a TCP connection to host:port (a TCP handshake, nothing sent)."""
    probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout={timeout})"
    result = subprocess.run([*box.ns.prefix(), sys.executable, "-c", probe], capture_output=True, timeout=timeout + 30)
    return result.returncode == 0


def listen_once(box: Box, port: int) -> subprocess.Popen:
    """A TCP listener on box.address:port (for can_connect checks), until killed; waits until it listens."""
    script = (
        f"import socket, time; s = socket.socket(); s.bind(({box.address!r}, {port})); s.listen(); "
        f"print('listening', flush=True); time.sleep(3600)"
    )
    listener = box.ns.popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert listener.stdout is not None and listener.stdout.readline().strip() == "listening"
    return listener


def stop(process: subprocess.Popen) -> None:
    """Kill a process started by Namespace.popen and its whole group (its p2pd daemons, its averager)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def run_orchestrator(command: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a scenario process; past `timeout` stop it with SIGTERM (see ``exit_on_sigterm``: it then removes its
    peers and namespaces, which SIGKILL would leave behind), then SIGKILL."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        stderr += f"\n(stopped after {timeout:g} s)"
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def exit_on_sigterm() -> None:
    """Scenario process: SIGTERM and SIGINT raise, so its `finally` stops its peers and namespaces (a background
    shell's children start with SIGINT ignored)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)


def read_text_when_ready(path: Path, process: subprocess.Popen, timeout: float) -> str:
    """The content of `path` once it exists; RuntimeError if `process` died first or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{path.name} never appeared (process exit code {process.poll()})")
        time.sleep(0.05)
    return path.read_text()
