#!/usr/bin/env python
"""Side-by-side benchmark of decentralized parameter averaging designs.

Why: the old design (TrainingAverager driven one round at a time from a background thread) spends much of its wall
time between rounds and averages a snapshot taken *before* matchmaking, so its results are stale by the time they land.
`decentralized_sgd.DecentralizedSGD` claims to fix that (delta rule, refresh right before AllReduce, pipelined
matchmaking). This script measures each design, and each improvement switched off, on the same workloads, and what
an uneven swarm (one overloaded or slow peer) and bandwidth-limited links do to them. Beside them runs the arm a
user would pick instead of us: hivemind's own `hivemind.Optimizer(use_local_updates=True)`.

Every peer is a separate OS process (fork) with its own DHT on 127.0.0.1 (peer 0 bootstraps the others), so GIL and
CPU contention are realistic. Each (regime, mode) gets fresh processes; their process groups are killed afterwards.

Usage (from the repository root):
    python -m benchmarks.bench_averaging [--quick] [--regimes R ...] [--modes M ...] [--compressions C ...]
        [--seconds S] [--peers N] [--warmup W] [--sim-params P] [--min-matchmaking-time T] [--json PATH [--json-peers]]
        [--markdown PATH] [--plot PATH] [--verbose] [--hivemind-target-scale S] [--extend-until-round S]

Regimes (default: the first four):
    sim_full, sim_not_full (simulated GPU: a step is sleep(0.3 s); 25M fp32 params really averaged),
    cpu_full, cpu_not_full (real CPU training of a ~0.5M-param CNN on sklearn digits).
        "full": 3 peers, target_group_size 3; "not_full": 3 peers, target_group_size 4 (groups never fill up).
    straggler: 5 peers, target 4, 0.05 s simulated steps, a 100k-param model, the test suite's fast timeouts. After a
        reference window, the last peer's whole process group (trainer, averager, DHT, p2pd) is stopped 80% of the
        time (SIGSTOP 0.4 s / SIGCONT 0.1 s, as a box whose CPUs are saturated); the healthy peers' rounds/min in
        that window against the reference window of the same swarm.
    slow_step: 3 peers, target 3 (full groups), 0.05 s steps; after the reference window the last peer steps 20x
        slower; the fast peers' time from group formed to round end and their rounds/min against the reference.
    wan_100mbit, wan_1gbit: 3 peers, target 4, 0.3 s simulated steps, ResNet-50-sized tensors (25.6M params), each
        peer in its own network namespace behind a link shaped to 100 Mbit/s or 1 Gbit/s each way (benchmarks/netns.py;
        the script re-executes itself inside `unshare -rn`); compression fp16 and uint8. Reported against the cap
        min(60 / min_matchmaking_time, 60 / AllReduce s) rounds/min and staleness against AllReduce steps + 1.
Modes:   none, old, improved, hivemind_optimizer (target_batch_size: the swarm's samples in one
         min_matchmaking_time, at the rate the `improved` run of the regime trained at: hivemind_target_batch_size),
         and improved with one switch off: no_delta, no_refresh, no_pipeline, fill_at_boundary (filled at the next
         step boundary), no_slow_peer_fixes, fill_at_once (never waits for a boundary due within boundary_wait_share
         of an AllReduce: wan_100mbit only). Each regime runs the modes that make sense for it; --modes picks.
Each run trains for a warm-up (10 s; --quick 3 s; 1 s for `none`; hivemind_optimizer at least its start-up,
hivemind_startup_s: 10 s + 2 x min_matchmaking_time) in which averaging already runs, then measures a
window (60 s; --quick 6 s, 4 s for `none`): steady state, not start-up. Regimes with a perturbation measure a second
window of the same length after a settling pause, with the last peer perturbed.
--quick: the code path of every arm in about 2 minutes: sim_full with none, old, improved and hivemind_optimizer
(unless --regimes / --modes say otherwise), 1M params, min_matchmaking_time 2 s, short windows.

Metrics (per run; rounds count if they finished inside the measured window; averaging_metrics.py defines each):
    samples/s per peer and its ratio to `none`, rounds/min (and steady: 60 / mean interval between applied rounds),
    staleness (local steps between the snapshot that went into the AllReduce and the apply), duty cycle, group size,
    failed rounds, group formed to round end, how long averaging held the trainer (hold_*: its optimizer-step call
    beyond the inner optimizer's step; for `old`, the wait for the data lock), and in the perturbed regimes the same
    for the healthy peers against their reference window. Peer logs go to $TMPDIR/bench_averaging_logs/.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from benchmarks import netns
from benchmarks.averaging_metrics import (
    _to_wall,
    add_throughput_ratios,
    evaluate_targets,
    round_spans,
    targets_markdown,
)
from benchmarks.averaging_peers import run_one
from benchmarks.averaging_setup import (
    ABLATIONS,
    DEFAULT_REGIMES,
    MODES,
    REGIMES,
    RunConfig,
    _digits,
    hivemind_startup_s,
    hivemind_target_batch_size,
)
from benchmarks.common import (
    OUTCOME_COLORS,
    REPO,
    git_state,
    pyplot,
    round_outcome,
    save_figure,
    write_json,
    write_text,
)

QUICK_REGIMES = ("sim_full",)
QUICK_MODES = ("none", "old", "improved", "hivemind_optimizer")
SPAN_COLORS = {"matchmaking": "tab:blue", "awaiting": "tab:orange", "allreduce": "tab:green", "copy": "tab:gray"}


def run_metadata(args: argparse.Namespace, started: float) -> dict:
    """What the numbers depend on: versions, the exact optimizer file, and how busy the shared machine was."""
    import hivemind

    sources = sorted((REPO / "decentralized_sgd").glob("*.py"))
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()[:16]
    return {
        "git": git_state(),
        "argv": sys.argv[1:],
        "quick": args.quick,
        "started": time.strftime("%F %T", time.localtime(started)),
        "total_s": time.time() - started,
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "torch": torch.__version__,
        "hivemind": hivemind.__version__,
        "decentralized_sgd_sha256": digest,
    }


# ----------------------------------------------------------------------------------------------------- reporting

TABLE_COLUMNS = [  # (header, key, format)
    ("regime", "regime", "{}"),
    ("mode", "mode", "{}"),
    ("samples/s/peer", "samples_per_s_per_peer", "{:.1f}"),
    ("thr ratio", "throughput_ratio", "{:.3f}"),
    ("rounds/min", "rounds_per_min", "{:.1f}"),
    ("steady r/min", "rounds_per_min_steady", "{:.1f}"),
    ("stale mean", "staleness_steps_mean", "{:.1f}"),
    ("stale p95", "staleness_steps_p95", "{:.1f}"),
    ("duty", "duty_cycle", "{:.2f}"),
    ("group", "group_size_mean", "{:.2f}"),
    ("failed", "rounds_failed", "{}"),
    ("AR s", "allreduce_s_mean", "{:.2f}"),
    ("AR steps", "allreduce_steps_mean", "{:.1f}"),
    ("MM s", "matchmaking_s_mean", "{:.2f}"),
    ("AW s", "awaiting_s_mean", "{:.2f}"),
    ("hold s", "hold_s_total", "{:.2f}"),
    ("hold ms/step", "hold_ms_per_step", "{:.1f}"),
    ("load", "loadavg_1m_after", "{:.1f}"),
    ("error", "error", "{}"),
]


UNEVEN_COLUMNS = [  # perturbed regimes: the healthy peers, reference window vs perturbed window
    ("regime", "regime", "{}"),
    ("mode", "mode", "{}"),
    ("r/min reference", "reference.rounds_per_min", "{:.1f}"),
    ("r/min perturbed", "rounds_per_min", "{:.1f}"),
    ("ratio", "rounds_per_min_vs_reference", "{:.2f}"),
    ("steady ratio", "rounds_per_min_steady_vs_reference", "{:.2f}"),
    ("formed->end s reference", "reference.formed_to_end_s_mean", "{:.3f}"),
    ("formed->end s perturbed", "formed_to_end_s_mean", "{:.3f}"),
    ("MM s", "matchmaking_s_mean", "{:.2f}"),
    ("group", "group_size_mean", "{:.2f}"),
    ("with slow peer", "with_perturbed_peer_share", "{:.2f}"),
    ("failed", "rounds_failed", "{}"),
    ("slow peer r/min", "perturbed_peer.rounds_per_min", "{:.1f}"),
    ("slow peer starved s", "perturbed_peer.counters.starved_s", "{:.0f}"),
    ("slow DHT node bans", "counters.slow_dht_node_bans", "{:.0f}"),
    ("finite", "all_finite", "{}"),
    ("stale mean", "staleness_steps_mean", "{:.1f}"),
    ("hold s", "hold_s_total", "{:.2f}"),
    ("hold ms/step", "hold_ms_per_step", "{:.1f}"),
    ("load", "loadavg_1m_after", "{:.1f}"),
    ("error", "error", "{}"),
]
LINK_COLUMNS = [  # bandwidth-limited links
    ("regime", "regime", "{}"),
    ("compression", "compression", "{}"),
    ("mode", "mode", "{}"),
    ("AR s", "allreduce_s_mean", "{:.2f}"),
    ("AR steps", "allreduce_steps_mean", "{:.1f}"),
    ("rounds/min", "rounds_per_min", "{:.1f}"),
    ("steady r/min", "rounds_per_min_steady", "{:.1f}"),
    ("cap", "rounds_per_min_cap", "{:.1f}"),
    ("steady / cap", "rounds_per_min_steady_vs_cap", "{:.2f}"),
    ("stale mean", "staleness_steps_mean", "{:.1f}"),
    ("AR steps + 1", "staleness_bound", "{:.1f}"),
    ("MM s", "matchmaking_s_mean", "{:.2f}"),
    ("group", "group_size_mean", "{:.2f}"),
    ("failed", "rounds_failed", "{}"),
    ("hold s", "hold_s_total", "{:.2f}"),
    ("hold ms/step", "hold_ms_per_step", "{:.1f}"),
    ("load", "loadavg_1m_after", "{:.1f}"),
    ("error", "error", "{}"),
]


def _cell(run: dict, key: str, fmt: str) -> str:
    """A run's value under `key` ("a.b": run["a"]["b"]); an error or skip reason shortened to one line."""
    value: Any = run
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if key == "error" and value is None and run.get("skipped"):
        value = f"skipped: {run['skipped']}"
    text = "" if value is None else fmt.format(value)
    return text.splitlines()[0][:90] if key == "error" and text else text


