"""Shared fixtures: the repository root, the exported real digits data, and a runner for run_trainer.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hivemind.p2p import P2P

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vissl_swarm import vissl_compat  # noqa: E402  (before any test imports VISSL or classy_vision)

vissl_compat.apply()

# A test's own hivemind.DHT must see its p2p daemon start within P2P.create's startup_timeout, 15 s by default; under
# load (two cores, load average 45) one did not. Every DHT started in a test process, and in the DHT processes it
# forks, gets 60 s, as the swarms the tests start through start_dht do; scripts a test runs pass it themselves.
P2P.create.__func__.__kwdefaults__["startup_timeout"] = 60.0

# Tests marked long (pyproject.toml) are not in `make test` but in `make test-long`: the four boxes' story of restarts
# (9 trainer starts, ~4 min alone on this machine), sixteen peers, the kill-in-matchmaking fault run, the
# hivemind.Optimizer baseline's two boxes, and the benchmarks' smoke runs; together ~870 CPU-s of the ~2,170 the whole
# suite took, which kept `make test` at 18-23 min on 2 cores.
# The longest scenarios (three or more trainers, sixteen peers, the NAT and network-cut namespaces) carry
# @pytest.mark.xdist_group("swarm_scenarios"). `make test` runs the suite on two pytest-xdist workers
# (--dist loadgroup): the group goes to one worker, its tests one after the other, and first (xdist hands out the
# largest unit first); the other worker takes the rest (unit tests, single processes, swarms of two boxes or a few
# small peers). Two of these scenarios at once would each get one core of two: a try without the group, the longest
# first, started the four-box scenario beside the sixteen peers, and a joiner's first box did not answer it in 15 s.
#
# The suite is bound by CPU (two cores), and most of it goes to peers that live for minutes, measured on this machine:
# a trainer's start (10-17 CPU-s to its first rounds), a running peer's hivemind side (averager, DHT and p2p daemon
# processes, the scheduler's ticks: 7-13 CPU-s a minute with its trainer nearly idle), and rounds (a group that fills
# at once forms again after a step or two: the slower the machine, the more rounds a fixed recipe takes). So the
# scenarios that wait for time, not steps, pace their trainers (tests/paced_trainer.py), and a scenario that trains a
# fixed recipe wants a larger group than it has (test_swarm_schedule.py).


@pytest.fixture(autouse=True)
def _scenarios_are_grouped(request: pytest.FixtureRequest) -> None:
    """Fail a grouped scenario at once if pytest-xdist did not group it. xdist marks a grouped test by a suffix on its
    node id ("...@swarm_scenarios"); on pytest 9.2 that suffix silently does not take (pytest-dev/pytest-xdist#1386)
    and the scenarios would run two at a time, unnoticed (they did, here, before requirements.txt kept pytest below
    9.2)."""
    grouped = request.node.get_closest_marker("xdist_group") is not None
    if grouped and getattr(request.config.option, "loadgroup", False) and "@" not in request.node.nodeid:
        pytest.fail(
            f"pytest-xdist did not put {request.node.name} in its group (pytest {pytest.__version__}, "
            "pytest-dev/pytest-xdist#1386): install requirements.txt (pytest<9.2), or run with TEST_WORKERS=0",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real images: scikit-learn's digits exported in ImageFolder layout (small, for speed: 32 px)."""
    from scripts.export_digits import export_digits

    out = tmp_path_factory.mktemp("digits")
    export_digits(out, size=32)
    return out


def trainer_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO)
    return env


def run_trainer(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``run_trainer.py`` as a user would, from the repository root. One deadline for every start: on a loaded
    machine even a trainer that only reports a bad input takes minutes to start."""
    return subprocess.run(
        [sys.executable, str(REPO / "run_trainer.py"), *args],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def swarm():
    """DecentralizedSGD peers on 127.0.0.1, torn down after the test (see dsgd_swarm.Swarm)."""
    from dsgd_swarm import Swarm

    swarm = Swarm()
    try:
        yield swarm
    finally:
        swarm.close()
