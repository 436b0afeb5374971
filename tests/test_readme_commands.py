"""The README's commands and code run as written, and its numbers are the results files', so the README (and
benchmarks/README.md) cannot drift from the code or from the measurements."""

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
BENCHMARKS_README = (REPO / "benchmarks" / "README.md").read_text()
DESIGN = (REPO / "docs" / "design.md").read_text()
RESULTS = REPO / "benchmarks" / "results"
DOCS = {"README.md": README, "benchmarks/README.md": BENCHMARKS_README}


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
        [
            sys.executable,
            str(REPO / "demo.py"),
            "--data_path",
            str(digits_dir),
            "--peers",
            "2",
            "--minutes",
            str(minutes),
            "--min_matchmaking_time",
            "2",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=420,
    )


@pytest.mark.xdist_group("swarm_scenarios")
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
        header = (
            "| peer | steps | own_samples | swarm_samples | final_loss | rounds | mean_group_size | mean_staleness |"
        )
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
            line for line in result.stdout.splitlines() if line.startswith("|")
        )


def test_demo_refuses_a_folder_it_did_not_make(tmp_path: Path) -> None:
    (tmp_path / "thesis.tex").write_text("not a demo's")
    result = subprocess.run(
        [sys.executable, str(REPO / "demo.py"), "--out", str(tmp_path)],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "is not empty and no demo made it" in result.stderr, result.stderr
    assert (tmp_path / "thesis.tex").read_text() == "not a demo's"


def test_demo_whose_peers_do_not_train_says_so(tmp_path: Path) -> None:
    """A demo whose first peer cannot start (no images at --data_path): the table shows it, the demo says why and
    exits non-zero."""
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "demo.py"),
            "--data_path",
            str(tmp_path / "nothing"),
            "--peers",
            "2",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    learning's by the full learning benchmark (hours on 2 cores; not run yet: the README says so). The benchmark
    chapters and the design notes cite only results that exist too."""
    not_run_yet = {"gpu_check.json", "gpu_check.md", "learning.json", "learning.md", "learning.png"}
    assert {"soak.json"} | not_run_yet <= cited_results(README)
    for name, text in {**DOCS, "docs/design.md": DESIGN}.items():
        missing = sorted(n for n in cited_results(text) - not_run_yet if not (RESULTS / n).exists())
        assert not missing, f"{name} cites results that are not in benchmarks/results/: {missing}"
        placeholders = re.findall(r"^[A-Z][A-Z_]{5,}$", text, flags=re.MULTILINE)
        assert not placeholders, f"{name} holds placeholders instead of measured tables: {placeholders}"


# --- cited numbers -------------------------------------------------------------------------------------------------

NUMBER = re.compile(r"(?<![\d.])\d+(?:\.\d+)?(?:e[-+]?\d+)?")
CITED_STEM = re.compile(r"results/(?:([\w-]+)\.\{[\w,]+\}|([\w-]+)\.(?:md|json|png))")


def markdown_tables(text: str) -> list[tuple[str, list[str]]]:
    """(caption, body rows) of every Markdown table. The caption is the text between the previous heading or table
    and the table's header row (its command, its prose, the link to its results)."""
    lines, tables, caption, i = text.splitlines(), [], [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|[-| :]+\|", lines[i + 1]):
            body, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                body.append(lines[i])
                i += 1
            tables.append(("\n".join(caption), body))
            caption = []
            continue
        if lines[i].startswith("#"):
            caption = []
        caption.append(lines[i])
        i += 1
    return tables


def numbers_of(stems: list[str]) -> tuple[set[str], list[float]]:
    """Every number written in results/<stem>.md and results/<stem>.json (thousands separators dropped)."""
    tokens: set[str] = set()
    for stem in stems:
        for path in (RESULTS / f"{stem}.md", RESULTS / f"{stem}.json"):
            if path.exists():
                tokens |= set(NUMBER.findall(path.read_text().replace(",", "")))
    return tokens, [float(t) for t in tokens]


def occurs(number: str, tokens: set[str], values: list[float]) -> bool:
    """Written the same way in the file, or a value of the file rounded to as many decimals as the table shows
    (a JSON holds 0.98611..., the table 0.9861)."""
    if number in tokens:
        return True
    shown = float(number)
    if "e" in number:
        return any(abs(v - shown) <= 1e-12 + 1e-3 * abs(shown) for v in values)
    decimals = len(number.partition(".")[2])
    return any(abs(round(v, decimals) - shown) < 1e-9 for v in values)


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_cited_numbers_occur_in_their_results_files(doc: str) -> None:
    """The rule: a table whose caption (the text since the previous heading or table) names one or more results
    files, ``results/X.md``, ``results/X.json``, ``results/X.png`` or ``results/X.{json,md}``, is a table of those
    measurements, so every number in its body rows (labels included) must occur in ``results/X.md`` or
    ``results/X.json`` of one of them: written the same way, or as a value that rounds to it at the table's
    precision. A number copied wrong, or moved to a table with another results file, fails here. Files the caption
    names that are not made yet (the full learning run) do not count; tables whose caption names no results file
    (flags, recipes, the fault-injection tests) are not checked."""
    checked, wrong = 0, []
    for caption, body in markdown_tables(DOCS[doc]):
        named = sorted({a or b for a, b in CITED_STEM.findall(caption)})
        if not named:
            continue
        stems = [s for s in named if (RESULTS / f"{s}.md").exists() or (RESULTS / f"{s}.json").exists()]
        assert stems, f"{doc}: a table cites only results that do not exist: {named}"
        tokens, values = numbers_of(stems)
        checked += 1
        for row in body:
            numbers = NUMBER.findall(row.replace(",", ""))
            wrong += [(n, stems, row[:90]) for n in numbers if not occurs(n, tokens, values)]
    assert checked, f"{doc} has no table that cites its results file"
    assert not wrong, f"{doc}: numbers not in the results file their table cites: {wrong}"


def cited_sentences(text: str) -> list[tuple[list[str], str]]:
    """(the results stems it cites, the sentence) of every sentence of prose that cites a results file; code, tables,
    inline code, links and commit hashes are not prose numbers."""
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    prose = "\n".join(line for line in prose.splitlines() if not line.startswith("|"))
    cited = []
    for paragraph in re.split(r"\n\s*\n", prose):
        for sentence in re.split(r"(?<=[.:;])\s+(?=[A-Z(*])", " ".join(paragraph.split())):
            stems = sorted({a or b for a, b in CITED_STEM.findall(sentence)})
            if stems:
                cited.append((stems, sentence))
    return cited


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_numbers_quoted_in_prose_occur_in_the_results_files_cited(doc: str) -> None:
    """The same rule for prose: every number of a sentence that cites results files (``results/X.md`` ...) occurs in
    one of them, written the same way or rounded to the precision quoted. A README that quotes an old measurement
    after its results file was rerun fails here."""
    wrong, checked = [], 0
    for named, sentence in cited_sentences(DOCS[doc]):
        stems = [s for s in named if (RESULTS / f"{s}.md").exists() or (RESULTS / f"{s}.json").exists()]
        if not stems:
            continue
        tokens, values = numbers_of(stems)
        text = re.sub(r"`[^`]*`|\[[^\]]*\]\([^)]*\)|\b[0-9a-f]{7,40}\b", "", sentence).replace(",", "")
        checked += 1
        wrong += [(n, stems, sentence[:120]) for n in NUMBER.findall(text) if not occurs(n, tokens, values)]
    assert checked, f"{doc} quotes no measurement with its results file"
    assert not wrong, f"{doc}: numbers not in the results files their sentence cites: {wrong}"


def test_the_number_rule_catches_a_wrong_number() -> None:
    tokens, values = numbers_of(["soak"])
    assert occurs("0.9968", tokens, values) and occurs("623", tokens, values)
    assert not occurs("0.9978", tokens, values) and not occurs("624.5", tokens, values)


# --- commands --------------------------------------------------------------------------------------------------------


def bash_commands(text: str) -> list[str]:
    """The command lines of the ```bash blocks, continuation lines joined and comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        for command in re.sub(r"\\\n\s*", " ", block).splitlines():
            command = command.split(" #")[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


@pytest.mark.timeout(300)
def test_readme_commands_parse_with_the_scripts_own_parsers() -> None:
    """Every run_trainer.py, run_monitor.py, run_eval.py and export_trunk.py command of the README and of
    benchmarks/README.md is accepted by that script's argument parser (flags that exist, values of the right kind),
    and every make target they name exists."""
    import shlex

    import export_trunk
    import run_eval
    import run_monitor
    import run_trainer

    parsers = {
        "run_trainer.py": run_trainer,
        "run_monitor.py": run_monitor,
        "run_eval.py": run_eval,
        "export_trunk.py": export_trunk,
    }
    makefile = (REPO / "Makefile").read_text()
    parsed = set()
    for doc, text in DOCS.items():
        for command in bash_commands(text):
            words = shlex.split(command)
            for script, module in parsers.items():
                if script in words:
                    module.build_parser().parse_args(words[words.index(script) + 1 :])
                    parsed.add(script)
            if words[0] == "make":
                target = words[1]
                assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.MULTILINE), f"{doc}: make {target}"
    assert parsed == set(parsers), f"the README shows no command of {set(parsers) - parsed}"


def test_tuning_table_matches_run_trainer_help() -> None:
    """The README's table of flags: each flag exists, and its default is run_trainer.py's (numbers, names, "off" for
    a switch); every flag of run_trainer.py --help is named somewhere in the README."""
    import run_trainer

    actions = {a.option_strings[-1]: a for a in run_trainer.build_parser()._actions if a.option_strings}
    rows = re.findall(r"^\| `(--\w+)` \| ([^|]+) \|", README, flags=re.MULTILINE)
    assert len(rows) >= 15
    for flag, default in rows:
        assert flag in actions, f"README's table names {flag}, which run_trainer.py does not have"
        expected, shown = actions[flag].default, default.strip()
        if shown == "off":
            assert expected is False, flag
        elif re.match(r"-?\d", shown):
            assert float(shown.split()[0]) == float(expected), f"{flag}: README {shown}, run_trainer.py {expected}"
        elif not shown.startswith("("):
            assert shown == expected, f"{flag}: README {shown}, run_trainer.py {expected}"
    unnamed = sorted(f for f in actions if f not in ("-h", "--help") and f not in README)
    assert not unnamed, f"run_trainer.py flags the README never names: {unnamed}"
