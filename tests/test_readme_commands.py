"""The README's commands and code run as written, so the README cannot drift from the code."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, trainer_env

README = (REPO / "README.md").read_text()


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def test_readme_shows_the_two_commands_and_makefile_has_them() -> None:
    assert "make demo" in README and "make test" in README
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, flags=re.MULTILINE) and re.search(r"^test:", makefile, flags=re.MULTILINE)
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_plain_pytorch_snippet_runs() -> None:
    """The README's plain-PyTorch loop, as the first peer of a swarm (nobody to average with yet)."""
    (snippet,) = readme_python_blocks()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    inputs, targets = torch.randn(64, 8), torch.randint(0, 2, (64,))
    loader = [(inputs[i : i + 16], targets[i : i + 16]) for i in range(0, 64, 16)]
    snippet = snippet.replace("/ip4/0.0.0.0/tcp/31337", "/ip4/127.0.0.1/tcp/0")  # loopback only in tests
    assert "/ip4/127.0.0.1/tcp/0" in snippet
    namespace = {"INITIAL_PEERS": [], "model": model, "loader": loader, "loss_fn": torch.nn.functional.cross_entropy}
    before = [p.detach().clone() for p in model.parameters()]
    exec(compile(snippet, "README.md", "exec"), namespace)  # noqa: S102 (our own README)
    assert namespace["opt"].local_step == len(loader)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # it trained


def run_demo(digits_dir: Path, out: Path, minutes: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "demo.py"), "--data_path", str(digits_dir), "--peers", "2", "--minutes",
         str(minutes), "--min_matchmaking_time", "2", "--out", str(out)],
        cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=420,
    )


@pytest.mark.timeout(900)
def test_demo_in_a_short_mode_twice_in_one_folder(digits_dir: Path, tmp_path: Path) -> None:
    """`make demo` runs demo.py: here with 2 peers for a few seconds of training, twice in the same folder. Each run
    is a new demo: it trains from scratch (does not resume the first run's checkpoints) and its table describes
    only its own peers; it ends with the table and the plot, and without a traceback."""
    out = tmp_path / "demo_out"
    for run in (1, 2):
        result = run_demo(digits_dir, out, minutes=0.05)
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"run {run}: {output[-3000:]}"
        assert "Traceback" not in output, f"run {run}: {output[-3000:]}"
        assert "traceback(s)" not in output, f"run {run}: {output[-3000:]}"  # nor in a peer's log (demo warns)
        assert "--initial_peers /ip4/127.0.0.1/tcp/" in result.stdout  # the join line
        header = ("| peer | steps | own_samples | swarm_samples | final_loss | rounds | mean_group_size "
                  "| mean_staleness |")
        assert header in result.stdout
        assert (out / "swarm.png").stat().st_size > 10_000
        rows = [line for line in result.stdout.splitlines() if line.startswith("| peer") and "steps" not in line]
        assert len(rows) == 2 and all(int(row.split("|")[2]) > 0 for row in rows), f"run {run}: {rows}"
        for peer in ("peer0", "peer1"):
            log = (out / f"{peer}.log").read_text()
            assert "Resume from file" not in log, f"run {run}: {peer} resumed an earlier demo's checkpoint"
        first_step = json.loads((out / "peer0" / "progress.jsonl").read_text().splitlines()[0])["step"]
        assert first_step <= 5, f"run {run}: peer0 started at step {first_step}, not from scratch"
        assert (out / "summary.md").read_text().strip() == "\n".join(
            line for line in result.stdout.splitlines() if line.startswith("|"))


def test_demo_refuses_a_folder_it_did_not_make(tmp_path: Path) -> None:
    (tmp_path / "thesis.tex").write_text("not a demo's")
    result = subprocess.run([sys.executable, str(REPO / "demo.py"), "--out", str(tmp_path)], cwd=REPO,
                            env=trainer_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "is not empty and no demo made it" in result.stderr, result.stderr
    assert (tmp_path / "thesis.tex").read_text() == "not a demo's"


def test_demo_whose_peers_do_not_train_says_so(tmp_path: Path) -> None:
    """A demo whose first peer cannot start (no images at --data_path): the table shows it, the demo says why and
    exits non-zero."""
    result = subprocess.run([sys.executable, str(REPO / "demo.py"), "--data_path", str(tmp_path / "nothing"),
                             "--peers", "2", "--out", str(tmp_path / "out")], cwd=REPO, env=trainer_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "| peer0 | 0 |" in result.stdout and "| peer1 | 0 |" in result.stdout
    assert "error: the demo failed: peer0 did not train" in result.stderr
    assert "peer0 exited with code 2 ('error: --data_path" in result.stderr  # with the peer's own error
    assert "Traceback" not in result.stdout + result.stderr


def cited_results(text: str) -> set[str]:
    """The files under benchmarks/results/ the text names, with ``name.{json,md}`` spelled out."""
    names = set()
    for stem, suffixes, plain in re.findall(r"benchmarks/results/(?:([\w-]+)\.\{([\w,]+)\}|([\w.-]*\w))", text):
        names |= {f"{stem}.{suffix}" for suffix in suffixes.split(",")} if stem else {plain}
    return names


def test_readme_cites_only_results_that_exist_and_holds_no_placeholder() -> None:
    """A number in the README comes with its results file; gpu_check's are written on a CUDA box (none has run),
    learning's by the full learning benchmark (hours on 2 cores; not run yet: the README says so)."""
    not_run_yet = {"gpu_check.json", "gpu_check.md", "learning.json", "learning.md", "learning.png"}
    assert {"soak.json"} | not_run_yet <= cited_results(README)
    missing = sorted(n for n in cited_results(README) - not_run_yet
                     if not (REPO / "benchmarks" / "results" / n).exists())  # fmt: skip
    assert not missing, f"the README cites results that are not in benchmarks/results/: {missing}"
    placeholders = re.findall(r"^[A-Z][A-Z_]{5,}$", README, flags=re.MULTILINE)
    assert not placeholders, f"the README holds placeholders instead of measured tables: {placeholders}"
