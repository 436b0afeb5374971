"""End to end: benchmarks/bench_optimizer.py --quick with modes alone and swarm, real peers on real images: the
digits in Fashion-MNIST's IDX format (tests use the digits, which every machine has; the benchmark's own data is
Debian's dataset-fashion-mnist, which a fresh machine lacks).

It proves the code path, not the benchmark's numbers (those come from its full run): the processes start, the swarm
peers average (DecentralizedSGD over hivemind on 127.0.0.1), each peer evaluates on the 10k test images along its
run, the JSON has the documented fields, and no peer process is left behind. Outcomes only, no timings: a loaded
2-core machine makes everything slower, and the quick budget paces each swarm step to at least 100 ms, so a swarm
peer trains for ~25 s and averages several times even there (one applied round is all this asks of each).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_FIELDS = {
    "variant",
    "mode",
    "seed",
    "swarm_lr",
    "error",
    "peers",
    "curve",
    "final_accuracy",
    "steps_per_peer",
    "rounds_applied_per_peer",
    "steps_per_round",
    "wall_s",
}
PEER_FIELDS = {"rank", "batch", "steps", "local_samples", "peak_lr", "curve", "final_accuracy", "steps_per_round"}
POINT_FIELDS = {"step", "swarm_samples", "local_samples", "accuracy"}


def alive_in_sessions(sessions: list[int]) -> list[str]:
    """Processes still alive in the sessions the benchmark's peers led: their DHTs, averagers and p2pd daemons."""
    listing = subprocess.run(["ps", "-e", "-o", "sid=,pid=,args="], capture_output=True, text=True, timeout=30)
    return [line for line in listing.stdout.splitlines() if line.split() and int(line.split()[0]) in sessions]


def digits_idx(folder: Path) -> Path:
    """The 1,797 digits at 28x28 as Fashion-MNIST's four IDX files: 1,500 to train on, 297 to test."""
    from scripts.export_fashion_mnist import SPLITS
    from tests.test_export_fashion_mnist import digits_28, write_idx

    images, labels = digits_28()
    parts = {"train": slice(0, 1500), "val": slice(1500, None)}
    folder.mkdir(parents=True)
    for split, (images_stem, labels_stem) in SPLITS.items():
        write_idx(folder / f"{images_stem}.gz", images[parts[split]])
        write_idx(folder / f"{labels_stem}.gz", labels[parts[split]])
    return folder


@pytest.mark.long
@pytest.mark.timeout(300)
def test_quick_alone_and_swarm(tmp_path: Path) -> None:
    out, reports = tmp_path / "runs", {name: tmp_path / f"optimizer.{name}" for name in ("json", "md", "png")}
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_optimizer",
        "--quick",
        "--modes",
        "alone",
        "swarm",
        "ideal",
        "--data_dir",
        str(digits_idx(tmp_path / "idx")),
        "--out",
        str(out),
        "--json",
        str(reports["json"]),
        "--markdown",
        str(reports["md"]),
        "--plot",
        str(reports["png"]),
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "expected about" in proc.stdout

    result = json.loads(reports["json"].read_text())
    assert len(result["commit"]["head"]) == 40 and isinstance(result["commit"]["dirty"], bool)
    assert result["dataset"]["dir"] == str(tmp_path / "idx") and result["quick"]
    settings = result["settings"]
    assert settings["samples"] > 0 and settings["batch"] > 0 and settings["peers"] == 3
    runs = {run["variant"]: run for run in result["runs"]}
    ideal_name = f"ideal [{result['swarm_lr']}] H=25"
    assert sorted(runs) == ["alone", ideal_name, f"swarm [{result['swarm_lr']}]"]
    for run in runs.values():
        assert run["error"] is None, run["error"]
        assert RUN_FIELDS <= set(run), sorted(RUN_FIELDS - set(run))
        assert math.isfinite(run["final_accuracy"]) and run["final_accuracy"] > 0.3  # chance is 0.1
        assert len(run["curve"]) == settings["curve_points"] + 1 and run["curve"][0]["step"] == 0
        for peer in run["peers"]:
            assert PEER_FIELDS <= set(peer), sorted(PEER_FIELDS - set(peer))
            assert all(POINT_FIELDS <= set(point) for point in peer["curve"])
            assert all(math.isfinite(point["accuracy"]) for point in peer["curve"])

    alone, swarm = runs["alone"], runs[f"swarm [{result['swarm_lr']}]"]
    assert len(alone["peers"]) == 1 and alone["steps_per_peer"] == settings["samples"] // settings["batch"]
    assert len(swarm["peers"]) == 3 and swarm["steps_per_peer"] == settings["samples"] // (3 * settings["batch"])
    # the swarm-wide schedule: a swarm peer's position is its local samples x 3, so both end at S samples
    assert (
        swarm["curve"][-1]["swarm_samples"] == alone["curve"][-1]["swarm_samples"] == alone["peers"][0]["local_samples"]
    )
    # every swarm peer averaged at least once, unless this machine starved it of CPU: then the starvation monitor took
    # it out of averaging, as built, and its log says so (seen once, beside the suite with two busy processes, load
    # 20: one peer lost 76% of 5 s at its start and trained its ~20 s alone while the other two averaged 14 rounds)
    averaged = [peer for peer in swarm["peers"] if peer["rounds_applied"] >= 1]
    assert len(averaged) >= 2, swarm["peers"]
    for peer in swarm["peers"]:
        log = (Path(swarm["run_dir"]) / f"peer{peer['rank']}.log").read_text()
        assert peer in averaged or "starved of CPU" in log, (peer, log[-2000:])
    assert all(peer["steps_per_round"] is not None and peer["steps_per_round"] > 0 for peer in averaged)
    # the ideal swarm: 3 replicas in one process, an exact round every 25 local steps (none at the very end)
    ideal = runs[ideal_name]
    assert len(ideal["peers"]) == 3 and ideal["steps_per_peer"] == swarm["steps_per_peer"]
    assert all(peer["rounds_applied"] == (ideal["steps_per_peer"] - 1) // 25 for peer in ideal["peers"])
    summary = {entry["variant"]: entry for entry in result["summary"]}
    assert summary["alone"]["speedup_final"] == 1.0 and "speedup_half" in summary[swarm["variant"]]
    assert "| alone |" in reports["md"].read_text() and reports["png"].stat().st_size > 0
    sessions = [pid for run in result["runs"] for pid in run["pids"]]
    assert len(sessions) == 5 and not alive_in_sessions(sessions), "peer processes outlived the benchmark"
