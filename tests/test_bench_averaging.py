"""Smoke test for benchmarks/bench_averaging.py: the whole multi-process code path on a tiny setting.

No timing assertions: this only proves the benchmark runs, cleans up, writes the documented JSON shape, and that
DecentralizedSGD actually completed averaging rounds.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = (
    "samples_per_s_per_peer", "throughput_ratio", "rounds_per_min", "staleness_steps_mean", "staleness_steps_p95",
    "duty_cycle", "group_size_mean", "rounds_failed",
)  # fmt: skip


def test_bench_averaging_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "bench_averaging.py"), "--quick", "--regimes", "sim_full",
        "--modes", "none", "improved", "--peers", "2", "--seconds", "5", "--sim-params", "100000",
        "--min-matchmaking-time", "1", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["regime"], r["mode"]) for r in runs] == [("sim_full", "none"), ("sim_full", "improved")]
    for run in runs:
        assert run["error"] is None and run["skipped"] is None, run["error"]
        assert all(field in run for field in FIELDS), sorted(run)
        assert run["samples_per_s_per_peer"] > 0
    none, improved = runs
    assert none["throughput_ratio"] == 1.0
    assert improved["rounds_applied"] > 0 and improved["rounds_per_min"] > 0
    assert improved["group_size_mean"] == 2.0
    assert "| sim_full | improved |" in proc.stdout
