"""bench_averaging's metrics: per peer over a measured window (rate, rounds, staleness, duty, hold), pooled per run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

from benchmarks.averaging_setup import RunConfig


def _to_wall(value: float | None, offset: float) -> float | None:
    """Records may use time.time() or time.monotonic(); bring both to wall time (monotonic values are small)."""
    if value is None:
        return None
    return float(value) + offset if value < 1e9 else float(value)


def round_spans(record: dict, offset: float, t_open: float | None = None) -> list[tuple[str, float, float]]:
    """A round's (stage, start, end) wall-clock spans, from stage times or durations; an open round ends at `t_open`."""
    t_start = _to_wall(record.get("t_matchmaking_start", record.get("t_start")), offset)
    if t_start is None:
        return []
    end = _to_wall(record.get("t_end"), offset) or t_open or t_start
    mm, aw, ar = (record.get(k) for k in ("matchmaking_s", "awaiting_trigger_s", "allreduce_s"))
    t_group = _to_wall(record.get("t_group_formed"), offset) or (t_start + mm if mm is not None else None)
    t_allreduce = _to_wall(record.get("t_allreduce_start"), offset) or (
        t_group + aw if t_group is not None and aw is not None else None
    )
    spans = [("matchmaking", t_start, t_group if t_group is not None else end)]
    if t_group is not None:
        spans.append(("awaiting", t_group, t_allreduce if t_allreduce is not None else end))
    if t_allreduce is not None:
        spans.append(("allreduce", t_allreduce, t_allreduce + ar if ar is not None else end))
    return [(name, a, b) for name, a, b in spans if b > a]


def _union_length(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of intervals clipped to [lo, hi] (pipelined rounds overlap; count wall time once)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            total += (cur_b - cur_a) if cur_b is not None else 0.0
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + ((cur_b - cur_a) if cur_b is not None else 0.0)


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _staleness(record: dict) -> float | None:
    if record.get("staleness_steps") is not None:
        return float(record["staleness_steps"])
    if record.get("step_at_apply") is not None and record.get("step_at_snapshot") is not None:
        return float(record["step_at_apply"] - record["step_at_snapshot"])
    return None


def _copy_step_indices(record: dict) -> list[int]:
    """0-based indices of the local steps that paid for this round's copies (DecentralizedSGD's `step_at_*`: from 1)."""
    if "copy_step_indices" in record:
        return list(record["copy_step_indices"])
    return [record[k] - 1 for k in ("step_at_snapshot", "step_at_apply") if record.get(k) is not None]


def _peer_metrics(peer: dict, window: tuple[str, str] = ("t0", "t1"), others: frozenset[str] = frozenset()) -> dict:
    """One peer's numbers over its window (rounds that ended in it); with_others: its applied rounds with `others`."""
    t0, t1, offset = peer[window[0]], peer[window[1]], peer["clock_offset"]
    window = t1 - t0
    step_times = peer["step_times"]
    all_durations = [b - a for a, b in pairwise([peer.get("t_train", t0)] + step_times)]  # since training began
    measured = [i for i, t in enumerate(step_times) if t0 < t <= t1]
    in_window = [r for r in peer["records"] if t0 <= (_to_wall(r.get("t_end"), offset) or math.inf) <= t1]
    applied = [r for r in in_window if r.get("applied")]
    ends = sorted(_to_wall(r["t_end"], offset) for r in applied)
    busy = [(a, b) for r in peer["records"] + peer.get("in_flight", []) for _, a, b in round_spans(r, offset, t1)]

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in applied if r.get(key) is not None]

    durations = [all_durations[i] for i in measured]
    measured_set = set(measured)
    formed_to_end = [
        r["awaiting_trigger_s"] + r["allreduce_s"]
        for r in applied
        if r.get("awaiting_trigger_s") is not None and r.get("allreduce_s") is not None
    ]
    copy_steps = {i for r in applied for i in _copy_step_indices(r) if i in measured_set}
    holds = peer.get("hold_s") or []
    held = [holds[i] for i in measured if i < len(holds)]

    return {
        "rate": len(durations) * peer["batch_size"] / sum(durations) if durations else 0.0,  # whole steps: none cut
        "rounds_per_min": len(applied) / (window / 60.0),
        "round_interval": _mean([b - a for a, b in pairwise(ends)]),
        "duty": _union_length(busy, t0, t1) / window,
        "applied": len(applied),
        "failed": sum(1 for r in in_window if r.get("error")),
        "skipped": sum(1 for r in in_window if not r.get("applied") and not r.get("error")),
        "step_durations": durations,
        "copy_step_durations": [all_durations[i] for i in sorted(copy_steps)],
        "other_step_durations": [all_durations[i] for i in measured if i not in copy_steps],
        "staleness": [s for s in map(_staleness, applied) if s is not None],
        "group_size": [float(r["group_size"]) for r in applied if r.get("group_size")],
        "allreduce_s": values("allreduce_s"),
        "matchmaking_s": values("matchmaking_s"),
        "awaiting_s": values("awaiting_trigger_s"),
        "formed_to_end_s": formed_to_end,
        "with_others": sum(1 for r in applied if others & set(r.get("group") or ())),
        "hold": held,
        "hold_total": sum(held),
        "hold_share": sum(held) / sum(durations) if durations else None,
    }


