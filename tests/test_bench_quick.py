"""Every benchmark's ``--quick``, so that none of them rots: each runs its real code path (real peers, real links,
real training) in minutes, and its JSON has the fields its chapter in benchmarks/README.md reads.

bench_averaging, bench_learning and bench_optimizer run their ``--quick`` in test_bench_averaging.py,
test_bench_learning.py and test_bench_optimizer.py, which check more of it; the GPU check is no benchmark
(scripts/gpu_check.py, test_gpu_check.py). ``make test-long`` lists every test it passed (``-rp``): these are
``test_quick[<benchmark>]``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, trainer_env
from tests.test_bench_optimizer import digits_idx

# benchmark: (its arguments besides --quick and the JSON's path, the fields its chapter reads: "a.b" is
# result["a"]["b"], "runs.0.x" the first run's x)
QUICK: dict[str, tuple[list[str], list[str]]] = {
    "soak": (
        [],
        [
            "survivor_crashes",
            "nonfinite_events",
            "success_ratio_after_faults",
            "rounds_attempted_after_faults",
            "rss_growth_ratio",
            "faults",
            "restarts_rejoined",
            "config.git.commit",
        ],
    ),
    "bench_consensus": (
        [],
        ["commit", "runs.0.mode", "runs.0.consensus_s", "runs.0.failed_share", "runs.0.rounds_per_min"],
    ),
    "bench_nat": (
        ["--out", "{tmp}/nat"],
        ["commit", "rows.0.scenario", "rows.0.natted_rounds_applied", "rows.0.rounds_per_min_per_box"],
    ),
    "bench_preflight": ([], ["meta.commit", "results.0.regime", "results.0.rows.0.exit_code"]),
    "bench_restart": ([], ["commit", "first_round_s_median", "runs.0.first_round_s", "runs.0.dialed_known_peers"]),
    "traffic": ([], ["meta.commit", "rows.0.config", "rows.0.values", "rows.0.sent_per_round_mb_group4"]),
    "bench_time_to_trunk": (
        ["--out", "{tmp}/trunk", "--data_dir", "{tmp}/idx"],  # Fashion-MNIST's IDX files, of the digits
        [
            "git.commit",
            "emulations.0.aimed_ratio",
            "emulations.0.emulated_mbit",
            "emulations.0.swarm_flags",
            "summary.0.arms.alone.time_to_target_s",
            "summary.0.arms.swarm.accuracy_at_half",
            "summary.0.arms.swarm.allreduce_s",
            "summary.0.check.0.measured",
        ],
    ),
}

NEEDS = {"bench_nat": ("unshare", "nsenter", "ip", "iptables"), "bench_preflight": ("unshare", "ip", "tc")}


def field(result: dict, path: str) -> object:
    value: object = result
    for part in path.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]  # KeyError/IndexError: a missing field
    return value


@pytest.mark.long
@pytest.mark.xdist_group("swarm_scenarios")
@pytest.mark.timeout(420)
@pytest.mark.parametrize("benchmark", list(QUICK))
def test_quick(benchmark: str, tmp_path: Path) -> None:
    missing_tools = [tool for tool in NEEDS.get(benchmark, ()) if shutil.which(tool) is None]
    if missing_tools:  # as the NAT tests: the short summary says why (make test-tools installs iptables)
        pytest.skip(f"{benchmark} needs {', '.join(missing_tools)}")
    arguments, fields = QUICK[benchmark]
    out = tmp_path / f"{benchmark}.json"
    nat_json = tmp_path / "nat.json"  # bench_nat writes <--out>.json
    if "{tmp}/idx" in arguments:  # a fresh machine lacks Debian's dataset-fashion-mnist
        digits_idx(tmp_path / "idx")
    command = [sys.executable, "-m", f"benchmarks.{benchmark}", "--quick"]
    command += [argument.format(tmp=tmp_path) for argument in arguments]
    command += [] if benchmark == "bench_nat" else ["--json", str(out)]
    proc = subprocess.run(command, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((nat_json if benchmark == "bench_nat" else out).read_text())
    missing = []
    for path in fields:
        try:
            field(result, path)
        except (KeyError, IndexError, TypeError):
            missing.append(path)
    assert not missing, f"{benchmark}'s JSON lacks {missing}: {json.dumps(result)[:2000]}"
