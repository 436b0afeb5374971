"""Network namespaces with rate-limited links for benchmarks: every peer behind a link of its own, as on real boxes.

Why: on 127.0.0.1 an AllReduce is bound by CPU, never by bandwidth; users' boxes talk over 100 Mbit/s - 1 Gbit/s links.
Inside a user + network namespace the benchmark re-executes itself in (no root needed), each direction shaped:

    peer i's namespace: p<i> 10.79.0.<i+1>/24 --veth-- h<i> (orchestrator's namespace) --- bridge br0
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

ENV_FLAG = "BENCH_INSIDE_NETNS"  # set when this process was re-executed inside `unshare -rn`
SUBNET = "10.79.0"
BRIDGE = "br0"
_CLONE_NEWNET = 0x40000000
FRAME = 1514  # bytes of one Ethernet frame at MTU 1500


def missing_tools() -> list[str]:
    return [tool for tool in ("unshare", "ip", "tc", "nsenter") if shutil.which(tool) is None]


def inside() -> bool:
    return os.environ.get(ENV_FLAG) == "1"


def reexec_inside(argv: Sequence[str]) -> None:
    """Replace this process by itself inside a new user + network namespace (root there, nobody outside)."""
    missing = missing_tools()
    if missing:
        raise SystemExit(
            f"bandwidth-limited regimes need {', '.join(missing)} (util-linux, iproute2); install them "
            "or run without the wan_* regimes"
        )
    os.environ[ENV_FLAG] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp("unshare", ["unshare", "-rn", sys.executable, *argv])


def _run(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {result.stderr.strip()}")


def host_address(rank: int) -> str:
    return f"{SUBNET}.{rank + 1}"


def create_bridge() -> None:
    """Orchestrator, once, inside the namespace: loopback up and the bridge every peer's link plugs into."""
    _run("ip", "link", "set", "lo", "up")
    _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")


def enter_own_namespace() -> None:
    """Peer process, first thing after fork: a network namespace of its own (its link is plugged in from outside)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed: run inside `unshare -rn`")
    _run("ip", "link", "set", "lo", "up")


def _shape(netns: Sequence[str], device: str, mbit: float, small_packets: bool = False) -> None:
    """`mbit` through htb, TCP ACKs (< 128 bytes) before data as real hosts' fq_codel (absent here) sends sparse flows
    first: behind one FIFO, ACKs waited for the other direction's data. ``small_packets``: a bucket of 4 frames."""
    burst, limit = max(int(mbit * 1e6 / 8 * 0.01), 4 * FRAME if small_packets else 64 * 1024), 64 * 1024
    for command in (
        "qdisc add dev {device} root handle 1: htb default 20",
        "class add dev {device} parent 1: classid 1:1 htb rate {mbit:g}mbit burst {burst}",
        "class add dev {device} parent 1:1 classid 1:10 htb rate {ack:g}mbit ceil {mbit:g}mbit burst {burst} prio 0",
        "class add dev {device} parent 1:1 classid 1:20 htb rate {data:g}mbit ceil {mbit:g}mbit burst {burst} prio 1",
        "qdisc add dev {device} parent 1:10 bfifo limit {limit}",
        "qdisc add dev {device} parent 1:20 bfifo limit {limit}",
        "filter add dev {device} parent 1: protocol ip prio 1 u32 match u16 0x0000 0xff80 at 2 flowid 1:10",  # < 128 B
    ):
        fields = {"device": device, "mbit": mbit, "ack": mbit / 10, "data": mbit * 0.9, "burst": burst, "limit": limit}
        _run(*netns, "tc", *command.format(**fields).split())


def wait_for_own_namespace(pid: int, timeout: float) -> None:
    """Orchestrator: wait until process `pid` has left our network namespace (enter_own_namespace ran)."""
    ours, deadline = os.readlink("/proc/self/ns/net"), time.monotonic() + timeout
    while os.readlink(f"/proc/{pid}/ns/net") == ours:
        if time.monotonic() > deadline:
            raise TimeoutError(f"peer process {pid} did not enter a network namespace of its own in {timeout}s")
        time.sleep(0.01)


def plug_in(pid: int, rank: int, mbit: float | None, small_packets: bool = False) -> None:
    """Orchestrator: a veth pair from the bridge into `pid`'s namespace, each direction shaped to `mbit` (None: not)."""
    inner, outer = f"p{rank}", f"h{rank}"
    netns = ("nsenter", f"--net=/proc/{pid}/ns/net")
    _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
    if small_packets:
        for device in (outer, inner):
            _run("ip", "link", "set", device, "gso_max_size", str(FRAME))
    _run("ip", "link", "set", inner, "netns", str(pid))
    _run("ip", "link", "set", outer, "master", BRIDGE)
    _run("ip", "link", "set", outer, "up")
    _run(*netns, "ip", "addr", "add", f"{host_address(rank)}/24", "dev", inner)
    _run(*netns, "ip", "link", "set", inner, "up")
    if mbit is not None:
        _shape((), outer, mbit, small_packets)  # the peer's download
        _shape(netns, inner, mbit, small_packets)  # the peer's upload


def unplug(rank: int) -> None:
    """Orchestrator: remove a peer's link (deleting one end of a veth pair deletes both); absent is fine."""
    subprocess.run(["ip", "link", "del", f"h{rank}"], capture_output=True)