def summarize_peers(
    peers: list[dict], window: tuple[str, str] = ("t0", "t1"), others: frozenset[str] = frozenset()
) -> dict:
    """Per-run metrics over one window: rates and duty cycle averaged over peers, per-round values pooled over peers."""
    if not peers:
        return {}
    per_peer = [_peer_metrics(peer, window, others) for peer in peers]

    def pooled(key: str) -> list[float]:
        return [v for m in per_peer for v in m[key]]

    step_mean, allreduce_mean = _mean(pooled("step_durations")), _mean(pooled("allreduce_s"))
    applied_total = sum(m["applied"] for m in per_peer)
    counters: dict[str, float] = {}
    for peer in peers:
        for key, value in (peer.get("counters") or {}).items():
            if isinstance(value, (int, float)):
                counters[key] = counters.get(key, 0) + value
    return {
        "window_s": _mean([peer[window[1]] - peer[window[0]] for peer in peers]),  # longer if a window was extended
        "samples_per_s_per_peer": _mean([m["rate"] for m in per_peer]),
        "rounds_per_min": _mean([m["rounds_per_min"] for m in per_peer]),
        "staleness_steps_mean": _mean(pooled("staleness")),
        "staleness_steps_p95": _percentile(pooled("staleness"), 0.95),
        "duty_cycle": _mean([m["duty"] for m in per_peer]),
        "group_size_mean": _mean(pooled("group_size")),
        "rounds_applied": sum(m["applied"] for m in per_peer),
        "rounds_failed": sum(m["failed"] for m in per_peer),
        "rounds_skipped": sum(m["skipped"] for m in per_peer),
        "round_interval_s": _mean([m["round_interval"] for m in per_peer if m["round_interval"] is not None]),
        "rounds_per_min_steady": _mean([60 / m["round_interval"] for m in per_peer if m["round_interval"]]),
        "step_s_mean": step_mean,
        "step_s_p95": _percentile(pooled("step_durations"), 0.95),
        "allreduce_s_mean": allreduce_mean,
        "matchmaking_s_mean": _mean(pooled("matchmaking_s")),
        "awaiting_s_mean": _mean(pooled("awaiting_s")),
        "formed_to_end_s_mean": _mean(pooled("formed_to_end_s")),
        "with_perturbed_peer_share": (
            sum(m["with_others"] for m in per_peer) / applied_total if others and applied_total else None
        ),
        "all_finite": all(peer.get("finite", True) for peer in peers),
        "allreduce_steps_mean": allreduce_mean / step_mean if allreduce_mean is not None and step_mean else None,
        # trainer-side cost of averaging: steps that did (or waited for) a snapshot/fill or apply vs the others
        "copy_step_s_mean": _mean(pooled("copy_step_durations")),
        "other_step_s_median": _percentile(pooled("other_step_durations"), 0.5),
        # how long averaging held the trainer over the window's whole steps: per peer, per step, longest, share of time
        "hold_s_total": _mean([m["hold_total"] for m in per_peer]),
        "hold_ms_per_step": None if not pooled("hold") else 1000 * _mean(pooled("hold")),
        "hold_s_max": max(pooled("hold"), default=None),
        "hold_share": _mean([m["hold_share"] for m in per_peer if m["hold_share"] is not None]),
        "counters": counters or None,
        "peers": peers,
    }


