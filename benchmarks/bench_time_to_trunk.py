#!/usr/bin/env python3
"""How much sooner do 3 boxes on a given link reach one box's final accuracy, in wall-clock time? One box alone, the
swarm (DecentralizedSGD), DDP over the same link and hivemind.Optimizer, each box in a network namespace of its
own behind a shaped link (``benchmarks/netns.py``).

    nice -n 10 .venv/bin/python -m benchmarks.bench_time_to_trunk --json benchmarks/results/time_to_trunk.json \\
        --markdown benchmarks/results/time_to_trunk.md --plot benchmarks/results/time_to_trunk.png

Why: per sample or per step DDP wins by construction; users ask for hours. The winner depends on (one exchange of the
model over the link) / (one training step), which the emulation keeps equal to ``swav_resnet50``'s on the stated GPU
(``--gpu_step_s``, by default an A100's SwAV step of batch 64) and ``--links``: bench_optimizer's task, each step paced
to ``--pace_s``, link rates and configured seconds scaled to match (``Emulation``); latency and per-round fixed costs
are not emulated. The arm ideal (``ideal_swarm`` on a free link) is the bound no real swarm beats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import netns
from benchmarks.bench_optimizer import leftovers, peer_env, tail_of, wait_for_all
from benchmarks.common import REPO, git_state, kill_session, machine, parse_with_quick, write_json
from benchmarks.optimizer_plan import DATA_DIR, SETUP_TIMEOUT_S, SHUTDOWN_GRACE_S, RunSpec, Settings, make_model
from benchmarks.time_to_trunk_report import merge, write_outputs
from vissl_swarm import preflight

ARMS = ("alone", "swarm", "ideal", "ddp", "hivemind_optimizer")  # in the order they run: the longest last
RESNET50_VALUES = 28_411_968  # fallback: benchmarks/results/traffic.json's swav_resnet50 row
HIVEMIND_MATCHMAKING_S, HIVEMIND_TIMEOUT_S = 15.0, 60.0  # hivemind.Optimizer's defaults


@dataclass(frozen=True)
class Emulation:
    """One link of the real boxes and its stand-in here."""

    link_mbit: float  # the real boxes' link, each way
    gpu_step_s: float  # a real box's step
    pace_s: float  # an emulated box's step
    values_real: int  # swav_resnet50's averaged values
    values_emulated: int  # the CNN's

    @property
    def time_scale(self) -> float:
        """Emulated seconds per GPU second."""
        return self.pace_s / self.gpu_step_s

    @property
    def emulated_mbit(self) -> float:
        return self.link_mbit * self.values_emulated / self.values_real / self.time_scale

    def exchange_s(self, group: int, bytes_per_value: float = 2.0, emulated: bool = True) -> float:
        """Seconds of one AllReduce among ``group`` boxes (fp16 by default), in full frames as real links pay."""
        values, mbit = (self.values_emulated, self.emulated_mbit) if emulated else (self.values_real, self.link_mbit)
        return preflight.allreduce_bytes(values, bytes_per_value, group) * netns.FRAME / 1448 * 8 / (mbit * 1e6)

    @property
    def aimed_ratio(self) -> float:
        """Exchange among the 3 boxes (fp16) over one step: the same for the real boxes and the emulation."""
        return self.exchange_s(3, emulated=False) / self.gpu_step_s

    def swarm_flags(self) -> tuple[dict, list[dict]]:
        """DecentralizedSGD's settings (seconds scaled) from the pre-flight's advice for ResNet-50, and the advice."""
        exchange = self.exchange_s(3, emulated=False)
        measured = preflight.Measured(
            boxes=3,
            rounds_applied=1,
            rounds_failed=0,
            rounds_no_group=0,
            group_sizes=(3,),
            allreduce_s=exchange,
            allreduce_max_s=exchange,
            bytes_per_round=preflight.allreduce_bytes(self.values_real, 2.0, 3),
            link_mbit=self.link_mbit,
            matchmaking_s=None,
            staleness_steps=None,
            staleness_max_steps=None,
            steps=1000,
            seconds=1000 * self.gpu_step_s,
            values=self.values_real,
            compression="fp16",
        )
        advice = preflight.advise(measured, preflight.Settings(), link_mbit=self.link_mbit)
        given = {item.flag: item.value for item in advice}
        flags = {
            "target_group_size": int(given["--target_group_size"]),
            "min_matchmaking_time": float(given["--min_matchmaking_time"]) * self.time_scale,
            "allreduce_timeout": float(given["--averaging_timeout"]) * self.time_scale,
            "compression": given["--compression"],
        }
        return flags, [asdict(item) for item in advice]


def resnet50_values() -> int:
    path = REPO / "benchmarks" / "results" / "traffic.json"
    with contextlib.suppress(OSError, KeyError, ValueError):
        rows = json.loads(path.read_text())["rows"]
        return next(int(row["values"]) for row in rows if row["config"] == "swav_resnet50")
    return RESNET50_VALUES


@dataclass
class Job:
    """One run: an arm of a seed on one link, how it is shaped and paced, and its budget."""

    arm: str
    spec: RunSpec
    settings: Settings
    mbit: float | None  # the emulated rate; None: unshaped
    paced: bool
    extra: dict  # for the peers: swarm_flags, ddp_fp16
    until_first: bool = False  # ends when one box is done, the others' steps read then (hivemind.Optimizer's timing)


def run_job(job: Job, out: Path, index: int) -> dict:
    """Start the job's boxes, each in its own namespace behind its link; wait for their results; kill them all."""
    run_dir = out / f"{index:03d}_{job.arm}_s{job.spec.seed}"
    run_dir.mkdir(parents=True)
    count = job.spec.processes(job.settings)
    steps = job.spec.steps(job.settings)
    slowest = job.settings.min_step_s * (200 if (job.arm == "ddp" or job.until_first) and job.mbit else 4)
    deadline = time.time() + SETUP_TIMEOUT_S + steps * slowest + 300
    record: dict[str, Any] = {"arm": job.arm, "seed": job.spec.seed, "emulated_mbit": job.mbit, "paced": job.paced}
    record.update(spec=asdict(job.spec), settings=asdict(job.settings), error=None, loadavg_before=os.getloadavg())
    processes: list[subprocess.Popen] = []
    logs = []
    started = time.time()
    try:
        for rank in range(count):
            config = {
                "settings": asdict(job.settings),
                "spec": asdict(job.spec),
                "rank": rank,
                "run_dir": str(run_dir),
                "deadline": deadline,
                "orchestrator_pid": os.getpid(),
                "ddp_port": 29500 if job.spec.mode == "ddp" else 0,
                "trunk": {**job.extra, "paced": job.paced},
            }
            (run_dir / f"peer{rank}.json").write_text(json.dumps(config))
            logs.append(open(run_dir / f"peer{rank}.log", "w"))  # noqa: SIM115 (closed in finally)
            env = {**peer_env(), "GLOO_SOCKET_IFNAME": f"p{rank}"}
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.trunk_peer", str(run_dir / f"peer{rank}.json")],
                    cwd=REPO,
                    env=env,
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        for rank, process in enumerate(processes):  # all started first: each takes its imports' time to get here
            netns.wait_for_own_namespace(process.pid, SETUP_TIMEOUT_S)
            netns.plug_in(process.pid, rank, job.mbit, small_packets=job.mbit is not None and job.mbit < 10)
        ready = [run_dir / f"ready{rank}.json" for rank in range(count)]
        wait_for_all(processes, ready, started + SETUP_TIMEOUT_S, "ready")
        start_at = time.time() + 0.5
        write_json(run_dir / "go.json", {"start_at": start_at})
        if job.until_first:  # its boxes drift apart, and one that is done changes the others' rounds
            wait_for_first(processes, [run_dir / f"result{r}.json" for r in range(count)], deadline)
            reached = how_far(run_dir, count)
            if not reached["finished"]:
                raise RuntimeError("the first box's result or timing could not be read")
            record.update(peers=reached["finished"], steps_reached=reached["steps_reached"], clean_exit=None)
        else:
            results = wait_for_all(processes, [run_dir / f"result{r}.json" for r in range(count)], deadline, "result")
            exit_by = time.time() + SHUTDOWN_GRACE_S
            for process in processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=max(0.1, exit_by - time.time()))
            if job.arm == "ideal":
                results = results[0]["replicas"]
            else:
                for rank, result in enumerate(results):
                    timing = json.loads((run_dir / f"timing{rank}.json").read_text())
                    result["curve"] = timed_curve(result["curve"], timing["evaluations"], start_at)
            record["peers"] = [{k: v for k, v in peer.items() if k != "counters"} for peer in results]
            record["clean_exit"] = all(process.returncode == 0 for process in processes)
    except Exception as error:
        record["error"] = f"{type(error).__name__}: {error}"
        record["logs"] = [str(run_dir / f"peer{rank}.log") for rank in range(count)]
        record["unfinished"] = how_far(run_dir, count)
    finally:
        for process in processes:
            kill_session(process)
        for log in logs:
            log.close()
        for rank in range(count):
            netns.unplug(rank)
    record["leftover_processes"] = leftovers([process.pid for process in processes])
    record["wall_s"] = time.time() - started
    return record


