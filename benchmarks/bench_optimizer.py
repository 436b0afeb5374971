#!/usr/bin/env python3
"""Does a swarm of 3 peers reach one peer's result sooner? The optimizer alone, in a plain PyTorch loop.

    nice -n 10 .venv/bin/python -m benchmarks.bench_optimizer --json benchmarks/results/optimizer.json \
        --markdown benchmarks/results/optimizer.md --plot benchmarks/results/optimizer.png

Why this benchmark: ``bench_learning.py`` measures SwAV in VISSL, where collapse and a tiny dataset hide what the
averaging does. Here the task rewards more samples: a small CNN (2 strided convs + 2 fc, ~0.1M parameters, a
couple of ms per step on one CPU thread) classifies Fashion-MNIST (60k training images, test accuracy on the 10k
test set; read from the IDX files of Debian's ``dataset-fashion-mnist``). SGD with momentum, a linear warm-up and a
cosine decay over a fixed budget of SAMPLES ``S`` (``--samples``). Every peer is a separate process (its own
session, killed as a whole afterwards), hivemind peers listen on 127.0.0.1 only, each with its own DHT; peer 0
bootstraps, the others join through its visible multiaddrs. The peers of a run start training at the same
instant (a file barrier), from the same initial model (``torch.manual_seed(seed)``: the same in every mode), and
each peer has its own data order (peer ``i`` of seed ``s`` shuffles with ``1000·s + i``).

Modes:
  alone               one peer trains the whole budget: S samples at batch B.
  swarm               3 peers with DecentralizedSGD (target_group_size 3, compression none, min_matchmaking_time 1 s).
  old                 the old design, ``baselines.old_design`` (its lock held from forward to step).
  hivemind_optimizer  ``hivemind.Optimizer(use_local_updates=True)`` as its docstring tells a user, averaging at every
                      global epoch of ``--hivemind_target_batch_size`` samples; its LR driven by this loop, no
                      ``scheduler`` (hivemind steps one per epoch: a staircase).
  ddp                 3 synchronous gloo processes, global batch 3B, the LR scaled linearly: the reference.
  ideal               the swarm's 3 peers as replicas in one process (``ideal_swarm``), averaged exactly every H
                      local steps (the swarm's measured median): swarm − ideal is what the system costs, ideal − ddp
                      what periodic averaging costs.

Paced steps: an averaging peer's step lasts at least ``--min_step_s`` (the rest is a sleep), as a box whose
accelerator takes a fixed time per step: unpaced, on a shared 2-core machine, the peers ran at very different speeds
and steps per round varied tenfold between runs. Alone and ddp are not paced.

The swarm-wide schedule: in every swarm mode the budget S is the swarm's total (each of 3 equal peers trains S/3)
and the LR schedule's position is the swarm's samples (a peer's local steps times the swarm's batch per step).

How each peer's LR scales with the swarm's total batch (``--swarm_lr``), with peak LR ``lr`` for
batch B (``--lr``) and a box's own LR ``lr·b/B`` for its batch b (linear per box, as ``recipe.scale_lr``):
  box     every peer keeps the LR of its own batch (lr·b/B);
  sqrt    lr·b/B · sqrt(total batch / b);
  linear  lr · total batch / B, as DDP does for the global batch.

Experiments (``--experiments``):
  main       the modes (``--modes``; default all) at ``--swarm_lr`` (>= 5 seeds).
  lr         swarm at every rule of ``--lr_rules`` (the main rule's runs are shared with main).
  weighting  peer 2 at batch 2B, peers 0 and 1 at B and paced to the same step rate: equal weights against
             ``weight_by_samples=True``.
  slowed     target_group_size 4 (never full) and ``--slowed_min_matchmaking_time``: rounds ~100-400 local steps
             apart, the ratio of real ResNet-50 boxes at 100 Mbit/s; at every rule of ``--slowed_lr_rules``.
  ideal      the ideal swarm in both regimes (``--seeds`` seeds).
  outer      DecentralizedSGD's outer optimizer (``--outer_momentum``, ``--outer_lr``, ``--outer_nesterov``: Nesterov
             b 0.5, a 0.7 by default), swarm and ideal, main and slowed regimes, each beside the same without it.

Recorded: test accuracy at ``--curve_points`` points along each peer's run against the samples of the swarm and the
steps per peer, local steps per applied round, the git state. The table gives the final accuracy (mean ± std over
seeds) and the speed-up over alone (alone's steps / the steps at which the variant's curve first reaches alone's
final accuracy). Nothing is measured in wall time. Run it under ``nice -n 10``.

``--quick``: 24k samples, 1 seed, 4 curve points, ``--modes`` (default alone swarm), averaging steps paced to at
least 100 ms so that a swarm peer averages a few times on any machine. ``--resume JSON``: keep that file's finished
runs and run only the rest of the plan. How the defaults were chosen: benchmarks/results/optimizer.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, git_state, kill_session, write_json
from benchmarks.optimizer_churn import (
    ChurnPlan,
)
from benchmarks.optimizer_peer import PeerConfig
from benchmarks.optimizer_plan import (
    DATA_DIR,
    EXPERIMENTS,
    IDX_FILES,
    LR_RULES,
    MODE_SETTINGS,
    MODES,
    SETUP_TIMEOUT_S,
    SHUTDOWN_GRACE_S,
    RunSpec,
    Settings,
    estimated_seconds,
    plan,
)
from benchmarks.optimizer_report import fmt, summarize_run, write_outputs

# ----------------------------------------------------------------------------------------------------- orchestrator


def peer_env() -> dict[str, str]:
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        MASTER_ADDR="127.0.0.1",
    )
    env["PYTHONPATH"] = str(REPO)
    return env


def run_one(spec: RunSpec, settings: Settings, out: Path, index: int) -> dict:
    """One run with fresh processes; every process it started is killed before it returns."""
    name = f"{index:03d}_{spec.mode}_s{spec.seed}"
    run_dir = out / name
    run_dir.mkdir(parents=True)
    count = spec.processes(settings)
    expected = estimated_seconds(spec, settings)
    deadline = time.time() + SETUP_TIMEOUT_S + 6 * expected + 120
    from vissl_swarm.local_swarm import free_port

    port = free_port() if spec.mode == "ddp" else 0
    record: dict[str, Any] = {
        "variant": spec.variant,
        **asdict(spec),
        "run_dir": str(run_dir),
        "error": None,
        "loadavg_before": os.getloadavg()[0],
        "commit": git_commit(),
    }
    processes: list[subprocess.Popen] = []
    logs = []
    started = time.time()
    try:
        for rank in range(count):
            config = PeerConfig(asdict(settings), asdict(spec), rank, str(run_dir), deadline, os.getpid(), port)
            (run_dir / f"peer{rank}.json").write_text(json.dumps(asdict(config)))
            logs.append(open(run_dir / f"peer{rank}.log", "w"))  # noqa: SIM115 (closed in finally)
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.optimizer_peer", str(run_dir / f"peer{rank}.json")],
                    cwd=REPO,
                    env=peer_env(),
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        wait_for_all(
            processes, [run_dir / f"ready{rank}.json" for rank in range(count)], started + SETUP_TIMEOUT_S, "ready"
        )
        record["setup_s"] = time.time() - started
        write_json(run_dir / "go.json", {"start_at": time.time() + 0.5})
        if spec.churn == "kill":
            restart_churned_peer(spec, settings, run_dir, processes, logs, deadline, port)
        results = wait_for_all(processes, [run_dir / f"result{rank}.json" for rank in range(count)], deadline, "result")
        if spec.mode == "ideal":
            results = results[0]["replicas"]
        exit_by = time.time() + SHUTDOWN_GRACE_S
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, exit_by - time.time()))
        record["clean_exit"] = all(process.returncode == 0 for process in processes)
        record["peers"] = results
    except Exception as error:
        record["error"] = f"{type(error).__name__}: {error}"
        record["logs"] = [str(run_dir / f"peer{rank}.log") for rank in range(count)]
    finally:
        for process in processes:
            kill_session(process)
        for log in logs:
            log.close()
    record["pids"] = [
        process.pid for process in processes
    ]  # (churn kill: the restarted process's)  # each led its own session: see leftovers()
    record["leftover_processes"] = leftovers(record["pids"])
    record["wall_s"] = time.time() - started
    record["loadavg_after"] = os.getloadavg()[0]
    if record["error"] is None:
        record.update(summarize_run(record["peers"]))
    return record


def restart_churned_peer(
    spec: RunSpec,
    settings: Settings,
    run_dir: Path,
    processes: list[subprocess.Popen],
    logs: list,
    deadline: float,
    port: int,
) -> None:
    """Churn kill: wait for the churned peer's crash and start it again at once with its own command
    (``restarted``: it waits for the others to reach two thirds of the run before it takes the swarm's state and
    trains); its new process replaces the old one in ``processes``."""
    churn = ChurnPlan.of(spec.churn, settings.peers, spec.steps(settings))
    crashed = processes[churn.rank]
    while crashed.poll() is None:
        if time.time() > deadline:
            raise TimeoutError(f"peer {churn.rank} did not crash at step {churn.stop_at} before the deadline")
        time.sleep(0.1)
    kill_session(crashed)  # whatever of its session survived the SIGKILL
    others = [rank for rank in range(settings.peers) if rank != churn.rank]
    for rank in others:
        if processes[rank].poll() is not None:
            raise RuntimeError(f"peer {rank} exited ({processes[rank].returncode}) while peer {churn.rank} was away")
    config = PeerConfig(
        asdict(settings), asdict(spec), churn.rank, str(run_dir), deadline, os.getpid(), port, restarted=True
    )
    config_path = run_dir / f"peer{churn.rank}_restarted.json"
    config_path.write_text(json.dumps(asdict(config)))
    logs.append(open(run_dir / f"peer{churn.rank}_restarted.log", "w"))  # noqa: SIM115 (closed by run_one)
    processes[churn.rank] = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.optimizer_peer", str(config_path)],
        cwd=REPO,
        env=peer_env(),
        stdout=logs[-1],
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def leftovers(sessions: list[int]) -> list[str]:
    """Processes still alive in the sessions this run's peers led (p2pd, averagers): there should be none."""
    listing = subprocess.run(["ps", "-e", "-o", "sid=,pid=,args="], capture_output=True, text=True, timeout=30)
    return [
        line.strip()[:200] for line in listing.stdout.splitlines() if line.split() and int(line.split()[0]) in sessions
    ]