COMPACT_KEYS = (
    "samples_per_s_per_peer",
    "rounds_per_min",
    "rounds_per_min_steady",
    "staleness_steps_mean",
    "group_size_mean",
    "rounds_applied",
    "rounds_failed",
    "formed_to_end_s_mean",
    "allreduce_s_mean",
    "matchmaking_s_mean",
    "awaiting_s_mean",
    "with_perturbed_peer_share",
    "all_finite",
    "hold_s_total",
    "hold_ms_per_step",
    "counters",
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_run(cfg: RunConfig, peers: list[dict]) -> dict:
    """summarize_peers, plus what each regime is about: in perturbed regimes the healthy peers' perturbed window
    (the main numbers) against their reference window and the perturbed peer; with links, the cap on rounds/min."""
    if not peers:
        return {}
    if not cfg.spec.perturbation:
        summary = summarize_peers(peers)
    else:
        slow = [p for p in peers if p["rank"] == cfg.perturbed_rank]
        healthy = [p for p in peers if p["rank"] != cfg.perturbed_rank]
        slow_ids = frozenset(p["peer_id"] for p in slow if p.get("peer_id"))
        reference = summarize_peers(healthy, ("t0", "t1"), slow_ids)
        summary = summarize_peers(healthy, ("t2", "t3"), slow_ids)
        summary["reference"] = {key: reference.get(key) for key in COMPACT_KEYS}
        summary["perturbed_peer"] = {
            key: value for key, value in summarize_peers(slow, ("t2", "t3")).items() if key in COMPACT_KEYS
        }
        summary["rounds_per_min_vs_reference"] = _ratio(summary["rounds_per_min"], reference["rounds_per_min"])
        summary["rounds_per_min_steady_vs_reference"] = _ratio(
            summary["rounds_per_min_steady"], reference["rounds_per_min_steady"]
        )
        summary["all_finite"] = all(p.get("finite", True) for p in peers)
        summary["peers"] = peers
    if cfg.spec.link_mbit and summary.get("allreduce_s_mean"):
        # one AllReduce at a time, and a group that cannot fill forms no sooner than min_matchmaking_time
        summary["rounds_per_min_cap"] = min(60 / cfg.min_matchmaking_time, 60 / summary["allreduce_s_mean"])
        for key in ("rounds_per_min", "rounds_per_min_steady"):
            summary[f"{key}_vs_cap"] = _ratio(summary[key], summary["rounds_per_min_cap"])
    if summary.get("allreduce_steps_mean") is not None:
        summary["staleness_bound"] = summary["allreduce_steps_mean"] + 1
    return summary


def add_throughput_ratios(runs: list[dict]) -> None:
    """throughput_ratio = samples/s of a mode divided by `none` of the same regime (None if no baseline ran)."""
    baseline = {r["regime"]: r.get("samples_per_s_per_peer") for r in runs if r["mode"] == "none"}
    for run in runs:
        base, rate = baseline.get(run["regime"]), run.get("samples_per_s_per_peer")
        run["throughput_ratio"] = rate / base if base and rate is not None else None
