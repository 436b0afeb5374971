"""The pre-flight check: a short run of every box before the long one, and the settings its measurements advise.

``run_trainer.py --preflight [SECONDS]`` starts a box exactly as the long run would (same DHT, VISSL task, averager
and hooks), under its own run id (``<run_id>-preflight``: a pre-flight never mixes into a running swarm nor counts
toward its schedule) and in a fresh folder under the checkpoint folder (the long run's AUTO_RESUME never picks it
up). ``hooks/preflight_on_step_hook.py`` ends training SECONDS after the first round with another box and writes
what only the trainer knows (how many values the averager sends, steps and seconds); the box's own records
(``averaging_rounds.jsonl``) give the rest. At the end each box prints one table and the advice.

hivemind does not expose a per-peer link rate, so the link rate here is what the rounds imply: the bytes one box
sends in a round (hivemind's butterfly AllReduce: each member sends, and receives, ``2 (n-1)/n`` of the averaged
tensors in a group of n) over that round's AllReduce seconds. For a small model the AllReduce is bound by per-round
overheads (matchmaking messages, process hops), not by the link: the rate is then a lower bound of the link's.

Everything below reading the files is pure: :func:`advise` maps measured numbers to settings, so it is tested
with measured inputs, and a box's numbers can be re-advised for another model size (``values``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vissl_swarm import swarm

DEFAULT_SECONDS = 180.0  # of training per box, from its first round with another box: a few minutes
SUFFIX = swarm.PREFLIGHT_SUFFIX  # appended to --run_id
FOLDER = "preflight"  # under the checkpoint folder: one sub-folder per pre-flight (a time stamp)
BATCHES_PER_EPOCH = 200  # the data subset (DATA_LIMIT) a pre-flight trains on, in batches of the box
EPOCHS = 1000  # num_epochs of a pre-flight: the swarm's budget never ends it before its time does
RUN_FILE = "preflight_run.json"  # written by the hook: values averaged, steps, seconds
REPORT_FILE = "preflight.json"  # the table and advice, as JSON, next to the records
BYTES_PER_VALUE = {"none": 4.0, "fp16": 2.0}  # what each --compression puts on the wire per fp32 value
TIMEOUT_FACTOR = 3.0  # averaging_timeout at least this many times the slowest AllReduce seen
SLOW_ALLREDUCE_S = 30.0  # an AllReduce longer than this: groups of 2 (each member sends 1.0x the model, not 1.5x)


class PreflightError(ValueError):
    """A pre-flight cannot be measured or advised: the message says what is missing."""


def configure(config: Any, overrides: Sequence[str], checkpoint_root: Path, stamp: str) -> list[str]:
    """Turn a composed trainer config into a pre-flight's, in place; returns what changed, for the log.

    A fresh folder (the long run's AUTO_RESUME must never find a pre-flight's checkpoint, nor a pre-flight the long
    run's), a subset of the data of ``BATCHES_PER_EPOCH`` batches per epoch and enough epochs that time, not the
    swarm's budget, ends it; no checkpoints but the final one. An override of the same key by the user wins."""
    folder = checkpoint_root / FOLDER / stamp
    config.CHECKPOINT.DIR = str(folder)
    config.CHECKPOINT.AUTO_RESUME = False
    config.CHECKPOINT.CHECKPOINT_FREQUENCY = EPOCHS * 10
    config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY = -1
    changes = [f"checkpoints, records and the report in {folder}"]
    given = {override.split("=", 1)[0] for override in overrides}
    if "config.DATA.TRAIN.DATA_LIMIT" not in given:
        from vissl_swarm.recipe import RecipeError, training_images

        box_batch = int(config.DATA.TRAIN.BATCHSIZE_PER_REPLICA) * int(config.DISTRIBUTED.NUM_PROC_PER_NODE)
        limit = BATCHES_PER_EPOCH * box_batch
        try:  # VISSL samples the subset without replacement: a limit above the dataset's size fails
            images = training_images(config)
        except RecipeError:  # not a folder of images: VISSL's own source, left whole
            images = 0
        if 0 < limit < images:
            config.DATA.TRAIN.DATA_LIMIT = limit
            changes.append(f"a subset of {limit} of the {images} images ({BATCHES_PER_EPOCH} batches of this box)")
    if "config.OPTIMIZER.num_epochs" not in given:
        config.OPTIMIZER.num_epochs = EPOCHS
        changes.append(f"num_epochs {EPOCHS}, so that time ends it, not the schedule")
    return changes


def allreduce_bytes(values: int, bytes_per_value: float, group_size: int) -> float:
    """Bytes one member sends (and, as many, receives) in one butterfly AllReduce of ``values`` values: its tensors
    split into n parts, n-1 parts sent out to be reduced, and its reduced part sent back to the n-1 others."""
    if values < 0 or bytes_per_value <= 0 or group_size < 1:
        raise PreflightError(
            f"allreduce_bytes needs values >= 0, bytes_per_value > 0 and group_size >= 1, got "
            f"{values}, {bytes_per_value}, {group_size}"
        )
    return values * bytes_per_value * 2.0 * (group_size - 1) / group_size


def bytes_per_value(compression: str) -> float:
    if compression not in BYTES_PER_VALUE:
        raise PreflightError(f"compression must be one of {sorted(BYTES_PER_VALUE)}, got {compression!r}")
    return BYTES_PER_VALUE[compression]


@dataclass(frozen=True)
class Settings:
    """The averaging flags a box ran with (the ones the advice is about)."""

    target_group_size: int = 4
    min_matchmaking_time: float = 5.0
    averaging_timeout: float = 60.0
    compression: str = "fp16"


@dataclass(frozen=True)
class Measured:
    """One box's pre-flight in numbers. Seconds and steps are medians over its applied rounds unless named max."""

    boxes: int  # boxes seen: this one and every peer it shared a group with
    rounds_applied: int
    rounds_failed: int  # a group formed, the AllReduce did not finish
    rounds_no_group: int  # no group formed in time
    group_sizes: tuple[int, ...]  # of the applied rounds
    allreduce_s: float | None
    allreduce_max_s: float | None
    bytes_per_round: float | None  # sent by this box per applied round (as much is received)
    link_mbit: float | None  # all applied rounds' bytes over their AllReduce seconds
    matchmaking_s: float | None
    staleness_steps: float | None
    staleness_max_steps: int | None
    steps: int  # local steps trained in the pre-flight
    seconds: float  # of training
    values: int  # values averaged per round (parameters and float buffers)
    compression: str

    @property
    def step_s(self) -> float:
        return self.seconds / self.steps if self.steps else math.nan

    @property
    def steps_per_round(self) -> float | None:
        return self.steps / self.rounds_applied if self.rounds_applied else None

    @property
    def group_size_mean(self) -> float | None:
        return statistics.fmean(self.group_sizes) if self.group_sizes else None


@dataclass(frozen=True)
class Advice:
    flag: str
    value: str
    reason: str


def measure(rounds: Sequence[dict], run: dict) -> Measured:
    """The numbers of one box from its round records (``averaging_rounds.jsonl``) and the hook's ``run`` file."""
    for key in ("values", "compression", "steps", "seconds", "peer"):
        if key not in run:
            raise PreflightError(f"the pre-flight's run file lacks {key!r} (did training start?)")
    # the wait for a first group is not measured: ``since`` is the step after that group's round, which is kept
    since = float(run.get("since", 0.0))
    rounds = [r for r in rounds if r.get("t_group_formed") is not None or (r.get("t_end") or since) >= since]
    applied = [r for r in rounds if r.get("applied")]
    timed = [r for r in applied if r.get("allreduce_s") is not None and r["allreduce_s"] > 0]
    per_value = bytes_per_value(run["compression"])
    sent = [allreduce_bytes(run["values"], per_value, r["group_size"]) for r in timed]
    peers = {peer for r in applied for peer in (r.get("group") or [])} | {run["peer"]}
    failed = [r for r in rounds if r.get("state") == "FAILED"]
    staleness = [r["staleness_steps"] for r in applied if r.get("staleness_steps") is not None]
    matchmaking = [r["matchmaking_s"] for r in applied if r.get("matchmaking_s") is not None]
    allreduce = [r["allreduce_s"] for r in timed]
    return Measured(
        boxes=len(peers),
        rounds_applied=len(applied),
        rounds_failed=sum(r.get("t_group_formed") is not None for r in failed),
        rounds_no_group=sum(r.get("t_group_formed") is None for r in failed),
        group_sizes=tuple(int(r["group_size"]) for r in applied if r.get("group_size")),
        allreduce_s=statistics.median(allreduce) if allreduce else None,
        allreduce_max_s=max(allreduce) if allreduce else None,
        bytes_per_round=statistics.median(sent) if sent else None,
        link_mbit=sum(sent) * 8 / sum(allreduce) / 1e6 if sent else None,
        matchmaking_s=statistics.median(matchmaking) if matchmaking else None,
        staleness_steps=statistics.median(staleness) if staleness else None,
        staleness_max_steps=max(staleness) if staleness else None,
        steps=int(run["steps"]),
        seconds=float(run["seconds"]),
        values=int(run["values"]),
        compression=str(run["compression"]),
    )


def _ceil(value: float, step: float) -> float:
    return math.ceil(value / step - 1e-9) * step


def _seconds(value: float) -> str:
    return f"{value:g}"


def advise(
    measured: Measured, current: Settings, values: int | None = None, link_mbit: float | None = None
) -> list[Advice]:
    """The settings these measurements advise, each with its reason; a pure function of the numbers.

    ``values``: advise for a model of that many averaged values instead of the measured one, at the same step time:
    its AllReduce is the measured one plus the extra bytes at the link rate. ``link_mbit``: that rate, when the
    link's own is known (e.g. a shaped link, or the contract of the boxes' uplinks); by default the measured
    effective rate, which a small model's overhead-bound rounds put far below the link's (a pessimistic projection).
    """
    if link_mbit is not None and not link_mbit > 0:
        raise PreflightError(f"link_mbit must be a positive rate in Mbit/s, got {link_mbit}")
    if values is not None and values <= 0:
        raise PreflightError(f"values must be a positive number of averaged values, got {values}")
    if measured.steps <= 0 or measured.seconds <= 0:
        raise PreflightError(f"no training to advise on: {measured.steps} steps in {measured.seconds} s")
    if measured.rounds_applied == 0 or measured.link_mbit is None or measured.allreduce_max_s is None:
        why = (
            f"no averaging round was applied ({measured.rounds_no_group} found no group, {measured.rounds_failed} "
            f"failed; {measured.boxes - 1} other boxes seen): check that the other boxes ran the pre-flight at "
            "the same time with the same --run_id, --config and secret, and that their ports are open"
        )
        return [
            Advice("--target_group_size", str(current.target_group_size), why),
            Advice("--min_matchmaking_time", _seconds(current.min_matchmaking_time), why),
            Advice("--averaging_timeout", _seconds(current.averaging_timeout), why),
            Advice("--compression", current.compression, why),
        ]
    size = measured.values if values is None else values
    step_s, rate = measured.step_s, link_mbit or measured.link_mbit
    seen = max(measured.boxes, 2)
    typical_group = round(statistics.median(measured.group_sizes)) if measured.group_sizes else seen
    per_value = bytes_per_value(measured.compression)
    extra_bytes = allreduce_bytes(size, per_value, typical_group) - allreduce_bytes(
        measured.values, per_value, typical_group
    )
    extra_s = extra_bytes * 8 / (rate * 1e6)  # the bytes a larger model adds, at the rate
    allreduce_max = max(0.0, measured.allreduce_max_s + extra_s)
    allreduce = max(0.0, (measured.allreduce_s or 0.0) + extra_s)
    advice = []

    # group size: no larger than the boxes that ran; on a slow link, 2 (each member sends 1.0x the model, not 1.5x)
    group = max(2, min(current.target_group_size, seen))
    reason = (
        f"{measured.boxes} boxes took part; a group holds at most that many (groups seen: "
        f"{_sizes(measured.group_sizes)})"
    )
    if allreduce > SLOW_ALLREDUCE_S and group > 2:
        group = 2
        reason = (
            f"an AllReduce takes {allreduce:.1f} s here (> {SLOW_ALLREDUCE_S:g} s): in groups of 2 each box "
            f"sends 1.0x the model per round instead of {2 * (seen - 1) / seen:.2f}x, and waits for one peer"
        )
    advice.append(Advice("--target_group_size", str(group), reason))

    # matchmaking: long enough for a box in the middle of its step to join (a round starts at a step boundary),
    # and no shorter than an AllReduce: the next group gathers during it anyway
    wanted = max(1.0, 2 * step_s, allreduce)
    reason = (
        f"at least 2 steps ({2 * step_s:.2f} s: a box joins at its next step boundary) and one AllReduce "
        f"({allreduce:.2f} s: the next group gathers while it runs)"
    )
    filled = (
        measured.group_size_mean is not None and measured.group_size_mean >= min(current.target_group_size, seen) - 0.25
    )
    if not filled:
        wanted = max(wanted, 1.5 * current.min_matchmaking_time)
        reason += (
            f"; groups averaged {measured.group_size_mean:.2f} of {min(current.target_group_size, seen)} "
            f"possible: longer than the {current.min_matchmaking_time:g} s used"
        )
    advice.append(Advice("--min_matchmaking_time", _seconds(_ceil(wanted, 0.5)), reason))

    # timeout: a few times the slowest AllReduce, never below the current one (it only bounds a hung round)
    needed = _ceil(TIMEOUT_FACTOR * allreduce_max, 5.0)
    if needed > current.averaging_timeout:
        advice.append(
            Advice(
                "--averaging_timeout",
                _seconds(needed),
                f"{TIMEOUT_FACTOR:g}x the slowest AllReduce ({allreduce_max:.1f} s) is more than the "
                f"{current.averaging_timeout:g} s used: rounds would be cut off",
            )
        )
    else:
        advice.append(
            Advice(
                "--averaging_timeout",
                _seconds(current.averaging_timeout),
                f"keep: {TIMEOUT_FACTOR:g}x the slowest AllReduce ({allreduce_max:.1f} s) is "
                f"{TIMEOUT_FACTOR * allreduce_max:.1f} s, within it (a dead peer is dropped sooner, by "
                "--next_chunk_timeout)",
            )
        )

    # compression: fp32 when a round of full-precision values takes less than a step at this rate
    fp32_s = allreduce_bytes(size, BYTES_PER_VALUE["none"], group) * 8 / (rate * 1e6)
    if fp32_s < step_s:
        advice.append(
            Advice(
                "--compression",
                "none",
                f"an fp32 round ({_megabytes(allreduce_bytes(size, 4.0, group))} sent per box) takes "
                f"{fp32_s:.2f} s at {rate:.1f} Mbit/s, under one step ({step_s:.2f} s): exact averages "
                "cost no staleness",
            )
        )
    else:
        advice.append(
            Advice(
                "--compression",
                "fp16",
                f"an fp32 round ({_megabytes(allreduce_bytes(size, 4.0, group))} sent per box) would "
                f"take {fp32_s:.2f} s at {rate:.1f} Mbit/s, {fp32_s / step_s:.1f} steps of "
                f"{step_s:.2f} s: fp16 halves the bytes and the staleness",
            )
        )
    return advice


def _sizes(sizes: Sequence[int]) -> str:
    if not sizes:
        return "none"
    counts = {size: sizes.count(size) for size in sorted(set(sizes))}
    return ", ".join(f"{size} x{count}" for size, count in counts.items())


def _megabytes(count: float) -> str:
    return f"{count / 1e6:.3g} MB"


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table_rows(measured: Measured) -> list[tuple[str, str]]:
    """The table every box prints: (what, value)."""
    m = measured
    return [
        ("boxes seen (this one and its groupmates)", str(m.boxes)),
        ("group sizes (applied rounds)", _sizes(m.group_sizes)),
        ("rounds applied / failed / no group", f"{m.rounds_applied} / {m.rounds_failed} / {m.rounds_no_group}"),
        ("AllReduce s (median / max)", f"{_number(m.allreduce_s)} / {_number(m.allreduce_max_s)}"),
        ("values averaged", f"{m.values:,} ({m.compression}: {bytes_per_value(m.compression):g} bytes each)"),
        (
            "bytes sent per round per box (as many received)",
            "-" if m.bytes_per_round is None else _megabytes(m.bytes_per_round),
        ),
        ("effective link rate (bytes / AllReduce s)", "-" if m.link_mbit is None else f"{m.link_mbit:.2f} Mbit/s"),
        ("matchmaking s (median)", _number(m.matchmaking_s)),
        (
            "staleness steps (median / max)",
            f"{_number(m.staleness_steps, 1)} / {'-' if m.staleness_max_steps is None else m.staleness_max_steps}",
        ),
        ("local steps per applied round", _number(m.steps_per_round, 1)),
        ("steps / seconds trained (s per step)", f"{m.steps} / {m.seconds:.1f} ({m.step_s:.3f})"),
    ]


def format_report(measured: Measured, advice: Sequence[Advice]) -> str:
    rows = table_rows(measured)
    width = max(len(name) for name, _ in rows)
    lines = [
        "pre-flight of this box",
        *(f"  {name:<{width}}  {value}" for name, value in rows),
        "advised settings for these links:",
    ]
    lines += [f"  {a.flag} {a.value}: {a.reason}" for a in advice]
    lines.append("  " + " ".join(f"{a.flag} {a.value}" for a in advice))
    return "\n".join(lines)


def read_jsonl(path: Path) -> list[dict]:
    """The lines written so far; a line being written right now is skipped."""
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return entries


def report(folder: Path, current: Settings) -> tuple[str, dict[str, Any]]:
    """The printed report and its JSON (also written to ``folder/preflight.json``) of the pre-flight in ``folder``."""
    run_path = folder / RUN_FILE
    if not run_path.exists():
        raise PreflightError(f"{run_path} is missing: the pre-flight ended before its first training step")
    run = json.loads(run_path.read_text())
    measured = measure(read_jsonl(folder / "averaging_rounds.jsonl"), run)
    advice = advise(measured, current)
    numbers = {**asdict(measured), "step_s": measured.step_s, "steps_per_round": measured.steps_per_round}
    document = {
        "measured": numbers,
        "settings": asdict(current),
        "advice": [asdict(a) for a in advice],
        "folder": str(folder),
    }
    (folder / REPORT_FILE).write_text(json.dumps(document, indent=1))
    return format_report(measured, advice), document


def remove_checkpoints(folder: Path) -> int:
    """After the report: a pre-flight's checkpoints (VISSL writes one at its end) are the weights of a few minutes on
    a subset, of no use to the long run (which never resumes from this folder); a ResNet-50's is hundreds of MB per
    pre-flight. Removes them; returns the bytes freed. The records and the report stay."""
    freed = 0
    for checkpoint in folder.glob("*.torch"):  # checkpoint.torch too (a link to the last one)
        if checkpoint.is_file() or checkpoint.is_symlink():
            freed += checkpoint.lstat().st_size
            checkpoint.unlink()
    return freed