def wait_for_all(processes: list[subprocess.Popen], files: list[Path], deadline: float, what: str) -> list[dict]:
    """Until every file exists; a process that exits without writing its file, or the deadline, fails the run."""
    while True:
        missing = [rank for rank, path in enumerate(files) if not path.exists()]
        if not missing:
            return [json.loads(path.read_text()) for path in files]
        for rank in missing:
            if processes[rank].poll() is not None and not files[rank].exists():
                tail = tail_of(files[rank].parent / f"peer{rank}.log")
                raise RuntimeError(f"peer {rank} exited ({processes[rank].returncode}) before '{what}':\n{tail}")
        if time.time() > deadline:
            raise TimeoutError(f"peers {missing} did not report '{what}' before the deadline")
        time.sleep(0.2)


def tail_of(path: Path, lines: int = 25) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


# ----------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    defaults = Settings()
    parser.add_argument("--quick", action="store_true", help="a tiny budget, 1 seed, experiment main with --modes")
    parser.add_argument("--experiments", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=None,
        help="modes of experiment main (default: all; --quick: alone swarm)",
    )
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 of experiments main and lr")
    parser.add_argument("--weighting_seeds", type=int, default=3)
    parser.add_argument("--slowed_seeds", type=int, default=3)
    parser.add_argument(
        "--slowed_lr_rules",
        nargs="+",
        choices=LR_RULES,
        default=list(LR_RULES),
        help="experiment slowed: does the LR rule's ranking carry over to rounds far apart?",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a JSON this script wrote with the same settings: keep its runs, run only the rest "
        "(a setting of one mode only, e.g. --hivemind_target_batch_size, may differ: that "
        "mode's runs are redone)",
    )
    parser.add_argument(
        "--swarm_lr",
        choices=LR_RULES,
        default="sqrt",
        help="how a swarm peer's LR scales with the swarm's total batch (main, weighting, slowed)",
    )
    parser.add_argument("--lr_rules", nargs="+", choices=LR_RULES, default=list(LR_RULES), help="experiment lr")
    parser.add_argument("--samples", type=int, default=defaults.samples, help="S, the budget (the swarm's total)")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="B, a peer's batch")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak LR at batch B")
    parser.add_argument("--curve_points", type=int, default=defaults.curve_points)
    parser.add_argument(
        "--min_matchmaking_time",
        type=float,
        default=defaults.min_matchmaking_time,
        help="the main regime's (hivemind_optimizer: its matchmaking_time)",
    )
    parser.add_argument("--slowed_min_matchmaking_time", type=float, default=defaults.slowed_min_matchmaking_time)
    parser.add_argument(
        "--ideal_period",
        type=int,
        default=25,
        help="experiments ideal, outer: the ideal's local steps per round in the main regime (the swarm's median)",
    )
    parser.add_argument(
        "--slowed_ideal_period", type=int, default=179, help="the same for the slowed regime (the swarm's median)"
    )
    parser.add_argument(
        "--churn_pace_s",
        type=float,
        default=0.05,
        help="experiment churn: every step of its runs lasts at least this long (a restarted peer needs ~20 s)",
    )
    parser.add_argument("--outer_momentum", type=float, default=0.5, help="experiment outer: the variant's b")
    parser.add_argument("--outer_lr", type=float, default=0.7, help="experiment outer: the variant's a")
    parser.add_argument(
        "--outer_nesterov", action=argparse.BooleanOptionalAction, default=True, help="experiment outer: its form"
    )
    parser.add_argument("--hivemind_target_batch_size", type=int, default=defaults.hivemind_target_batch_size)
    parser.add_argument(
        "--min_step_s",
        type=float,
        default=defaults.min_step_s,
        help="an averaging peer's step lasts at least this long (the rest is a sleep)",
    )
    parser.add_argument("--data_dir", type=Path, default=DATA_DIR, help="the Fashion-MNIST IDX files (.gz)")
    parser.add_argument(
        "--out", type=Path, default=None, help="peer configs and logs; default benchmarks/out/optimizer/<time>"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument(
        "--headline_plot", type=Path, default=None, help="the README's plot: alone, swarm, ddp, hivemind_optimizer"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    missing = [name for name in IDX_FILES.values() if not (args.data_dir / name).exists()]
    if missing:
        print(f"error: {args.data_dir} lacks {missing} (apt-get install dataset-fashion-mnist)", file=sys.stderr)
        return 2
    if args.quick:
        args.experiments, args.seeds = ["main"], 1
        args.modes = args.modes or ["alone", "swarm"]
        settings = Settings(
            samples=24_000,
            curve_points=4,
            min_step_s=0.1,
            data_dir=str(args.data_dir),
            batch=args.batch,
            lr=args.lr,
            min_matchmaking_time=args.min_matchmaking_time,
            hivemind_target_batch_size=min(args.hivemind_target_batch_size, 4 * 3 * args.batch),
        )
    else:
        args.modes = args.modes or list(MODES)
        settings = Settings(
            samples=args.samples,
            batch=args.batch,
            lr=args.lr,
            curve_points=args.curve_points,
            min_matchmaking_time=args.min_matchmaking_time,
            slowed_min_matchmaking_time=args.slowed_min_matchmaking_time,
            hivemind_target_batch_size=args.hivemind_target_batch_size,
            data_dir=str(args.data_dir),
            min_step_s=args.min_step_s,
        )
    runs = plan(args, settings)
    out = args.out or REPO / "benchmarks/out/optimizer" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "commit": git_commit(),
        "command": [sys.argv[0], *(argv or sys.argv[1:])],
        "dataset": {
            "name": "Fashion-MNIST" if args.data_dir == DATA_DIR else "IDX files",
            "dir": str(args.data_dir),
            "files": list(IDX_FILES.values()),
        },
        "settings": asdict(settings),
        "swarm_lr": args.swarm_lr,
        "quick": args.quick,
        "experiments": args.experiments,
        "cpus": os.cpu_count(),
        "runs": [],
    }
    if args.resume is not None:
        previous = json.loads(args.resume.read_text())
        changed = {key for key, value in previous["settings"].items() if result["settings"].get(key) != value}
        redo = {MODE_SETTINGS[key] for key in changed if key in MODE_SETTINGS}  # modes whose own settings changed
        if changed - set(MODE_SETTINGS) or previous["swarm_lr"] != args.swarm_lr:
            print(
                f"error: --resume {args.resume} was measured with other settings ({sorted(changed)})", file=sys.stderr
            )
            return 2
        result["commands"] = [*previous.get("commands", [previous["command"]]), result["command"]]
        result["previous_commits"] = [*previous.get("previous_commits", []), previous["commit"]]
        result["runs"] = [run for run in previous["runs"] if run["error"] is None and run["mode"] not in redo]
        done = {json.dumps(asdict(spec_of(run)), sort_keys=True) for run in result["runs"]}
        runs = [spec for spec in runs if json.dumps(asdict(spec), sort_keys=True) not in done]
        print(f"resuming {args.resume}: {len(result['runs'])} runs kept, {len(runs)} to run", flush=True)
    expected = sum(estimated_seconds(spec, settings) for spec in runs)
    print(
        f"bench_optimizer: {len(runs)} runs ({', '.join(sorted({spec.variant for spec in runs}))}), S = "
        f"{settings.samples}, B = {settings.batch}; expected about {expected / 60:.1f} min on a quiet 2-core machine "
        f"(a busy one takes 2-3x); logs in {out}",
        flush=True,
    )
    if not runs:
        write_outputs(args, result)
        return 0
    install_sigterm()
    t0 = time.time()
    try:
        for index, spec in enumerate(runs):
            run = run_one(spec, settings, out, index)
            result["runs"].append(run)
            status = run["error"] or (
                f"final {run['final_accuracy']:.4f}, steps/round "
                f"{fmt(run['steps_per_round'], 0)}, rounds/peer "
                f"{run['rounds_applied_per_peer']:.1f}"
            )
            print(
                f"[{index + 1}/{len(runs)}] {spec.variant} seed {spec.seed}: {status} ({run['wall_s']:.0f} s; "
                f"load {run['loadavg_before']:.1f})",
                flush=True,
            )
            result["wall_s"] = time.time() - t0
            write_outputs(args, result, final=index == len(runs) - 1)  # after every run: a cut-short run keeps data
    except KeyboardInterrupt:  # run_one's finally has killed that run's processes; the outputs hold the runs done
        print(f"interrupted after {len(result['runs'])} of {len(runs)} runs", file=sys.stderr)
        return 130
    return 1 if any(run["error"] for run in result["runs"]) else 0


def git_commit() -> dict:
    state = git_state()
    return {"head": state["commit"], "dirty": state["dirty"]}


def spec_of(run: dict) -> RunSpec:
    """The RunSpec a run record was made from (the record holds its fields; older records lack newer ones)."""
    return RunSpec(**{name: run[name] for name in RunSpec.__dataclass_fields__ if name in run})


def install_sigterm() -> None:
    """SIGTERM (a test's timeout, a CI cancel) ends the benchmark like Ctrl-C: run_one's finally kills the peers."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


if __name__ == "__main__":
    sys.exit(main())
