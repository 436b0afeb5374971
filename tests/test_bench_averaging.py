"""Smoke test for ``python -m benchmarks.bench_averaging``: the whole multi-process code path on a tiny setting.

No timing assertions: this only proves the benchmark runs, cleans up, writes the documented JSON shape, that
DecentralizedSGD and the old design actually completed averaging rounds and were measured: rounds, staleness, how long
they held the trainer.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIELDS = (
    "samples_per_s_per_peer",
    "throughput_ratio",
    "rounds_per_min",
    "staleness_steps_mean",
    "staleness_steps_p95",
    "duty_cycle",
    "group_size_mean",
    "rounds_failed",
    "hold_s_total",
    "hold_ms_per_step",
    "hold_share",
)
MODES = ("none", "old", "improved")
# On a loaded machine a first round can fail (a follower's join request times out while its leader
# waits for it until allreduce_timeout, 20 s in --quick) and hold the trainer past a 5 s window: a window with no
# round goes on until one is applied, for at most this long. A swarm that never averages still fails the test.
EXTEND_S = 60


@pytest.mark.long
def test_bench_averaging_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_averaging",
        "--quick",
        "--regimes",
        "sim_full",
        "--modes",
        *MODES,
        "--peers",
        "2",
        "--seconds",
        "5",
        "--sim-params",
        "100000",
        "--min-matchmaking-time",
        "1",
        "--extend-until-round",
        str(EXTEND_S),
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300 + 2 * EXTEND_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["regime"], r["mode"]) for r in runs] == [("sim_full", mode) for mode in MODES]
    for run in runs:
        assert run["error"] is None and run["skipped"] is None, run["error"]
        assert all(field in run for field in FIELDS), sorted(run)
        assert run["samples_per_s_per_peer"] > 0
        assert 4.99 <= run["window_s"] <= 5 + EXTEND_S + 5, run["window_s"]
        assert run["hold_s_total"] >= 0 and run["hold_ms_per_step"] >= 0
    none, old, improved = runs
    assert none["throughput_ratio"] == 1.0
    for run in (old, improved):
        assert run["rounds_applied"] > 0 and run["rounds_per_min"] > 0, run["mode"]
        assert run["group_size_mean"] == 2.0 and run["all_finite"], run["mode"]
    # the old design averages a snapshot taken before matchmaking: its results are stale when they land
    assert old["staleness_steps_mean"] > 0
    assert "| sim_full | improved |" in proc.stdout
