"""What every benchmark shares: ending the processes it started, the git state a result records, its tables'
statistics and writing its outputs. Run one from the repository root as a module (``python -m benchmarks.soak``)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from statistics import mean, stdev
from typing import Any

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------------ processes


def kill_group(pid: int | None) -> None:
    """SIGKILL a process group this benchmark started (a peer and its DHT, averager, p2pd): only ours, by id."""
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def kill_session(process: subprocess.Popen) -> None:
    """The peer and everything it started (it leads its own session), then reap it."""
    kill_group(process.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def session_pids(leader: int) -> list[int]:
    """The processes of the session ``leader`` leads: unlike a walk of parent ids, this misses no reparented orphan."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # after the command name
                if int(fields[3]) == leader:
                    pids.append(int(entry.name))
    return pids


def kill_sessions(leaders: Iterable[int]) -> None:
    """SIGKILL whatever is left of the sessions these (our) processes lead."""
    for pid in [pid for leader in set(leaders) for pid in session_pids(leader)]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def fast_round_flags(run_id: str) -> list[str]:
    """``run_trainer.py`` flags for fast rounds of 3 swav_tiny boxes on a small machine."""
    flags = "--target_group_size 3 --min_matchmaking_time 2 --averaging_timeout 20 --next_chunk_timeout 4"
    return ["--run_id", run_id, *flags.split(), "--compression", "none"]


def parse_with_quick(parser: Any, argv: Sequence[str] | None = None, **smaller: Any) -> Any:
    """Parse; ``--quick`` (the whole code path in minutes) gives ``smaller``'s options left at their defaults."""
    shown = ", ".join(f"--{key} {' '.join(map(str, v)) if isinstance(v, list) else v}" for key, v in smaller.items())
    parser.add_argument("--quick", action="store_true", help=f"the whole code path in minutes: {shown}")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in smaller.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    return args


# --------------------------------------------------------------------------------------------------- provenance


def git_state() -> dict:
    """The commit the numbers come from, whether the working tree differed from it, and in which files."""

    def git(*words: str) -> str:
        try:
            return subprocess.run(["git", *words], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = git("status", "--porcelain", "--untracked-files=no").splitlines()
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(changed), "changed": changed}


def commit_label() -> str:
    """The short commit, with "+changes" if the working tree differed from it: for a table's header."""
    state = git_state()
    return (state["commit"] or "?")[:10] + ("+changes" if state["dirty"] else "")


def machine() -> dict:
    """What else ran: the machine is shared, so a result keeps its load with it."""
    return {"cpus": os.cpu_count(), "loadavg": [round(load, 2) for load in os.getloadavg()]}


# --------------------------------------------------------------------------------------------------- statistics


def spread(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None where undefined)."""
    values = [value for value in values if value is not None]
    if not values:
        return None, None
    return mean(values), (stdev(values) if len(values) > 1 else None)


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def paired_difference(variant: dict[Any, float], reference: dict[Any, float], digits: int = 4) -> dict | None:
    """``variant − reference`` per seed both have, and their mean ± std: a comparison's noise is that spread."""
    seeds = sorted(seed for seed in variant if seed in reference)
    if not seeds:
        return None
    per_seed = [variant[seed] - reference[seed] for seed in seeds]
    value, std = spread(per_seed)
    return {
        "seeds": seeds,
        "mean": rounded(value, digits),
        "std": rounded(std, digits),
        "per_seed": [rounded(d, digits) for d in per_seed],
    }


def crossing(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first x at which the piecewise-linear curve of (x, y) points reaches ``target``; None if it never does."""
    if curve and curve[0][1] >= target:
        return curve[0][0]
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if y1 >= target:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0) if y1 > y0 else x1
    return None


def value_at(curve: Sequence[tuple[float, float]], x: float) -> float:
    """The piecewise-linear curve's y at ``x`` (its last y past its end)."""
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return curve[-1][1]


def fmt(value: float | None, digits: int = 4, signed: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def mean_std(value: float | None, std: float | None, digits: int = 4) -> str:
    return fmt(value, digits) + ("" if std is None else f" ± {std:.{digits}f}")


# ------------------------------------------------------------------------------------------------------ rounds

OUTCOME_COLORS = {"applied": "tab:green", "no group": "0.75", "cancelled": "0.6", "failed": "tab:red"}


def round_outcome(record: dict) -> str:
    """applied, no group, cancelled or failed: no group (a box alone) is no failure, the trainer counts it apart."""
    error = record.get("error") or ""
    if record.get("applied"):
        return "applied"
    if record.get("state") == "CANCELLED" or record.get("cancelled") or "CancelledError" in error:
        return "cancelled"
    if "could not find a group" in error or ("state" in record and record.get("t_group_formed") is None):
        return "no group"
    return "failed"


# ------------------------------------------------------------------------------------------------------ outputs


def markdown_table(rows: Sequence[dict], header: Sequence[str] | None = None) -> str:
    """A GitHub table of dicts (the keys of the first row, or ``header``, are the columns)."""
    if not rows:
        return ""
    header = list(header or rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(row.get(key, "")) for key in header) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path | None, value: Any) -> None:
    """Write ``value`` as indented JSON, atomically (a reader never sees half a file)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=2, default=str) + "\n")
    partial.replace(path)


def write_text(path: Path | None, text: str) -> None:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text.rstrip("\n") + "\n")


def pyplot() -> Any:
    """matplotlib's pyplot without a display (plots are files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_band(axis: Any, xs: Sequence[float], ys: Sequence[float], stds: Sequence[float | None], **style: Any) -> Any:
    """A mean curve and its ± std band, in the line's colour."""
    (line,) = axis.plot(xs, ys, **style)
    low = [y - (s or 0.0) for y, s in zip(ys, stds, strict=True)]
    high = [y + (s or 0.0) for y, s in zip(ys, stds, strict=True)]
    axis.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
    return line


def save_figure(figure: Any, path: Path, dpi: int = 110) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    pyplot().close(figure)


# ---------------------------------------------------------------------------------------------- DecentralizedSGD


def decentralized_sgd(optimizer: Any, dht: Any, ablations: dict[str, Any] | None = None, **options: Any) -> Any:
    """The one place the benchmarks construct DecentralizedSGD; ``ablations`` turn its improvements off, ``options``'
    ``RoundSettings`` fields go into its ``settings``, ``outer_*`` into its ``outer``, the rest to the constructor."""
    import dataclasses

    from decentralized_sgd import DecentralizedSGD
    from decentralized_sgd.outer import OuterSettings
    from decentralized_sgd.scheduler import RoundSettings

    options = {**options, **(ablations or {})}
    tuned = {f.name: options.pop(f.name) for f in dataclasses.fields(RoundSettings) if f.name in options}
    outer = {key: options.pop(f"outer_{key}") for key in ("momentum", "lr", "nesterov") if f"outer_{key}" in options}
    return DecentralizedSGD(
        optimizer, dht, settings=RoundSettings(**tuned), outer=OuterSettings(**outer) if outer else None, **options
    )


def missing_ablations(ablations: dict[str, Any]) -> list[str]:
    """The switches of ``ablations`` that this DecentralizedSGD does not have (such a mode is reported skipped)."""
    import dataclasses

    from decentralized_sgd.scheduler import RoundSettings

    known = {field.name for field in dataclasses.fields(RoundSettings)}
    return [key for key in ablations if key not in known]
