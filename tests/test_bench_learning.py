"""Smoke test for benchmarks/bench_learning.py: the untrained floor (with BatchNorm statistics of the training
split, and as is) and the ddp reference (VISSL's stock task, two local processes over gloo) on a few steps with a
recipe override, then a second invocation into the same folder, which must refuse.

No accuracy assertions: the benchmark's numbers come from its full run. This proves the code path: the schedule
gives ddp the planned steps per process, ddp starts from the seed's initial model and trains with the override,
checkpoints along the run are evaluated, and JSON, table and plot are written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_learning  # noqa: E402


def test_bench_learning_smoke(digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "learning"
    reports = {name: tmp_path / f"learning.{name}" for name in ("json", "md", "png")}
    arguments = [
        "--data_path", str(digits_dir), "--modes", "random_init", "ddp", "--seeds", "1", "--peers", "2",
        "--steps", "4", "--curve_points", "2", "--out", str(out), "--json", str(reports["json"]),
        "--markdown", str(reports["md"]), "--plot", str(reports["png"]),
        "--override", "config.LOSS.swav_loss.temperature=0.2",
    ]  # fmt: skip
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), *arguments]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "expected about" in proc.stdout

    result = json.loads(reports["json"].read_text())
    settings = result["settings"]
    assert settings["steps_per_peer"] == 4 and settings["epochs_per_mode"]["ddp"] == 2 * settings["epochs"]
    assert settings["overrides"] == ["config.LOSS.swav_loss.temperature=0.2"]
    floor, stock_bn, ddp = result["runs"]
    assert floor["mode"] == "random_init" and 0.0 < floor["accuracy"] <= 1.0
    assert stock_bn["mode"] == "random_init_stock_bn" and 0.0 < stock_bn["accuracy"] <= 1.0
    assert floor["accuracy"] != stock_bn["accuracy"]  # the floor's BatchNorm statistics were recomputed
    assert ddp["mode"] == "ddp" and "error" not in ddp, ddp
    trained_with = yaml.safe_load((out / "ddp/seed0/ddp/train_config.yaml").read_text())
    assert trained_with["LOSS"]["swav_loss"]["temperature"] == 0.2
    assert ddp["steps_per_peer"] == [4]  # each process took the steps a swarm peer takes
    assert ddp["same_initial_model"]  # VISSL loaded the weights the swarm peers of this seed build
    assert ddp["curve"][0] == [0, stock_bn["accuracy"]] and [iteration for iteration, _ in ddp["curve"]] == [0, 2, 4]
    assert 0.0 < ddp["accuracy"] <= 1.0 and ddp["wall_s"] > 0
    summary = {entry["mode"]: entry for entry in result["summary"]}
    assert summary["ddp"]["curve"][-1][0] == 4 * settings["batch"]  # x axis: samples seen per process
    table = reports["md"].read_text()
    assert "| ddp |" in table and "| random_init_stock_bn |" in table and reports["png"].stat().st_size > 0

    capsys.readouterr()
    assert bench_learning.main(arguments) == 2  # a second invocation into the same folder: refused before training
    assert "is not empty: its checkpoints would be resumed" in capsys.readouterr().err