def markdown_table(runs: list[dict], columns: Sequence[tuple[str, str, str]] = TABLE_COLUMNS) -> str:
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(run, key, fmt) for _, key, fmt in columns) + " |" for run in runs]
    return "\n".join(lines)


def report_tables(runs: list[dict]) -> str:
    """One table per kind of regime that ran: plain, uneven swarm (perturbed), bandwidth-limited links."""
    kinds = [
        (
            [r for r in runs if not REGIMES[r["regime"]].perturbation and not REGIMES[r["regime"]].link_mbit],
            TABLE_COLUMNS,
        ),
        ([r for r in runs if REGIMES[r["regime"]].perturbation], UNEVEN_COLUMNS),
        ([r for r in runs if REGIMES[r["regime"]].link_mbit], LINK_COLUMNS),
    ]
    return "\n\n".join(markdown_table(chosen, columns) for chosen, columns in kinds if chosen)


def hivemind_setup_markdown(runs: list[dict]) -> str:
    """How each hivemind_optimizer run was set up, and whether its epochs came as often as that setup meant."""
    lines = []
    for run in runs:
        setup = run.get("hivemind_setup")
        if not setup:
            continue
        label = run["regime"] if run.get("compression", "none") == "none" else f"{run['regime']}/{run['compression']}"
        counters, peers = run.get("counters") or {}, (run.get("config") or {}).get("peers")
        epochs = run.get("epochs_per_min")
        scale = setup.get("scale", 1.0)
        scaled, epoch_s = ("" if scale == 1.0 else f" x {scale:g}"), setup["matchmaking_time"] * scale
        lines.append(
            f"- {label}: target_batch_size {setup['target_batch_size']} = {peers} peers x "
            f"{setup['rate_samples_per_s_per_peer']:.1f} samples/s ({setup['rate_source']}) x "
            f"{setup['matchmaking_time']:g} s{scaled}; epochs/min {'n/a' if epochs is None else f'{epochs:.1f}'} "
            f"(one per {epoch_s:g} s: {60 / epoch_s:.1f}); rounds "
            f"pre-scheduled {counters.get('prescheduled_rounds', 0):.0f} of {counters.get('rounds', 0):.0f}; "
            f"state downloads {counters.get('state_loads', 0):.0f} (all peers, whole run)"
        )
    if not lines:
        return ""
    return (
        "\n\nhivemind_optimizer: hivemind.Optimizer(use_local_updates=True, average_state_every=1), "
        "matchmaking_time = min_matchmaking_time, averaging_timeout = our allreduce_timeout, same compression; "
        "hold = time in opt.step() beyond the inner optimizer step; staleness = inner updates between the copy "
        "into the averager and the apply\n" + "\n".join(lines)
    )


