#!/usr/bin/env python
"""`make gpu-check`: what averaging costs a training step on a GPU, measured with the real trainer.

For ``swav_resnet50`` and ``swav_vit_small`` (AMP, batch 64, the config's multi-crop: 2x224 + 6x96 crops of
VISSL's synthetic images, made by the data loader workers, so no dataset is needed), on one GPU:

- the step time with no averaging (``run_trainer.py --isolated``), and with averaging against a second peer: a
  simulated peer on the CPU (a plain ``DecentralizedSGD`` that holds the trainer's tensors and only averages,
  so rounds run back to back: the most averaging a swarm can ask of the trainer);
- ``trainer_s`` per step (DecentralizedSGD's own count of the time averaging takes on the training thread), the
  fill and apply times per round, the data loader wait per step and the peak GPU memory.

With 2 or more GPUs it also runs a box of 2 local processes over NCCL plus the simulated peer, and checks from
the logged checksums that both local ranks hold the same parameters, buffers and momentum after rounds.
Without CUDA it prints one line and exits 0. Each run is a fresh set of processes, one run after another: the
trainer is ``scripts/measured_trainer.py`` (``run_trainer.py`` with one more VISSL hook, which times a window
of steps), the second peer ``scripts/simulated_peer.py``.

Usage:
    python -m scripts.gpu_check [--out benchmarks/results] [--configs C ...] [--window_steps N]
    python -m scripts.gpu_check --cpu_smoke --out DIR     # the same code path on a CPU, with swav_tiny
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import REPO
from vissl_swarm.local_swarm import LOOPBACK, LocalPeer, read_jsonl, stop_all, wait_until

CONFIGS = ("swav_resnet50", "swav_vit_small")
RUN_ID = "gpucheck"
SWARM_FLAGS = [
    "--run_id",
    RUN_ID,
    "--target_group_size",
    "2",
    "--min_matchmaking_time",
    "2",
    "--averaging_timeout",
    "60",
    "--next_chunk_timeout",
    "10",
]
RESNET_COST_TARGET = 0.03  # averaging may cost a swav_resnet50 step at most 3 %
FILL_APPLY_TARGET_MS = 30.0  # fill + apply per round, ResNet-50, one modern GPU
DEFINITIONS = {
    "step_s": "wall time per training step over the measured window (CUDA synchronised at both ends)",
    "cost_vs_none": "step_s with averaging / step_s without - 1",
    "trainer_ms_per_step": "DecentralizedSGD counters['trainer_s'] over the window / steps: averaging work on the "
    "training thread (apply included)",
    "fill_ms": "DecentralizedSGD counters fill_s / fills over the window: the fill and trigger of a round in the "
    "scheduler thread (copy the parameters, buffers and averaged optimizer state into the round's "
    "staging, from a GPU non-blocking on a side stream with one wait; finite check; into the averager)",
    "fill_locked_ms": "counters fill_locked_s / fills: how long a fill held the trainer's lock (a trainer can wait "
    "for this at its optimizer step, not for the rest of the fill)",
    "apply_ms": "counters apply_s / applies over the window: the training thread's time to apply a finished round "
    "(on a GPU: queueing one host-to-device copy and one _foreach_add_, not waiting for them)",
    "fill_ms_max, apply_ms_max": "largest fill_ms / apply_ms in the records of the rounds resolved in the window",
    "data_wait_ms_per_step": "VISSL's read_sample timer per step: time the trainer waited for the data loader",
    "peak_gpu_mem_gib": "torch.cuda.max_memory_allocated() at the end of the window",
    "rounds_applied": "rounds applied inside the window",
}


# --- the check: one run after another ----------------------------------------------------------------------------
@dataclass
class RunPlan:
    config: str
    averaging: bool
    overrides: list[str]
    warmup_steps: int
    window_steps: int
    min_rounds: int = 1
    box: bool = False
    flags: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.config}_{'box' if self.box else 'averaged' if self.averaging else 'none'}"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))


def _start(peer: LocalPeer, module: str, arguments: list[str], env: dict[str, str] | None = None) -> None:
    """Start ``python -m scripts.<module> ...`` as ``peer``'s process (LocalPeer stops it, reads its log)."""
    peer.out_dir.mkdir(parents=True, exist_ok=True)
    with open(peer.log_path, "w") as log:
        peer.process = subprocess.Popen(
            [sys.executable, "-m", f"scripts.{module}", *arguments],
            cwd=REPO,
            env=env or _env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    peer.started_at = time.time()


def measure(plan: RunPlan, work_dir: Path, timeout: float) -> dict:
    """One trainer run (and the simulated peer when averaging); its measured window, or the error."""
    trainer = LocalPeer(plan.name, work_dir, config=plan.config)
    simulated = LocalPeer(f"{plan.name}_simulated_peer", work_dir)
    result_path, schema_path = work_dir / f"{plan.name}.result.json", work_dir / f"{plan.name}.schema.json"
    trainer_args = [
        "--config",
        plan.config,
        "--checkpoint_dir",
        str(trainer.checkpoint_dir),
        "--host_maddrs",
        LOOPBACK,
        *(plan.flags if plan.averaging else ["--isolated"]),
        *plan.overrides,
    ]
    min_rounds = plan.min_rounds if plan.averaging else 0
    outcome: dict[str, Any] = {
        "config": plan.config,
        "mode": "averaged" if plan.averaging else "none",
        "log": str(trainer.log_path),
    }
    if plan.averaging:
        outcome["simulated_peer_log"] = str(simulated.log_path)
    deadline = time.monotonic() + timeout
    try:
        _start(
            trainer,
            "measured_trainer",
            [
                "--result",
                str(result_path),
                "--schema",
                str(schema_path),
                "--warmup_steps",
                str(plan.warmup_steps),
                "--window_steps",
                str(plan.window_steps),
                "--min_rounds",
                str(min_rounds),
                "--",
                *trainer_args,
            ],
        )
        if plan.averaging:
            addresses = trainer.join_addresses(timeout=deadline - time.monotonic())
            wait_until(
                lambda: schema_path.exists() or not trainer.is_running(),
                deadline - time.monotonic(),
                f"{plan.name}: the trainer's start",
            )
            if schema_path.exists():
                _start(
                    simulated,
                    "simulated_peer",
                    ["--schema", str(schema_path), "--initial_peers", *addresses],
                    env={**_env(), "CUDA_VISIBLE_DEVICES": ""},
                )

        def peer_died() -> bool:
            return simulated.process is not None and not simulated.is_running()

        wait_until(
            lambda: result_path.exists() or not trainer.is_running() or peer_died(),
            deadline - time.monotonic(),
            f"{plan.name}: the measured window",
        )
        if peer_died() and not result_path.exists():
            raise RuntimeError(f"the simulated peer exited with code {simulated.process.returncode}; see its log")
        if not result_path.exists():
            raise RuntimeError(f"the trainer exited with code {trainer.process.returncode}; see its log")
        outcome.update(json.loads(result_path.read_text()))
    except (TimeoutError, RuntimeError) as error:
        outcome["error"] = str(error)
    finally:
        stop_all([trainer, simulated])
    if plan.box:
        from vissl_swarm.local_replicas import compare_replica_logs

        rank1_log = trainer.checkpoint_dir / "progress_rank1.jsonl"
        outcome["replicas"] = compare_replica_logs(trainer.progress(), read_jsonl(rank1_log))
    return outcome


def plans(args: argparse.Namespace) -> list[RunPlan]:
    """none and averaged for each config; the box run with 2 or more GPUs."""
    workers = 0 if args.cpu_smoke else max(2, min(12, (os.cpu_count() or 4) - 4))
    common = [
        "config.DATA.TRAIN.DATA_SOURCES=[synthetic]",
        "config.OPTIMIZER.num_epochs=1",
        "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=1000000",
        "config.SEED_VALUE=0",
        "config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD=False",
        f"config.DATA.NUM_DATALOADER_WORKERS={workers}",
    ]
    flags = [*SWARM_FLAGS, "--load_state_timeout", "0"]
    result = [
        RunPlan(config, averaging, common, args.warmup_steps, args.window_steps, flags=flags)
        for config in args.configs
        for averaging in (False, True)
    ]
    if box_gpus_missing(args) is None:
        box = [*common, "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.LOG_FREQUENCY=1"]
        result.append(
            RunPlan(
                args.configs[0],
                True,
                box,
                args.warmup_steps,
                20,
                min_rounds=3,
                box=True,
                flags=[*flags, "--average_optimizer_state"],
            )
        )
    return result


def box_gpus_missing(args: argparse.Namespace) -> str | None:
    """Why the 2-GPU box part cannot run here, or None."""
    if args.cpu_smoke:  # the box runs over gloo on the CPU
        return None
    if torch.cuda.device_count() < 2:
        return f"needs 2 GPUs, this machine has {torch.cuda.device_count()}: NCCL refuses two ranks on one GPU"
    return None


def machine() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def summarize(runs: list[dict]) -> dict:
    """Adds each averaged run's cost over its config's run without averaging; the issue's targets for ResNet-50."""
    by_key = {(run["config"], run["mode"]): run for run in runs}
    for run in runs:
        base = by_key.get((run["config"], "none"), {})
        if run["mode"] == "averaged" and "step_s" in run and "step_s" in base:
            run["cost_vs_none"] = run["step_s"] / base["step_s"] - 1
    resnet = by_key.get(("swav_resnet50", "averaged"), {})
    targets = {}
    if "cost_vs_none" in resnet:
        targets["resnet50_cost_at_most_3_percent"] = resnet["cost_vs_none"] <= RESNET_COST_TARGET
    if resnet.get("fill_ms") is not None and resnet.get("apply_ms") is not None:
        targets["resnet50_fill_plus_apply_under_30_ms"] = resnet["fill_ms"] + resnet["apply_ms"] < FILL_APPLY_TARGET_MS
    return targets


def _cell(value: Any, digits: int = 3, percent: bool = False) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if percent:
        return f"{100 * value:+.1f} %"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _fill_cell(run: dict) -> str:
    fill, locked = run.get("fill_ms"), run.get("fill_locked_ms")
    return _cell(fill, 1) if fill is None or locked is None else f"{fill:.1f} ({locked:.1f})"


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"GPU check on {m['gpu']} ({m['gpus']} GPU(s)), torch {m['torch']}, CUDA {m['cuda']}, {m['cpus']} CPUs"
        + (" (--cpu_smoke: a CPU run of the check's code path, not a measurement)" if report["cpu_smoke"] else ""),
        "",
        "| config | averaging | step s | samples/s | cost vs none | trainer ms/step | rounds | "
        "fill ms (lock held) | apply ms | data wait ms/step | peak GPU mem GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        mode = "with a second peer" if run["mode"] == "averaged" else "none"
        if "error" in run:
            lines.append(f"| {run['config']} | {mode} | failed: {run['error']} ({run.get('log', '')}) |")
            continue
        lines.append(
            " | ".join(
                [
                    f"| {run['config']}",
                    mode,
                    _cell(run["step_s"]),
                    _cell(run["samples_per_s"], 1),
                    _cell(run.get("cost_vs_none"), percent=True),
                    _cell(run.get("trainer_ms_per_step"), 2),
                    _cell(run.get("rounds_applied")),
                    _fill_cell(run),
                    _cell(run.get("apply_ms"), 1),
                    _cell(run["data_wait_ms_per_step"], 1),
                    _cell(run["peak_gpu_mem_gib"], 2),
                ]
            )
            + " |"
        )
    lines += ["", *(f"- {name}: {_cell(met)}" for name, met in report["targets"].items()), ""]
    backend = "gloo (--cpu_smoke)" if report["cpu_smoke"] else "NCCL"
    lines.append(f"2 local processes over {backend} plus one more peer: {_box_line(report['box'])}")
    return "\n".join(lines) + "\n"


def _box_line(box: dict) -> str:
    if not box["ran"]:
        return f"did not run ({box['reason']})"
    replicas = box["replicas"]
    mismatches = {key: steps for key, steps in replicas.items() if key.endswith("mismatch_steps") and steps}
    line = (
        f"checksums of parameters and momentum compared at {replicas['steps_compared']} steps, of buffers at "
        f"{replicas['round_steps_compared']} steps with a round: "
        f"{f'DIFFERENT {mismatches}' if mismatches else 'identical'}"
    )
    if "error" in box:
        return f"failed: {box['error']} ({box['log']}); until then {line}"
    return f"{box['rounds_applied']} rounds applied in the window; {line}"


def run_check(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(
            f"gpu-check: no CUDA GPU visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}), "
            "so nothing was measured"
        )
        return 0
    if args.cpu_smoke:
        args.configs = ["swav_tiny"]
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_check_"))
    print(f"gpu-check: logs in {work_dir}", flush=True)
    started, runs, box = time.monotonic(), [], {"ran": False, "reason": box_gpus_missing(args)}
    for plan in plans(args):
        left = args.budget_s - (time.monotonic() - started)
        if left < 60:
            outcome = {
                "config": plan.config,
                "mode": "averaged" if plan.averaging else "none",
                "error": f"skipped: the check's budget of {args.budget_s:.0f} s is spent",
            }
        else:
            print(f"gpu-check: {plan.name} ...", flush=True)
            outcome = measure(plan, work_dir, timeout=min(args.run_timeout_s, left))
        if plan.box:
            box = {"ran": True, **outcome}
        else:
            runs.append(outcome)
    report = {
        "machine": machine(),
        "cpu_smoke": args.cpu_smoke,
        "runs": runs,
        "box": box,
        "targets": summarize(runs),
        "definitions": DEFINITIONS,
        "seconds": round(time.monotonic() - started),
        "settings": {"warmup_steps": args.warmup_steps, "window_steps": args.window_steps, "swarm_flags": SWARM_FLAGS},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "gpu_check.md").write_text(table)
    print(table, flush=True)
    print(
        f"gpu-check: wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'} in {report['seconds']} s",
        flush=True,
    )
    return 0 if all("error" not in run for run in runs) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results", help="folder for gpu_check.json and gpu_check.md"
    )
    parser.add_argument("--work_dir", type=Path, default=None, help="logs and checkpoints (default: a temp folder)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--warmup_steps", type=int, default=20)
    parser.add_argument("--window_steps", type=int, default=100)
    parser.add_argument("--run_timeout_s", type=float, default=150.0, help="the most one run may take")
    parser.add_argument("--budget_s", type=float, default=420.0, help="no run starts after this; keeps it < 8 min")
    parser.add_argument("--cpu_smoke", action="store_true", help="run the check's code path on a CPU (swav_tiny)")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_check(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
