"""A peer's network link cut, then restored; run inside a fresh network namespace (``unshare -rn``).

Topology, all inside namespaces this script creates: two survivors (DecentralizedSGD in this process) on 10.77.0.1,
the end v0 of a veth pair; the third peer (tests/fault_peer.py) in a nested namespace of its own on 10.77.0.2, the
other end v1. Cutting the link = ``ip link set v0 down`` (packets are dropped, connections hang, as when a cable is
pulled); restoring = ``ip link set v0 up``. Writes OUT/summary.json; exits non-zero if a phase never happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fault_peer  # noqa: E402
from dsgd_swarm import Swarm, averaged_tensors, make_model, wait_until  # noqa: E402

SURVIVOR_HOST, VICTIM_HOST = "10.77.0.1", "10.77.0.2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)


def start_victim(out: Path, initial_peers: list[str]) -> subprocess.Popen:
    """fault_peer.py in a nested network namespace that receives v1 once it exists (moved there by pid)."""
    configure = (
        f"until ip link show v1 >/dev/null 2>&1; do sleep 0.05; done; ip link set lo up; "
        f'ip addr add {VICTIM_HOST}/24 dev v1; ip link set v1 up; exec "$0" "$@"'
    )
    command = fault_peer.command(
        out, initial_peers, "applied", "--host_maddrs", f"/ip4/{VICTIM_HOST}/tcp/0", "--value", "4"
    )
    out.mkdir(parents=True)
    log = open(out / "log.txt", "w")  # the process outlives this function
    victim = subprocess.Popen(
        ["unshare", "-n", "sh", "-c", configure, *command], stdout=log, stderr=log, start_new_session=True
    )  # its own group: the daemons it starts die with it
    # move v1 only once the child is in its own namespace: moved earlier (unshare(2) not called yet, as on a busy
    # machine), v1 stays in ours and the victim waits for it forever
    ours, deadline = os.readlink("/proc/self/ns/net"), time.monotonic() + 30
    while os.readlink(f"/proc/{victim.pid}/ns/net") == ours:
        assert victim.poll() is None and time.monotonic() < deadline, "the victim's network namespace did not appear"
        time.sleep(0.01)
    ip("link", "set", "v1", "netns", str(victim.pid))
    return victim


def main(out: Path) -> None:
    ip("link", "set", "lo", "up")
    ip("link", "add", "v0", "type", "veth", "peer", "name", "v1")
    ip("addr", "add", f"{SURVIVOR_HOST}/24", "dev", "v0")
    ip("link", "set", "v0", "up")
    swarm = Swarm(host_maddrs=[f"/ip4/{SURVIVOR_HOST}/tcp/0"])
    victim = None
    summary: dict = {}
    try:
        survivors = [swarm.peer(make_model(0.0)), swarm.peer(make_model(2.0))]
        victim = start_victim(out / "victim", [str(addr) for addr in swarm.dhts[0].get_visible_maddrs()])
        for peer in survivors:
            swarm.train(peer, update=lambda peer=peer: peer.model[0].weight.add_(1e-3))
        ids = {str(p.peer_id) for p in survivors}

        def log_tail() -> str:
            return (out / "victim" / "log.txt").read_text()[-3000:]

        wait_until(lambda: (out / "victim" / "marker").exists() or victim.poll() is not None, 180, log_tail)
        assert victim.poll() is None, log_tail()
        victim_id = (out / "victim" / "peer_id.txt").read_text()

        def applied(since: float, group_ok) -> list[list[dict]]:
            return [
                [r for r in p.records if r["applied"] and r["t_start"] > since and group_ok(set(r["group"]))]
                for p in survivors
            ]

        def with_victim(group: set) -> bool:
            return victim_id in group

        def survivors_only(group: set) -> bool:
            return group <= ids

        wait_until(lambda: all(applied(0, with_victim)), 120, lambda: [p.records[-3:] for p in survivors])
        ip("link", "set", "v0", "down")
        cut_at = time.time()
        wait_until(
            lambda: all(len(rounds) >= 2 for rounds in applied(cut_at, survivors_only)),
            120,
            lambda: [p.records[-3:] for p in survivors],
        )
        resumed_at = time.time()
        ip("link", "set", "v0", "up")
        restored_at = time.time()
        wait_until(lambda: any(applied(restored_at, with_victim)), 180, lambda: [p.records[-3:] for p in survivors])
        rejoined_at = time.time()
        swarm.stop_training()
        summary = {
            "victim_alive": victim.poll() is None,
            "survivor_rounds_during_cut": [len(r) for r in applied(cut_at, survivors_only)],
            "rounds_with_victim_after_restore": [len(r) for r in applied(restored_at, with_victim)],
            "survivors_finite": all(torch.isfinite(t).all().item() for p in survivors for t in averaged_tensors(p)),
            "survivors_alive": all(p.averager.is_alive() for p in survivors),
            "seconds_to_resume_after_cut": resumed_at - cut_at,
            "seconds_to_rejoin_after_restore": rejoined_at - restored_at,
            "errors_during_cut": [
                r["error"] for p in survivors for r in p.records if r["error"] and cut_at < r["t_start"] < restored_at
            ],
        }
    finally:
        if victim is not None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(timeout=30)
        swarm.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