def _old_copy_spans(record: dict) -> list[tuple[str, float, float]]:
    """Old design only: snapshot before matchmaking and apply after AllReduce, both under data_lock (not duty)."""
    if "t_matchmaking_start" not in record or record.get("allreduce_s") is None:
        return []
    allreduce_end = record["t_allreduce_start"] + record["allreduce_s"]
    spans = [("copy", record["t_start"], record["t_matchmaking_start"]), ("copy", allreduce_end, record["t_end"])]
    return [(name, a, b) for name, a, b in spans if b > a]


def plot_timeline(
    runs: list[dict], path: Path, regime: str = "sim_not_full", modes: Sequence[str] = ("old", "improved")
) -> None:
    """Per peer: matchmaking / awaiting / AllReduce spans as bars (two lanes so pipelined rounds stay visible),
    ticks at every local step, dots where a round's result was applied; gray: the old design's snapshot/apply."""
    from matplotlib.patches import Patch

    plt = pyplot()

    by_cell = {(r["regime"], r["mode"]): r for r in runs if r.get("peers")}
    chosen = [by_cell.get((regime, mode)) for mode in modes]
    if not any(chosen):
        print(f"[bench] no {regime} runs of {modes} to plot; skipping {path}", file=sys.stderr)
        return
    fig, axes = plt.subplots(len(modes), 1, figsize=(14, 2.2 + 1.3 * 3 * len(modes)), squeeze=False)
    for ax, mode, run in zip(axes[:, 0], modes, chosen, strict=True):
        ax.set_title(f"{regime} / {mode}" + ("" if run else " (not run)"))
        if not run:
            continue
        for row, peer in enumerate(run["peers"]):
            t0, offset, base = peer.get("t_train", peer["t0"]), peer["clock_offset"], row * 1.5
            for record in peer["records"] + peer.get("in_flight", []):
                lane = base + 0.5 * (int(record.get("round") or 0) % 2)
                for name, a, b in round_spans(record, offset, t_open=peer["t1"]) + _old_copy_spans(record):
                    ax.broken_barh([(a - t0, b - a)], (lane, 0.45), color=SPAN_COLORS[name], alpha=0.85)
                t_applied = _to_wall(record.get("t_applied", record.get("t_end")), offset)
                outcome = "in flight" if record.get("in_flight") else round_outcome(record)
                if t_applied is not None and outcome != "in flight":  # applied: a dot; else x in the outcome's color
                    marker = ("." if outcome == "applied" else "x", OUTCOME_COLORS[outcome])
                    ax.plot(t_applied - t0, lane + 0.22, marker[0], color=marker[1], markersize=4)
            ticks = [t - t0 for t in peer["step_times"]]
            ax.vlines(ticks, base - 0.25, base - 0.05, color="black", linewidth=0.5)
        ax.set_yticks([row * 1.5 + 0.5 for row in range(len(run["peers"]))])
        ax.set_yticklabels([f"peer {p['rank']}" for p in run["peers"]])
        first = run["peers"][0]
        t_train = first.get("t_train", first["t0"])
        ax.axvspan(0, first["t0"] - t_train, color="0.9", zorder=0)
        ax.set_xlim(0, first["t1"] - t_train)
        ax.set_xlabel(
            "seconds since training began (shaded: warm-up; ticks: local steps; dots: applied; x: failed in red, "
            "no group or cancelled in gray)"
        )
    handles = [Patch(color=c, label=n) for n, c in SPAN_COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    save_figure(fig, path)


def _json_ready(run: dict, keep_peers: bool) -> dict:
    """Drop bulky per-step data from JSON unless it is needed to reproduce the plot."""
    out = {k: v for k, v in run.items() if k != "peers"}
    if keep_peers and run.get("peers"):
        out["peers"] = run["peers"]
    return out


# ----------------------------------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="every arm's code path in ~2 min on 2 cores: sim_full with none, old, improved and "
        "hivemind_optimizer (unless --regimes / --modes), 1M-param sim model, min_matchmaking_time 2 s, short windows",
    )
    parser.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=None)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=None, help="among each regime's own modes")
    parser.add_argument(
        "--compressions",
        nargs="+",
        choices=["none", "fp16", "uint8"],
        default=None,
        help="instead of each regime's own (none; fp16 and uint8 in the wan_* regimes)",
    )
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per run (and per window)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds trained before the measured window")
    parser.add_argument(
        "--extend-until-round",
        type=float,
        default=0.0,
        metavar="S",
        help="a measured window with no applied round goes on until one is, for at most S more "
        "seconds (smoke tests on a loaded machine; default 0: fixed windows)",
    )
    parser.add_argument("--peers", type=int, default=None, help="instead of each regime's own (3; straggler 5)")
    parser.add_argument("--sim-params", type=int, default=None, help="parameters of the simulated model")
    parser.add_argument("--min-matchmaking-time", type=float, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json-peers", action="store_true", help="also store per-peer step times and records")
    parser.add_argument("--verbose", action="store_true", help="keep hivemind / DecentralizedSGD logs")
    parser.add_argument(
        "--hivemind-target-scale",
        type=float,
        default=1.0,
        help="hivemind_optimizer: target_batch_size times this (default 1: the swarm's samples in "
        "one min_matchmaking_time)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="time every hivemind matchmaking / DHT / AllReduce call into this folder "
        "(summary: benchmarks/hivemind_trace.py)",
    )
    args = parser.parse_args(argv)
    args.regimes = args.regimes or list(QUICK_REGIMES if args.quick else DEFAULT_REGIMES)
    args.modes = args.modes or list(QUICK_MODES if args.quick else MODES)
    return args


def _regime_config(args: argparse.Namespace, name: str) -> RunConfig:
    """Defaults, then --quick's, then the regime's own settings (and their --quick variant), then the command line.
    Full runs use the nominal setting (25M params, 5 s matchmaking); --quick shrinks but never drops cells."""
    regime = REGIMES[name]
    base = RunConfig(
        regime=name,
        mode="none",
        peers=args.peers or regime.peers or 3,
        verbose=args.verbose,
        trace_dir=None if args.trace is None else str(args.trace.resolve() / name),
    )
    if args.quick:  # setup is not measured: its timeout only catches a hung start (p2pd alone took > 40 s at load 15)
        base = replace(
            base,
            seconds=6.0,
            warmup_s=3.0,
            sim_params=1_000_000,
            min_matchmaking_time=2.0,
            request_timeout=1.0,
            allreduce_timeout=20.0,
            setup_timeout=90.0,
            shutdown_grace=0.5,
        )
    base = replace(base, **{**regime.nominal, **(regime.quick if args.quick else {})})
    if args.seconds is not None:
        base = replace(base, seconds=args.seconds)
    if args.warmup is not None:
        base = replace(base, warmup_s=args.warmup)
    base = replace(base, extend_until_round_s=args.extend_until_round)
    if args.sim_params is not None:
        base = replace(base, sim_params=args.sim_params)
    if args.min_matchmaking_time is not None:
        mmt = args.min_matchmaking_time
        base = replace(base, min_matchmaking_time=mmt, request_timeout=min(base.request_timeout, 0.6 * mmt))
    return base


def build_configs(args: argparse.Namespace) -> list[RunConfig]:
    """Every chosen regime with each of its modes (among --modes) and compressions."""
    baseline_seconds = 4.0 if args.quick and args.seconds is None else None  # `none` has no rounds to wait for
    configs = []
    for name in (r for r in REGIMES if r in args.regimes):
        base, regime = _regime_config(args, name), REGIMES[name]
        for mode in (m for m in MODES if m in args.modes and m in regime.modes):
            for compression in args.compressions or regime.compressions:
                cfg = replace(base, mode=mode, compression=compression)
                if mode == "none":
                    cfg = replace(cfg, seconds=baseline_seconds or cfg.seconds, warmup_s=min(cfg.warmup_s, 1.0))
                if mode == "hivemind_optimizer":
                    cfg = replace(cfg, warmup_s=max(cfg.warmup_s, hivemind_startup_s(cfg)))
                configs.append(cfg)
    return configs


def _prewarm(configs: Sequence[RunConfig]) -> None:
    """Pay one-time import costs (torch.optim takes ~2 s on first use) once, before forking peers."""
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    import hivemind  # noqa: F401
    from hivemind.optim.training_averager import TrainingAverager  # noqa: F401

    if any(cfg.mode in ABLATIONS or cfg.mode == "hivemind_optimizer" for cfg in configs):
        try:
            import decentralized_sgd  # noqa: F401
        except Exception as e:  # each run will report the failure in its own row
            print(f"[bench] cannot import decentralized_sgd: {e!r}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    warnings.filterwarnings("ignore")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the `finally` that kills peer process groups
    args = parse_args(argv)
    configs = build_configs(args)
    if any(cfg.spec.link_mbit for cfg in configs):
        if not netns.inside():  # peers need network namespaces: rerun this command inside a user namespace
            netns.reexec_inside(["-m", "benchmarks.bench_averaging", *(sys.argv[1:] if argv is None else argv)])
        netns.create_bridge()
    data = _digits() if any(c.trainer_kind == "cpu" for c in configs) else None  # load once, share via fork
    _prewarm(configs)
    started, runs = time.time(), []
    for cfg in configs:
        setup = None
        if cfg.mode == "hivemind_optimizer":  # from the runs of its regime so far: improved's rate, else none's
            target, setup = hivemind_target_batch_size(cfg, runs, data, args.hivemind_target_scale)
            cfg = replace(cfg, hivemind_target_batch_size=target)
        print(
            f"[bench] {cfg.regime:>13} / {cfg.mode:<18} / {cfg.compression:<5} ...",
            end=" ",
            flush=True,
            file=sys.stderr,
        )
        run = run_one(cfg, data)
        if setup is not None:
            run["hivemind_setup"] = setup
        run["config"] = {k: v for k, v in asdict(cfg).items() if k not in ("regime", "mode", "verbose")}
        runs.append(run)
        status = (
            f"skipped: {run['skipped']}"
            if run["skipped"]
            else "ok"
            if not run["error"]
            else run["error"].splitlines()[0][:120]
        )
        print(f"{run.get('wall_s', 0.0):.1f}s {status}", flush=True, file=sys.stderr)
    add_throughput_ratios(runs)
    targets = evaluate_targets(runs)
    report = report_tables(runs) + hivemind_setup_markdown(runs) + "\n" + targets_markdown(targets)
    print(report)
    print(f"\n[bench] total {time.time() - started:.0f}s for {len(runs)} runs", file=sys.stderr)
    write_text(args.markdown, report)
    if args.json:
        payload = {
            "runs": [_json_ready(r, args.json_peers) for r in runs],
            "targets": targets,
            "meta": run_metadata(args, started),
        }
        write_json(args.json, payload)
    if args.plot:
        plot_timeline(runs, args.plot)
    return runs


if __name__ == "__main__":
    main()
