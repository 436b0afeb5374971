#!/usr/bin/env python3
"""Does a swarm of 3 peers reach one peer's result sooner? The optimizer alone, in a plain PyTorch loop.

    nice -n 10 .venv/bin/python -m benchmarks.bench_optimizer --json benchmarks/results/optimizer.json \
        --markdown benchmarks/results/optimizer.md --plot benchmarks/results/optimizer.png

Why: bench_learning measures SwAV in VISSL, where collapse and a tiny dataset hide what the averaging does; here the
task rewards more samples: a small CNN on Fashion-MNIST over a budget of ``--samples`` that a swarm shares, each peer
a process with its own DHT and data order, an averaging peer's step at least ``--min_step_s`` (as an accelerator's).
Modes and experiments: ``optimizer_plan``; ideal (``ideal_swarm``) splits the gap to ddp into the system's cost and
periodic averaging's. Test accuracy against steps and samples, never wall time; ``optimizer_report`` makes the tables.
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
from benchmarks.optimizer_churn import ChurnPlan
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
            processes.append(start_peer(run_dir / f"peer{rank}.json", logs))
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
    record["pids"] = [process.pid for process in processes]  # each led its own session (see leftovers)
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
    """Churn kill: once the churned peer crashed, start it again (``restarted``), in its place in ``processes``."""
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
    processes[churn.rank] = start_peer(config_path, logs)


def start_peer(config_path: Path, logs: list) -> subprocess.Popen:
    """``optimizer_peer`` with this config in a session of its own, its output to a ``.log`` added to ``logs``."""
    logs.append(open(config_path.with_suffix(".log"), "w"))  # noqa: SIM115
    command = [sys.executable, "-m", "benchmarks.optimizer_peer", str(config_path)]
    return subprocess.Popen(
        command, cwd=REPO, env=peer_env(), stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    defaults, add = Settings(), parser.add_argument
    add("--quick", action="store_true", help="a tiny budget, 1 seed, experiment main with --modes")
    add("--experiments", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    add("--modes", nargs="+", choices=MODES, default=None, help="of experiment main (default all; --quick alone swarm)")
    add("--seeds", type=int, default=5, help="seeds 0..N-1 of experiments main and lr")
    add("--weighting_seeds", type=int, default=3)
    add("--slowed_seeds", type=int, default=3)
    add("--slowed_lr_rules", nargs="+", choices=LR_RULES, default=list(LR_RULES), help="experiment slowed's rules")
    add("--resume", type=Path, default=None, help="a JSON of this script with the same settings: run only the rest")
    add("--swarm_lr", choices=LR_RULES, default="sqrt", help="how a swarm peer's LR scales with the swarm's batch")
    add("--lr_rules", nargs="+", choices=LR_RULES, default=list(LR_RULES), help="experiment lr")
    add("--samples", type=int, default=defaults.samples, help="S, the budget (the swarm's total)")
    add("--batch", type=int, default=defaults.batch, help="B, a peer's batch")
    add("--lr", type=float, default=defaults.lr, help="peak LR at batch B")
    add("--curve_points", type=int, default=defaults.curve_points)
    add("--min_matchmaking_time", type=float, default=defaults.min_matchmaking_time, help="the main regime's")
    add("--slowed_min_matchmaking_time", type=float, default=defaults.slowed_min_matchmaking_time)
    add("--ideal_period", type=int, default=25, help="the ideal's local steps per round (the swarm's median)")
    add("--slowed_ideal_period", type=int, default=179, help="the same in the slowed regime")
    add("--churn_pace_s", type=float, default=0.05, help="experiment churn: every step lasts at least this long")
    add("--outer_momentum", type=float, default=0.5, help="experiment outer: the variant's b")
    add("--outer_lr", type=float, default=0.7, help="experiment outer: the variant's a")
    add("--outer_nesterov", action=argparse.BooleanOptionalAction, default=True, help="experiment outer: its form")
    add("--hivemind_target_batch_size", type=int, default=defaults.hivemind_target_batch_size)
    add("--min_step_s", type=float, default=defaults.min_step_s, help="an averaging peer's least step time")
    add("--data_dir", type=Path, default=DATA_DIR, help="the Fashion-MNIST IDX files (.gz)")
    add("--out", type=Path, default=None, help="peer configs and logs; default benchmarks/out/optimizer/<time>")
    for output in ("--json", "--markdown", "--plot"):
        add(output, type=Path, default=None)
    add("--headline_plot", type=Path, default=None, help="the README's plot: alone, swarm, ddp, hivemind_optimizer")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    missing = [name for name in IDX_FILES.values() if not (args.data_dir / name).exists()]
    if missing:
        print(f"error: {args.data_dir} lacks {missing} (apt-get install dataset-fashion-mnist)", file=sys.stderr)
        return 2
    given = {name: getattr(args, name) for name in Settings.__dataclass_fields__ if name != "data_dir" and name in args}
    if args.quick:
        args.experiments, args.seeds, args.modes = ["main"], 1, args.modes or ["alone", "swarm"]
        hivemind_target = min(args.hivemind_target_batch_size, 4 * 3 * args.batch)
        given.update(samples=24_000, curve_points=4, min_step_s=0.1, hivemind_target_batch_size=hivemind_target)
    settings = Settings(**given, data_dir=str(args.data_dir))
    args.modes = args.modes or list(MODES)
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
