"""Smoke test for benchmarks/bench_learning.py: ``--quick`` (digits, swav_tiny, 1 seed, 2 epochs) with one box alone
against a swarm of 3 boxes at the same recipe, plus the floors; then a second invocation into the same folder,
which must refuse.

No accuracy assertions: the benchmark's numbers come from its full run. This proves the code path: every mode trains
the same budget (the swarm's boxes each a share of it, so fewer steps each than alone), checkpoints along the run
are evaluated (kNN on the whole val split, the fixed held-out SwAV loss), the swarm's samples come from its boxes'
checkpoints and its rounds from their logs, and JSON (with the git commit), table and plot are written."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_learning  # noqa: E402


def finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@pytest.mark.long
@pytest.mark.xdist_group("swarm_scenarios")
@pytest.mark.timeout(900)
def test_bench_learning_quick_alone_and_swarm(digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "learning"
    reports = {name: tmp_path / f"learning.{name}" for name in ("json", "md", "png")}
    arguments = [
        "--quick",
        "--data_path",
        str(digits_dir),
        "--modes",
        "alone",
        "swarm",
        "random_init",
        "raw_pixels",
        "--out",
        str(out),
        "--json",
        str(reports["json"]),
        "--markdown",
        str(reports["md"]),
        "--plot",
        str(reports["png"]),
    ]
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), *arguments]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "expected about" in proc.stdout

    result = json.loads(reports["json"].read_text())
    settings = result["settings"]
    assert settings["git"]["commit"] and isinstance(settings["git"]["dirty"], bool)
    recipe = settings["recipe"]
    assert recipe["config"] == "swav_tiny" and recipe["epochs"] == 6 and recipe["boxes"] == 3
    assert recipe["budget_samples"] == recipe["alone_steps"] * recipe["batch"]
    assert settings["dataset"]["val_images"] == settings["evaluation"]["knn_queries"]  # the whole val split
    runs = {run["mode"]: run for run in result["runs"]}
    assert set(runs) == {"alone", "swarm", "random_init", "raw_pixels"}
    for mode in ("alone", "swarm"):
        run = runs[mode]
        assert "error" not in run, run
        assert run["same_initial_model"], mode  # both started from the seed's initial model
        assert 0.0 < run["knn"] <= 1.0 and finite(run["heldout_loss"]) and run["heldout_loss"] > 0
        curve = run["curve"]
        # the initial model, the checkpoints every box has, the final ones: a swarm box that started late on a loaded
        # machine may end (the swarm's budget done) before its first checkpoint, leaving no shared middle point
        assert curve[0]["steps"] == 0 and curve[0]["samples"] == 0 and len(curve) >= (3 if mode == "alone" else 2)
        assert all(finite(point[key]) for point in curve for key in ("steps", "samples", "knn", "heldout_loss"))
        assert [point["steps"] for point in curve] == sorted(point["steps"] for point in curve)
    alone, swarm = runs["alone"], runs["swarm"]
    assert alone["steps_per_box"] == [recipe["alone_steps"]]
    assert alone["samples_of_swarm"] == recipe["budget_samples"]
    assert len(swarm["steps_per_box"]) == 3
    # the boxes shared the budget (the quick budget is seconds of training: a box that started first can train most
    # of it while the others start up, seen 174 of 174 steps; test_swarm_schedule checks the shares on a longer run)
    assert sum(swarm["steps_per_box"]) < 3 * recipe["alone_steps"], swarm["steps_per_box"]
    assert swarm["samples_of_swarm"] >= recipe["budget_samples"]  # each box stopped when the swarm had trained on it
    # the swarm averaged; not every box need have: the quick budget is seconds of training, and a box whose start-up
    # took longer (a loaded machine) can end before its first round applies (seen: rounds 1, 0, 0 per box)
    assert sum(swarm["rounds_applied_per_box"]) >= 1, swarm["rounds_per_box"]
    assert finite(swarm["steps_per_round"]) and swarm["steps_per_round"] > 0
    assert 0.0 < runs["random_init"]["knn"] <= 1.0 and 0.0 < runs["raw_pixels"]["knn"] <= 1.0

    summary = {entry["mode"]: entry for entry in result["summary"]}
    assert summary["swarm"]["steps_per_box_mean"] <= summary["alone"]["steps_per_box_mean"]
    assert summary["swarm"]["seeds_compared_with_alone"] == 1
    table = reports["md"].read_text()
    for row in ("| alone |", "| swarm |", "| random_init |", "| raw_pixels |", "steps per box to alone's kNN"):
        assert row in table
    assert reports["png"].stat().st_size > 0

    capsys.readouterr()
    assert bench_learning.main(arguments) == 2  # a second invocation into the same folder: refused before training
    assert "is not empty: its checkpoints would be resumed" in capsys.readouterr().err


def test_crossing_interpolates_and_says_not_reached() -> None:
    curve = [
        {"steps": 0, "samples": 0, "knn": 0.5},
        {"steps": 10, "samples": 480, "knn": 0.7},
        {"steps": 20, "samples": 960, "knn": 0.9},
    ]
    assert bench_learning.crossing(curve, 0.8, "steps") == 15.0
    assert bench_learning.crossing(curve, 0.8, "samples") == 720.0
    assert bench_learning.crossing(curve, 0.5, "steps") == 0
    assert bench_learning.crossing(curve, 0.95, "steps") is None