def wait_for_first(processes: list[subprocess.Popen], files: list[Path], deadline: float) -> None:
    while not any(path.exists() for path in files):
        for rank, process in enumerate(processes):
            if process.poll() is not None:
                tail = tail_of(files[rank].parent / f"peer{rank}.log")
                raise RuntimeError(f"peer {rank} exited ({process.returncode}) before any result:\n{tail}")
        if time.time() > deadline:
            raise TimeoutError("no box wrote its result before the deadline")
        time.sleep(0.2)


def how_far(run_dir: Path, count: int) -> dict:
    """A run that missed its deadline: the finished boxes' results (curves timed) and each box's last reported step."""
    finished, reached = [], {}
    go = run_dir / "go.json"
    for rank in range(count):
        with contextlib.suppress(OSError, ValueError):
            reached[rank] = json.loads((run_dir / f"progress{rank}.json").read_text())["step"]
        with contextlib.suppress(OSError, ValueError):
            result = json.loads((run_dir / f"result{rank}.json").read_text())
            timing = json.loads((run_dir / f"timing{rank}.json").read_text())
            start_at = json.loads(go.read_text())["start_at"]
            finished.append({**result, "curve": timed_curve(result["curve"], timing["evaluations"], start_at)})
    return {"finished": finished, "steps_reached": reached}


