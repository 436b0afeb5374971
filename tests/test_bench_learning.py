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

from benchmarks import bench_learning, learning_churn, learning_eval, learning_report

ROOT = Path(__file__).resolve().parents[1]


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
    command = [sys.executable, "-m", "benchmarks.bench_learning", *arguments]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "expected about" in proc.stdout

    result = json.loads(reports["json"].read_text())
    settings = result["settings"]
    assert settings["git"]["commit"] and isinstance(settings["git"]["dirty"], bool)
    recipe = settings["recipe"]
    assert recipe["config"] == "swav_tiny" and recipe["epochs"] == 4 and recipe["boxes"] == 3
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
    assert learning_eval.reached(curve, 0.8, "steps") == 15.0
    assert learning_eval.reached(curve, 0.8, "samples") == 720.0
    assert learning_eval.reached(curve, 0.5, "steps") == 0
    assert learning_eval.reached(curve, 0.95, "steps") is None


@pytest.mark.long
@pytest.mark.xdist_group("swarm_scenarios")
@pytest.mark.timeout(900)
def test_bench_learning_quick_churn_box_comes_back_with_the_swarms_state(digits_dir: Path, tmp_path: Path) -> None:
    """swarm_churn on --quick: box 2's session is SIGKILLed at a third of its steps and started again with its own
    command; it resumes its checkpoint, takes the swarm's state, trains to the end of the budget, and the run's record
    says what it lost and where in the budget it left and came back. Paced (0.3 s a step: ~50 s of training per box)
    so that the restart (~10-15 s here) is back before the others finish even when the suite loads the cores."""
    out, report = tmp_path / "learning", tmp_path / "churn.json"
    arguments = ["--quick", "--data_path", str(digits_dir), "--modes", "swarm_churn", "--curve_points", "4"]
    arguments += ["--epochs", "6", "--train_images", "0"]  # 174 steps a box: time for the restart to come back
    arguments += ["--churn_pace_s", "0.3"]
    arguments += ["--out", str(out), "--json", str(report), "--markdown", str(tmp_path / "churn.md")]
    command = [sys.executable, "-m", "benchmarks.bench_learning", *arguments]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads(report.read_text())
    recipe, (run,) = result["settings"]["recipe"], result["runs"]
    assert "error" not in run, run
    churn = run["churn"]
    assert churn["box"] == 2 and churn["kill_step_planned"] == recipe["shared_steps"] // 3
    assert churn["killed_at_step"] >= churn["kill_step_planned"], churn  # the kill waits for its step to be logged
    # curve_points 4: a checkpoint every ceil(174 / 4) = 44 steps, the kill at 58: it resumed step 44, lost the rest
    assert 0 < churn["resumed_step"] < churn["killed_at_step"], churn
    assert churn["lost_steps"] == churn["killed_at_step"] - churn["resumed_step"]
    assert 0 <= churn["steps_not_in_a_round"] <= churn["killed_at_step"]
    # it came back into the swarm's budget, after it left, and trained in it
    assert churn["swarm_samples_at_kill"] < churn["swarm_samples_at_rejoin"] < recipe["budget_samples"], churn
    assert 0 < churn["away_share_of_budget"] < 1 and churn["steps_after_rejoin"] > 0, churn
    assert run["samples_of_swarm"] >= recipe["budget_samples"] and run["same_initial_model"]
    log = (out / "swarm_churn" / "seed0" / "box2.log").read_text()
    assert log.count("Resume from file") == 1 and "is behind the swarm" in log  # the README's restart
    summary = result["summary"][0]
    assert summary["mode"] == "swarm_churn" and summary["churn_mean"]["lost_steps"] == churn["lost_steps"]
    assert "swarm_churn, per seed" in (tmp_path / "churn.md").read_text()
    assert result["settings"]["averaging"]["churn_pace_s"] == {"swarm_churn": 0.3}


def test_paired_differences_are_seed_by_seed_and_skip_failed_runs() -> None:
    runs = [
        {"mode": "swarm", "seed": 0, "knn": 0.70, "heldout_loss": 5.5},
        {"mode": "swarm", "seed": 1, "knn": 0.60, "heldout_loss": 5.6},
        {"mode": "swarm", "seed": 2, "knn": 0.65, "heldout_loss": 5.4},
        {"mode": "swarm_churn", "seed": 0, "knn": 0.68, "heldout_loss": 5.6},
        {"mode": "swarm_churn", "seed": 1, "knn": 0.60, "heldout_loss": 5.6},
        {"mode": "swarm_churn", "seed": 2, "error": "box2 was not back"},
    ]
    (entry,) = learning_report.paired_differences(runs)
    assert (entry["variant"], entry["reference"], entry["seeds"]) == ("swarm_churn", "swarm", [0, 1])
    assert entry["knn"]["per_seed"] == [-0.02, 0.0] and entry["knn"]["mean"] == -0.01
    assert entry["heldout_loss"]["per_seed"] == [0.1, 0.0] and entry["heldout_loss"]["std"] > 0
    assert "swarm_churn − swarm, seed by seed (n=2" in learning_report.differences_markdown([entry])


def test_churn_summary_counts_the_box_s_lost_and_trained_steps() -> None:
    record = {
        "box": 2,
        "killed_at_step": 42,
        "resumed_step": 32,
        "steps_not_in_a_round": 3,
        "swarm_samples_at_kill": 4000,
        "swarm_samples_at_rejoin": 8000,
    }
    churn = learning_churn.churn_summary(record, [150, 148, 70], batch=32, budget=12000)
    assert churn["steps_after_rejoin"] == 38 and churn["lost_steps"] == 10
    assert churn["lost_samples_of_box"] == 320 and churn["lost_samples_of_swarm"] == 96
    assert churn["share_of_steps"] == round(80 / 378, 4) and churn["away_share_of_budget"] == round(4000 / 12000, 4)
    assert bench_learning.restart_flags(["--run_id", "x", "--load_state_timeout", "0", "--outer_nesterov"]) == [
        "--run_id",
        "x",
        "--outer_nesterov",
    ]


class LoggedSteps:
    """A peer's logged steps only (what restart_due reads)."""

    def __init__(self, lines: list[dict]) -> None:
        self.lines = lines

    def progress(self) -> list[dict]:
        return self.lines


def test_restart_due_when_the_others_speed_brings_two_thirds_within_a_start_up() -> None:
    def box(seconds: int, position: int) -> LoggedSteps:  # 100 samples/s of its own since the kill at t=0
        return LoggedSteps([{"time": t, "own_samples": 100 * t, "swarm_samples": position} for t in range(seconds + 1)])

    others = [box(4, 5000), box(4, 5000)]  # 200 samples/s together: 8000 is 15 s away
    assert not learning_churn.restart_due(others, 8000, startup_s=10.0, killed_at=0.0)
    assert learning_churn.restart_due(others, 8000, startup_s=16.0, killed_at=0.0)
    assert not learning_churn.restart_due([box(2, 5000)] * 2, 8000, startup_s=99.0, killed_at=0.0)  # too soon to tell
    assert learning_churn.restart_due([box(1, 8000)] * 2, 8000, startup_s=0.0, killed_at=0.0)  # two thirds reached
