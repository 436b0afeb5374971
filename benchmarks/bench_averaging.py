#!/usr/bin/env python
"""The old design (TrainingAverager one round at a time), DecentralizedSGD, each of its improvements switched off,
and hivemind.Optimizer(use_local_updates=True), on the same workloads: how often they average, how stale the averaged
parameters are, how long they hold the trainer, and what one uneven peer or a slow link does to them.

    python -m benchmarks.bench_averaging [--quick] [--regimes R ...] [--modes M ...] [--json PATH] [--markdown PATH]

Every peer is a forked process with its own DHT on 127.0.0.1 (peer 0 bootstraps); a step is a sleep and the
parameters are really averaged (``averaging_setup.SimTrainer``). Regimes (``averaging_setup.REGIMES``): sim_full /
sim_not_full (groups fill or never do, the default), straggler (the last of 5 peers SIGSTOPped 80% of the time),
slow_step (the last peer's steps 20x slower), wan_100mbit / wan_1gbit (each peer in a network namespace behind a
shaped link; the script re-executes itself inside ``unshare -rn``). Each run trains a warm-up, then a measured window
(perturbed regimes: a reference window, then a perturbed one); ``averaging_metrics`` defines every number.
``--quick``: sim_full with none, old and improved, 1M parameters, short windows.
"""

from __future__ import annotations

import argparse
import hashlib
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
from benchmarks.averaging_metrics import _to_wall, add_throughput_ratios, round_spans
from benchmarks.averaging_peers import run_one
from benchmarks.averaging_setup import ABLATIONS, DEFAULT_REGIMES, MODES, REGIMES, RunConfig
from benchmarks.common import (
    OUTCOME_COLORS,
    REPO,
    git_state,
    machine,
    pyplot,
    round_outcome,
    save_figure,
    write_json,
    write_text,
)

QUICK_REGIMES = ("sim_full",)
QUICK_MODES = ("none", "old", "improved")
QUICK = dict(  # setup is not measured: its timeout only catches a hung start (p2pd alone is slow on a loaded machine)
    seconds=6.0,
    warmup_s=3.0,
    sim_params=1_000_000,
    min_matchmaking_time=2.0,
    request_timeout=1.0,
    allreduce_timeout=20.0,
    setup_timeout=90.0,
    shutdown_grace=0.5,
)
SPAN_COLORS = {"matchmaking": "tab:blue", "awaiting": "tab:orange", "allreduce": "tab:green", "copy": "tab:gray"}


def run_metadata(args: argparse.Namespace, started: float) -> dict:
    """What the numbers depend on: versions, the exact optimizer files, and how busy the shared machine was."""
    import hivemind

    sources = sorted((REPO / "decentralized_sgd").glob("*.py"))
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()[:16]
    return {
        "git": git_state(),
        "argv": sys.argv[1:],
        "quick": args.quick,
        "started": time.strftime("%F %T", time.localtime(started)),
        "total_s": time.time() - started,
        **machine(),
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
    """Per peer: each round's stage spans as bars (two lanes: pipelined rounds stay visible), step ticks, outcomes."""
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--quick", action="store_true", help="every arm's code path in ~2 min on 2 cores (see above)")
    add("--regimes", nargs="+", choices=list(REGIMES), default=None)
    add("--modes", nargs="+", choices=list(MODES), default=None, help="among each regime's own modes")
    add("--compressions", nargs="+", choices=["none", "fp16", "uint8"], default=None, help="instead of the regime's")
    add("--seconds", type=float, default=None, help="measured seconds per run (and per window)")
    add("--warmup", type=float, default=None, help="seconds trained before the measured window")
    add(
        "--extend-until-round",
        type=float,
        default=0.0,
        metavar="S",
        help="a window without a round goes on for up to S s",
    )
    add("--peers", type=int, default=None, help="instead of each regime's own (3; straggler 5)")
    add("--sim-params", type=int, default=None, help="parameters of the simulated model")
    add("--min-matchmaking-time", type=float, default=None)
    add("--json", type=Path, default=None)
    add("--markdown", type=Path, default=None)
    add("--plot", type=Path, default=None, help="the round timeline of sim_not_full's old and improved runs")
    add("--json-peers", action="store_true", help="also store per-peer step times and records")
    add("--verbose", action="store_true", help="keep hivemind / DecentralizedSGD logs")
    args = parser.parse_args(argv)
    args.regimes = args.regimes or list(QUICK_REGIMES if args.quick else DEFAULT_REGIMES)
    args.modes = args.modes or list(QUICK_MODES if args.quick else MODES)
    return args


def _regime_config(args: argparse.Namespace, name: str) -> RunConfig:
    """Defaults, then --quick's, then the regime's own settings (and their --quick variant), then the command line."""
    regime = REGIMES[name]
    base = RunConfig(name, "none", peers=args.peers or regime.peers or 3, verbose=args.verbose)
    base = replace(base, **{**(QUICK if args.quick else {}), **regime.nominal, **(regime.quick if args.quick else {})})
    given = {"seconds": args.seconds, "warmup_s": args.warmup, "sim_params": args.sim_params}
    base = replace(
        base, extend_until_round_s=args.extend_until_round, **{k: v for k, v in given.items() if v is not None}
    )
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
                configs.append(cfg)
    return configs


def _prewarm(configs: Sequence[RunConfig]) -> None:
    """Pay one-time import costs (torch.optim takes ~2 s on first use) once, before forking peers."""
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    import hivemind  # noqa: F401
    from hivemind.optim.training_averager import TrainingAverager  # noqa: F401

    if any(cfg.mode in ABLATIONS for cfg in configs):
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
    _prewarm(configs)
    started, runs = time.time(), []
    for cfg in configs:
        print(f"[bench] {cfg.regime:>13} / {cfg.mode:<18} / {cfg.compression:<5} ...", end=" ", file=sys.stderr)
        run = run_one(cfg)
        run["config"] = {k: v for k, v in asdict(cfg).items() if k not in ("regime", "mode", "verbose")}
        runs.append(run)
        status = f"skipped: {run['skipped']}" if run["skipped"] else (run["error"] or "ok").splitlines()[0][:120]
        print(f"{run.get('wall_s', 0.0):.1f}s {status}", flush=True, file=sys.stderr)
    add_throughput_ratios(runs)
    report = report_tables(runs)
    print(report)
    print(f"\n[bench] total {time.time() - started:.0f}s for {len(runs)} runs", file=sys.stderr)
    write_text(args.markdown, report)
    if args.json:
        write_json(
            args.json, {"runs": [_json_ready(r, args.json_peers) for r in runs], "meta": run_metadata(args, started)}
        )
    if args.plot:
        plot_timeline(runs, args.plot)
    return runs


if __name__ == "__main__":
    main()