def timed_curve(curve: list[dict], evaluations: list[list[float]], start_at: float) -> list[dict]:
    """Each curve point with its training seconds: when its evaluation began, less the evaluations before it."""
    timed, spent = [], 0.0
    for point, (begin, end) in zip(curve, evaluations, strict=True):
        timed.append({**point, "train_s": max(0.0, begin - start_at - spent)})
        spent += end - begin
    return timed


def jobs_for(
    arm: str, seed: int, emulation: Emulation, args: argparse.Namespace, period: int, budget: float = 1.0
) -> list[Job]:
    """An arm's runs for a seed (composed: shaped timing, unshaped curve); ``budget``: samples in one box's budgets."""
    scale = emulation.time_scale
    settings = Settings(
        samples=round(args.samples * budget),
        curve_points=args.curve_points,
        min_step_s=args.pace_s,
        hivemind_averaging_timeout=HIVEMIND_TIMEOUT_S * scale,
        data_dir=str(args.data_dir),
    )
    flags, _ = emulation.swarm_flags()
    extra = {"swarm_flags": flags, "ddp_fp16": args.ddp_fp16}
    shaped = emulation.emulated_mbit
    if arm == "ideal":
        return [Job(arm, RunSpec("ideal", seed, swarm_lr=args.swarm_lr, period=period), settings, None, False, extra)]
    spec = RunSpec(arm, seed) if arm == "ddp" else RunSpec(arm, seed, swarm_lr=args.swarm_lr)
    if arm == "hivemind_optimizer":
        spec = replace(spec, min_matchmaking_time=HIVEMIND_MATCHMAKING_S * scale)
    if budget != 1.0:
        return [Job(f"{arm} x{budget:g}", spec, settings, shaped, True, extra)]
    steps = {"alone": args.alone_steps, "ddp": args.ddp_steps, "hivemind_optimizer": args.hivemind_steps}.get(arm)
    if steps:  # time from a few paced steps on the link, the curve unpaced on no link (loopback's matchmaking)
        timing = Settings(**{**asdict(settings), "samples": steps * spec.total_batch(settings), "curve_points": 1})
        unshaped = replace(spec, min_matchmaking_time=RunSpec.min_matchmaking_time)
        return [
            Job(arm, spec, timing, shaped, True, extra, until_first=arm == "hivemind_optimizer"),
            Job(f"{arm}_curve", unshaped, settings, None, False, extra),
        ]
    return [Job(arm, spec, settings, shaped, True, extra)]


def swarm_period(runs: list[dict], seed: int, link: float) -> int:
    """The swarm's measured steps per round in this seed and link (the ideal's period), else the slowed regime's."""
    for run in runs:
        if run["arm"] == "swarm" and run["seed"] == seed and run["link_mbit"] == link and run["error"] is None:
            per_round = [peer["steps_per_round"] for peer in run["peers"] if peer.get("steps_per_round")]
            if per_round:
                return max(1, round(sum(per_round) / len(per_round)))
    return 179


