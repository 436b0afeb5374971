#!/usr/bin/env python3
"""Does a swarm of 3 boxes reach one box's trunk sooner? Every mode trains the same recipe: the same num_epochs, a
budget of samples that one box trains alone and that a swarm shares (the swarm-wide schedule, run_trainer.py's
default), as a DDP run's epochs count its global batch.

    python -m benchmarks.bench_learning --json benchmarks/results/learning.json \
        --markdown benchmarks/results/learning.md --plot benchmarks/results/learning.png
    python -m benchmarks.bench_learning --quick   # minutes: digits + swav_tiny, 1 seed, alone and swarm

Fashion-MNIST as ``data/fashion/{train,val}/<class>/*.png`` (``make data-fashion``), config ``swav_fashion``. Modes
(``MODES``), all from the seed's initial model: alone (the reference), the swarm variants, ddp, and the floors
random_init and raw_pixels; swarm_churn kills and restarts a box, swarm_paced has its pace without the kill. Measured
per mode and seed against steps and samples, never wall time: kNN top-1 on val along each box's run and the SwAV loss
on a held-out set; reported: final kNN mean ± std, and where each curve first reaches ``alone``'s final kNN.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.common import git_state
from benchmarks.learning_churn import Churn, Watch, check_exits, churn_summary, crash_report, run_churn
from benchmarks.learning_eval import (
    Evaluator,
    InitialModel,
    evaluate_run,
    floor_runs,
    hivemind_target_for,
    run_id,
    write_initial_model,
)
from benchmarks.learning_report import paired_differences, plot, report_markdown, summarize
from benchmarks.learning_setup import (
    CHURN_PACE_S,
    DECODE_S_PER_IMAGE,
    DEFAULTS,
    EVAL_S_PER_IMAGE,
    FLOOR_ROWS,
    HIVEMIND_TARGET_ENV,
    MODES,
    NO_STATE_DOWNLOAD,
    NORMAL_HIVEMIND_STEPS,
    NORMAL_MATCHMAKING_S,
    OUTER_FLAGS,
    PACED_MODES,
    QUICK,
    SLOW_HIVEMIND_STEPS,
    SLOW_MATCHMAKING_S,
    SWARM_MODES,
    TRAINED,
    BenchError,
    Plan,
    count_images,
    estimated_seconds,
    fresh_out_dir,
    make_plan,
)
from vissl_swarm.local_swarm import LocalPeer, start_swarm_together, stop_all


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = parser.add_argument
    quick = ", ".join(f"--{key} {' '.join(map(str, v)) if isinstance(v, list) else v}" for key, v in QUICK.items())
    add("--quick", action="store_true", help=f"minutes: {quick} (what the tests run)")
    add("--data_path", type=Path, default=None, help=f"train/ and val/ ImageFolders (default {DEFAULTS['data_path']})")
    add("--config", default=None, help=f"config of every process (default {DEFAULTS['config']})")
    add("--epochs", type=int, default=None, help=f"the recipe's num_epochs, every mode's budget ({DEFAULTS['epochs']})")
    add("--seeds", type=int, default=None, help=f"runs per mode: seeds 0 .. SEEDS-1 ({DEFAULTS['seeds']})")
    add("--boxes", type=int, default=3, help="boxes of a swarm (ddp: local processes)")
    add("--train_images", type=int, default=None, help="train on this many images of the train split (default 0: all)")
    add("--curve_points", type=int, default=None, help="checkpoints evaluated along each box's run")
    add("--modes", nargs="+", choices=MODES, default=None, help="modes to run (default: all)")
    add("--knn_train", type=int, default=20000, help="kNN bank: this many train images (0: all)")
    add("--heldout_images", type=int, default=None, help=f"of the held-out SwAV loss ({DEFAULTS['heldout_images']})")
    add("--heldout_batch", type=int, default=None, help=f"its Sinkhorn batch ({DEFAULTS['heldout_batch']})")
    add("--churn_pace_s", type=float, default=CHURN_PACE_S, help="swarm_churn and swarm_paced: least step time")
    add("--slow_averaging", action="store_true", help="the swarm modes at ResNet-50 boxes' ~100-400 steps per round")
    slow = f"(--slow_averaging {SLOW_MATCHMAKING_S:g} s, {SLOW_HIVEMIND_STEPS} steps)"
    add(
        "--min_matchmaking_time",
        type=float,
        default=None,
        help=f"of the swarm modes ({NORMAL_MATCHMAKING_S:g} s) {slow}",
    )
    add("--hivemind_steps_per_round", type=float, default=None, help=f"if swarm did not run ({NORMAL_HIVEMIND_STEPS})")
    add("--override", action="append", default=[], metavar="KEY=VALUE", help="a Hydra override of every process")
    add("--out", type=Path, default=None, help="a new or empty folder (default benchmarks/out/learning/<time>)")
    add("--json", type=Path, default=None, help="write settings, runs and summary here")
    add("--markdown", type=Path, default=None, help="write the table here")
    add("--plot", type=Path, default=None, help="write the curves here (PNG)")
    return parser


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that --quick and --slow_averaging change; check the rest."""
    for name, value in {**DEFAULTS, **(QUICK if args.quick else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.min_matchmaking_time is None:
        args.min_matchmaking_time = SLOW_MATCHMAKING_S if args.slow_averaging else NORMAL_MATCHMAKING_S
    if args.hivemind_steps_per_round is None:
        args.hivemind_steps_per_round = SLOW_HIVEMIND_STEPS if args.slow_averaging else NORMAL_HIVEMIND_STEPS
    for name in ("epochs", "seeds", "curve_points", "heldout_images", "heldout_batch"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.boxes < 2:
        raise BenchError(f"--boxes must be at least 2, got {args.boxes}")
    if args.min_matchmaking_time <= 0 or args.hivemind_steps_per_round <= 0:
        raise BenchError("--min_matchmaking_time and --hivemind_steps_per_round must be positive")
    if args.churn_pace_s < 0:
        raise BenchError(f"--churn_pace_s must be 0 or more, got {args.churn_pace_s}")
    return args


def make_peers(mode: str, seed: int, out: Path, plan: Plan, env: dict[str, str], pace_s: float) -> list[LocalPeer]:
    """The run's processes; ``pace_s`` > 0: swarm boxes whose steps last at least that long (tests/paced_trainer.py)."""
    run_dir = out / mode / f"seed{seed}"
    if mode == "ddp":  # gloo on the loopback only (it would pick the host name's interface otherwise)
        return [LocalPeer("ddp", run_dir, config=plan.config, env={"GLOO_SOCKET_IFNAME": "lo"})]
    if mode == "alone":
        return [LocalPeer("box0", run_dir, config=plan.config)]
    script = LocalPeer.script
    if pace_s > 0:
        from tests.paced_trainer import MIN_STEP_ENV, SCRIPT

        env, script = {**env, MIN_STEP_ENV: f"{pace_s:g}"}, SCRIPT
    return [
        LocalPeer(f"box{index}", run_dir, config=plan.config, env=dict(env), script=script)
        for index in range(plan.boxes)
    ]


def pace_of(mode: str, args: argparse.Namespace) -> float:
    return args.churn_pace_s if mode in PACED_MODES else 0.0


def trainer_arguments(
    mode: str, seed: int, plan: Plan, initial: InitialModel, args: argparse.Namespace
) -> tuple[list[str], list[str]]:
    """(flags, overrides) of every process of a run, ``--override`` first; the box's own SEED_VALUE is added per box."""
    flags = ["--run_id", run_id(seed)]
    overrides = [
        *args.override,
        f"config.OPTIMIZER.num_epochs={plan.epochs}",
        f"config.DATA.TRAIN.DATA_LIMIT={plan.data_limit}",
        f"config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY={plan.checkpoint_every(mode)}",
        "config.CHECKPOINT.CHECKPOINT_FREQUENCY=1000000",
        f"config.LOG_FREQUENCY={1 if mode in PACED_MODES else 20}",  # churn: the kill lands on box 2's step
    ]
    if mode in SWARM_MODES:
        group = plan.boxes + 1 if args.slow_averaging else plan.boxes  # slow: no group fills before the deadline
        flags += [
            "--averager",
            SWARM_MODES[mode],
            "--target_group_size",
            str(group),
            "--min_matchmaking_time",
            f"{args.min_matchmaking_time:g}",
            "--averaging_timeout",
            "30",
            "--next_chunk_timeout",
            "5",
            *NO_STATE_DOWNLOAD,
            *(OUTER_FLAGS if mode == "swarm_outer" else []),
        ]
    else:  # VISSL's stock self_supervision_task, from the seed's initial model
        flags.append("--isolated")
        overrides.append(f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={initial.path}")
    if mode == "ddp":
        overrides.append(f"config.DISTRIBUTED.NUM_PROC_PER_NODE={plan.boxes}")
    return flags, overrides


def box_seed(seed: int, index: int) -> list[str]:
    return [f"config.SEED_VALUE={1000 * seed + index}"]


def train(
    mode: str,
    seed: int,
    peers: list[LocalPeer],
    args: argparse.Namespace,
    plan: Plan,
    initial: InitialModel,
    deadline_s: float,
) -> tuple[float, dict | None]:
    """Run the processes (swarm_churn: ``run_churn``) to their end: (wall s, churn record or None), else BenchError."""
    flags, overrides = trainer_arguments(mode, seed, plan, initial, args)
    started = time.monotonic()
    watch = Watch(mode, seed, peers, started + deadline_s)
    churned = None
    try:
        if mode in SWARM_MODES:
            addresses = start_swarm_together(
                peers,
                args.data_path,
                flags,
                overrides,
                per_peer_overrides=lambda peer: box_seed(seed, peers.index(peer)),
            )
        else:
            peers[0].start(args.data_path, [], flags, overrides + box_seed(seed, 0))
        if mode == "swarm_churn":

            def restart(box: LocalPeer) -> None:  # its own command, as its first start had it (README's restart)
                box.start(args.data_path, addresses, restart_flags(flags), overrides + box_seed(seed, peers.index(box)))

            churned = run_churn(Churn.of(plan), peers, restart, watch)
        watch.until(lambda: not any(peer.is_running() for peer in peers), "every process finishing", poll=1.0)
    except (RuntimeError, TimeoutError) as error:  # a box that died or hung before its join line, or the deadline
        raise BenchError(f"{mode} seed {seed}: {error}{crash_report(peers)}") from error
    finally:
        stop_all(peers)
    check_exits(mode, seed, peers)
    return time.monotonic() - started, churned


def restart_flags(flags: list[str]) -> list[str]:
    """A box's command without ``NO_STATE_DOWNLOAD``: restarted, it takes the swarm's state if that is ahead."""
    at = next(i for i in range(len(flags)) if flags[i : i + len(NO_STATE_DOWNLOAD)] == NO_STATE_DOWNLOAD)
    return flags[:at] + flags[at + len(NO_STATE_DOWNLOAD) :]


def run_one(
    mode: str,
    seed: int,
    args: argparse.Namespace,
    plan: Plan,
    evaluator: Evaluator,
    initial: InitialModel,
    runs: list[dict],
    raw_pixels: float | None,
    eval_images: int,
) -> dict:
    if mode in FLOOR_ROWS:
        return floor_runs(mode, seed, initial, raw_pixels)
    env, target = {}, None
    if mode == "hivemind_optimizer":
        target, source = hivemind_target_for(seed, runs, plan, args)
        env[HIVEMIND_TARGET_ENV] = str(target)
        print(
            f"hivemind_optimizer seed {seed}: a global epoch every {target} samples of the swarm ({source})", flush=True
        )
    peers = make_peers(mode, seed, args.out, plan, env, pace_of(mode, args))
    deadline_s = 4 * estimated_seconds(mode, plan, eval_images, pace_of(mode, args)) + 600
    wall_s, churned = train(mode, seed, peers, args, plan, initial, deadline_s)
    result = evaluate_run(mode, seed, peers, plan, evaluator, initial, wall_s, target)
    if churned is not None:
        result["churn"] = churn_summary(churned, result["steps_per_box"], plan.batch, plan.budget_samples)
    if not result["same_initial_model"]:
        print(
            f"warning: {mode} seed {seed}: not every process logged starting from {initial.path} (trunk "
            f"{initial.trunk_fingerprint}); logs: {peers[0].out_dir}",
            file=sys.stderr,
            flush=True,
        )
    return result


def write_outputs(args: argparse.Namespace, settings: dict, runs: list[dict]) -> tuple[list[dict], list[dict]]:
    alone = {run["seed"]: run["knn"] for run in runs if run["mode"] == "alone" and "error" not in run}
    summaries = [
        summarize(mode, [run for run in runs if run["mode"] == mode], alone)
        for mode in args.modes
        if any(run["mode"] == mode for run in runs)
    ]
    differences = paired_differences(runs)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = {"settings": settings, "summary": summaries, "differences": differences, "runs": runs}
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return summaries, differences


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args = resolve_args(args)
        plan = make_plan(args)
        args.out = fresh_out_dir(args.out)
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the evaluations on one thread: more OpenMP threads spin on a busy machine
    seeds = list(range(args.seeds))
    val_images = count_images(args.data_path / "val")
    bank = min(args.knn_train, plan.train_images) if args.knn_train else plan.train_images
    eval_images = bank + val_images
    trained = [mode for mode in args.modes if mode in TRAINED]
    expected = eval_images * DECODE_S_PER_IMAGE + len(seeds) * (
        3 * eval_images * EVAL_S_PER_IMAGE
        + sum(estimated_seconds(mode, plan, eval_images, pace_of(mode, args)) for mode in args.modes)
    )
    print(
        f"{len(args.modes)} modes x {len(seeds)} seeds: {plan.config} on {args.data_path}, {plan.epochs} epochs of "
        f"{plan.data_limit} images = {plan.budget_samples} samples per run ({plan.alone_steps} steps alone at batch "
        f"{plan.batch}, ~{plan.shared_steps} per box of {plan.boxes}), kNN bank {bank} / {val_images} queries, "
        f"into {args.out}; expected about {expected / 60:.0f} min on a busy 2-core machine",
        flush=True,
    )
    settings = {
        "git": git_state(),
        "command": sys.argv if argv is None else ["bench_learning.py", *argv],
        "dataset": {
            "path": str(args.data_path),
            "train_images": plan.train_images,
            "val_images": val_images,
            "knn_bank": bank,
        },
        "recipe": {
            **asdict(plan),
            "alone_steps": plan.alone_steps,
            "shared_steps": plan.shared_steps,
            "budget_samples": plan.budget_samples,
            "overrides": args.override,
            "checkpoint_every": {mode: plan.checkpoint_every(mode) for mode in trained},
        },
        "averaging": {
            "slow_averaging": args.slow_averaging,
            "min_matchmaking_time": args.min_matchmaking_time,
            "hivemind_steps_per_round": args.hivemind_steps_per_round,
            "churn_pace_s": {mode: pace_of(mode, args) for mode in PACED_MODES if mode in args.modes},
        },
        "heldout": {"images": args.heldout_images, "batch": args.heldout_batch},
        "seeds": seeds,
        "out": str(args.out),
    }
    evaluator = Evaluator(
        plan.config, args.override, args.data_path, args.knn_train, args.heldout_images, args.heldout_batch
    )
    settings["evaluation"] = evaluator.sizes
    raw_pixels = round(evaluator.raw_pixels(), 4) if "raw_pixels" in args.modes else None
    runs: list[dict] = []
    for seed in seeds:
        initial = write_initial_model(seed, args.out / "initial", plan.config, args.override, evaluator)
        settings.setdefault("initial_models", {})[seed] = {
            "knn": initial.knn,
            "heldout_loss": initial.heldout_loss,
            "knn_adapted_bn": initial.knn_adapted_bn,
        }
        for mode in args.modes:
            try:
                run = run_one(mode, seed, args, plan, evaluator, initial, runs, raw_pixels, eval_images)
            except BenchError as error:  # e.g. one mode crashing: report it, keep measuring the others
                print(f"error: {error}", file=sys.stderr, flush=True)
                run = {"mode": mode, "seed": seed, "error": str(error)}
            runs.append(run)
            shown = {k: v for k, v in run.items() if k not in ("curve", "curves_per_box", "rounds_per_box")}
            print(f"{mode} seed {seed}: {json.dumps(shown)}", flush=True)
            write_outputs(args, settings, runs)  # partial results survive an interrupted benchmark
    summaries, differences = write_outputs(args, settings, runs)
    table = report_markdown(summaries, differences, runs)
    print(table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    if args.plot:
        regime = "slow averaging" if args.slow_averaging else f"matchmaking {args.min_matchmaking_time:g} s"
        plot(
            summaries,
            args.plot,
            f"{plan.config}, {plan.epochs} epochs of {plan.data_limit} images, {plan.boxes} "
            f"boxes x batch {plan.batch}, {regime}; mean ± std over {len(seeds)} seed(s)",
        )
    return 0 if all("error" not in run for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
