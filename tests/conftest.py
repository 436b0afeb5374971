"""Shared fixtures: the repository root, the exported real digits data, and a runner for run_trainer.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vissl_swarm import vissl_compat  # noqa: E402  (before any test imports VISSL or classy_vision)

vissl_compat.apply()

# The longest scenarios, of three or more trainers or sixteen peers, carry @pytest.mark.xdist_group("swarm_scenarios").
# `make test` runs the suite on two pytest-xdist workers (--dist loadgroup): the group goes to one worker, its tests one
# after the other, and first (xdist orders work by size, the group is the largest); the other worker takes the rest
# (unit tests, single processes, swarms of two boxes or a few small peers). Two of these scenarios at once would each
# get one core of two; one of them beside the lighter tests keeps both cores busy.


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
    """Run ``run_trainer.py`` as a user would, from the repository root."""
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