def done(runs: list[dict], arm: str, seed: int, link: float) -> bool:
    return any(r["arm"] == arm and r["seed"] == seed and r["link_mbit"] == link and not r["error"] for r in runs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = parser.add_argument
    add("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    add("--links", nargs="+", type=float, default=[100.0, 1000.0], help="real links, Mbit/s")
    add("--gpu_step_s", type=float, default=0.0804, help="a real box's step (see the docstring)")
    add("--pace_s", type=float, default=0.08, help="an emulated box's step (a sleep floor)")
    add("--samples", type=int, default=120_000, help="S, one box's budget and the swarm's total")
    add("--seeds", type=int, default=5)
    add("--curve_points", type=int, default=8)
    add("--swarm_lr", choices=("box", "sqrt", "linear"), default="sqrt", help="bench_optimizer's")
    add("--longer", nargs="*", type=float, default=[], help="swarm arms also at these x samples")
    add("--append", type=Path, default=None, help="add the runs to this JSON (the same emulation)")
    add("--ddp_steps", type=int, default=12, help="ddp's steps on the shaped link (its step time)")
    add("--alone_steps", type=int, default=0, help="> 0: alone's step time from N paced steps, its curve unpaced")
    add("--hivemind_steps", type=int, default=0, help="> 0: hivemind.Optimizer's step time from N steps on the link")
    add("--ddp_fp16", action=argparse.BooleanOptionalAction, default=True)
    add("--data_dir", type=Path, default=DATA_DIR)
    add("--out", type=Path, default=None, help="logs; default benchmarks/out/time_to_trunk/<time>")
    for output in ("--json", "--markdown", "--plot"):
        add(output, type=Path, default=None)
    add("--report_only", type=Path, nargs="+", help="write the outputs of these JSONs; run nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parse_with_quick(
        parser, argv, arms=["alone", "swarm"], links=[100.0], samples=9_600, seeds=1, curve_points=4, alone_steps=40
    )
    if args.pace_s <= 0 or args.gpu_step_s <= 0 or min(args.links) <= 0 or args.samples < 3 * 32:
        parser.error("--pace_s, --gpu_step_s and --links must be positive, --samples at least 96")
    if args.report_only is not None:
        write_outputs(args, merge([json.loads(path.read_text()) for path in args.report_only]))
        return 0
    if not (args.data_dir / "train-images-idx3-ubyte.gz").exists():
        parser.error(f"{args.data_dir} lacks Fashion-MNIST (apt-get install dataset-fashion-mnist)")
    if not netns.inside():  # git may not read the repository inside the user namespace: record its state now
        os.environ["BENCH_GIT"] = json.dumps(git_state())
        os.environ["BENCH_MACHINE_BEFORE"] = json.dumps(machine())
        netns.reexec_inside(["-m", "benchmarks.bench_time_to_trunk", *argv])
    netns.create_bridge()
    values = sum(parameter.numel() for parameter in make_model(0).parameters())
    emulations = [Emulation(link, args.gpu_step_s, args.pace_s, resnet50_values(), values) for link in args.links]
    out = args.out or REPO / "benchmarks/out/time_to_trunk" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "git": json.loads(os.environ.get("BENCH_GIT", "{}")),
        "command": ["python -m benchmarks.bench_time_to_trunk", *argv],
        "machine_before": json.loads(os.environ.get("BENCH_MACHINE_BEFORE", "{}")),
        "quick": args.quick,
        "arms": args.arms,
        "samples": args.samples,
        "seeds": args.seeds,
        "ddp_fp16": args.ddp_fp16,
        "emulations": [
            {
                **asdict(e),
                **{name: getattr(e, name) for name in ("time_scale", "emulated_mbit", "aimed_ratio")},
                **dict(zip(("swarm_flags", "advice"), e.swarm_flags(), strict=True)),
                "ddp_fp16": args.ddp_fp16,
            }
            for e in emulations
        ],
        "runs": [],
    }
    if args.append is not None:
        previous = json.loads(args.append.read_text())
        if previous["emulations"] != result["emulations"] or previous["samples"] != args.samples:
            parser.error(f"--append {args.append}: measured with another emulation or budget")
        result["runs"] = previous["runs"]
        result["commands"] = [*previous.get("commands", [previous["command"]]), result["command"]]
        result["machine_before"] = previous["machine_before"]
        result["git"] = previous["git"] | {"appended_at": result["git"]}
    print(f"bench_time_to_trunk: links {args.links} Mbit/s, arms {args.arms}, {args.seeds} seeds; logs in {out}")
    index = 0
    for emulation in emulations:
        for seed in range(args.seeds):
            plan = [(arm, 1.0) for arm in args.arms]
            plan += [(arm, b) for b in args.longer for arm in args.arms if arm in ("swarm", "hivemind_optimizer")]
            for arm, budget in plan:
                period = swarm_period(result["runs"], seed, emulation.link_mbit)
                for job in jobs_for(arm, seed, emulation, args, period, budget):
                    if done(result["runs"], job.arm, seed, emulation.link_mbit):  # --append: kept from before
                        continue
                    run = run_job(job, out, index)
                    run["link_mbit"] = emulation.link_mbit
                    result["runs"].append(run)
                    index += 1
                    status = f"{run['error'] or 'ok'} ({run['wall_s']:.0f} s, load {os.getloadavg()[0]:.1f})"
                    print(f"[{index}] {emulation.link_mbit:g} Mbit/s {job.arm} seed {seed}: {status}", flush=True)
                    result["machine_after"] = machine()
                    write_outputs(args, result)
    return 1 if any(run["error"] for run in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
