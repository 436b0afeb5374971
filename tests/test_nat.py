"""Boxes behind a real NAT (tests/nat_testbed.py: a masquerading router namespace with a stateful firewall per box):
they cannot be dialed, yet they average with the others.

Each scenario runs tests/nat_scenario.py in a fresh ``unshare -rn`` namespace: (a) two public boxes + one NATed,
(b) one public box + two NATed, each behind its own router. The NATed boxes run without any flag (``none``: what
benchmarks/results/nat.md shows works, as each NATed box dials out to every peer it learns of and libp2p reuses
that connection both ways) and with ``--client_mode``. Outcomes only, with generous deadlines: no timing asserts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nat_testbed import missing_tools, run_orchestrator  # noqa: E402

from vissl_swarm.swarm import reachability_note  # noqa: E402

SCENARIO = Path(__file__).resolve().parent / "nat_scenario.py"
NATTED = {"a": ["box2"], "b": ["box1", "box2"]}


@pytest.fixture
def nat_tools() -> None:
    missing = missing_tools()
    if missing:
        pytest.skip(f"the NAT test bed needs {', '.join(missing)}: apt-get install -y iptables util-linux iproute2")
    if subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode != 0:
        pytest.skip("the NAT test bed needs user namespaces (`unshare -rn true` failed)")


def run_scenario(out: Path, scenario: str, mode: str) -> dict:
    """The scenario until every NATed box applied 2 rounds in a group of >= 2 (at most 150 s of averaging)."""
    result = run_orchestrator(
        [
            "unshare",
            "-rn",
            sys.executable,
            str(SCENARIO),
            scenario,
            mode,
            str(out),
            "--until_rounds",
            "2",
            "--measure_s",
            "150",
        ],
        timeout=360,
    )
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    assert result.returncode == 0, (result.stderr[-3000:], summary)
    return summary


@pytest.mark.xdist_group("swarm_scenarios")
@pytest.mark.timeout(420)
def test_natted_boxes_average_through_a_real_nat(tmp_path, nat_tools):
    """Both scenarios at once (each in its own namespaces; most of their time is waiting: p2pd start-up, matchmaking):
    (a) NATed box without a flag, (b) both NATed boxes in --client_mode."""
    cases = {"a": "none", "b": "client_mode"}
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {s: pool.submit(run_scenario, tmp_path / s, s, mode) for s, mode in cases.items()}
        summaries = {s: future.result() for s, future in futures.items()}
    for scenario, summary in summaries.items():
        check = summary["nat_check"]
        assert check["public_dials_natted"] == [False] * len(NATTED[scenario]), check  # the NAT keeps them out
        assert all(check["natted_dials_public"]), check  # and lets them out
        boxes = summary["boxes"]
        for name in NATTED[scenario]:
            assert boxes[name]["natted"]
            assert boxes[name]["rounds_in_group_of_2_plus"] >= 2, (scenario, boxes)  # it averaged with others
        public = [b for b in boxes.values() if not b["natted"]]
        assert any(b["rounds_with_a_natted_box"] >= 1 for b in public), (scenario, boxes)  # a public box with it


def test_the_join_line_warns_when_every_address_is_private():
    """A first peer behind NAT prints a join line only its LAN can use: the trainer says so under it."""
    natted = ["/ip4/192.168.1.2/tcp/31337/p2p/QmPeer", "/ip4/10.0.0.5/tcp/31337/p2p/QmPeer"]
    assert "only boxes in its LAN" in reachability_note(natted)
    assert "192.168.1.2" in reachability_note(natted)
    assert reachability_note(["/ip4/203.0.113.5/tcp/31337/p2p/QmPeer", *natted]) == ""  # one public address
    assert reachability_note([*natted, "/ip4/10.80.0.1/tcp/31337/p2p/QmRelay/p2p-circuit/p2p/QmPeer"]) == ""
    assert reachability_note(["/ip4/127.0.0.1/tcp/31337/p2p/QmPeer"]) == ""  # a local swarm
