#!/usr/bin/env python3
"""Does it learn? The swarm against peers training alone and against a synchronous cluster, same samples per peer.

    python benchmarks/bench_learning.py --json benchmarks/results/learning.json \
        --markdown benchmarks/results/learning.md --plot benchmarks/results/learning.png

Modes (``swav_tiny`` on the exported digits, 3 peers at batch 16 each):
  random_init  the run's initial model, untrained, with its BatchNorm statistics recomputed on the training split:
               the floor. Any training adapts those statistics (an untrained trunk's are mean 0 / variance 1),
               which alone lifts the kNN accuracy; a mode learned only if it beats this. The row
               ``random_init_stock_bn`` is the same model with its initial statistics, the step-0 point of the curves
  isolated     3 peers, each training alone with VISSL's stock task (no averaging)
  old          3 peers averaging with hivemind's TrainingAverager driven one round at a time (``--averager old``)
  improved     3 peers averaging with this example's DecentralizedSGD
  ddp          VISSL's stock task with 3 local processes over gloo (batch 16 each): the synchronous reference at
               the same total batch

A seed is a run: its peers share the run id ``learn<seed>`` in every mode, and so the initial model (the swarm
peers build it from the run id; isolated and ddp load the same weights, see write_initial_model), while the data
order is the peer's: peer i of seed s has SEED_VALUE 1000·s + i. Every mode trains the same number of steps per
peer (ddp: per process) with the same LR schedule; the step count is rounded up to whole epochs and the steps
actually taken are reported. The initial model and checkpoints along the run (CHECKPOINT_ITER_FREQUENCY) are
evaluated with run_eval.py's kNN top-1 on the held-out split, for the curve against samples seen. Reported per
mode: kNN top-1 of the final trunks (mean over a run's peers; mean ± std over seeds), the mean pairwise L2
distance between a run's final trunks, steps and applied averaging rounds per peer, and the wall-clock of a run
(start to last exit). Each invocation trains in a fresh folder (an existing non-empty ``--out`` is refused), so no
peer resumes checkpoints of an earlier run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean, stdev

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from demo import markdown_table  # noqa: E402
from local_swarm import LocalPeer, start_swarm_together, stop_all  # noqa: E402
from run_eval import IMAGE_SUFFIXES, load_trunk_state  # noqa: E402

CONFIG = "swav_tiny"
MODES = ("random_init", "isolated", "old", "improved", "ddp")
# the rows of mode random_init: the floor and the untrained model as is, with their line styles in the plot
FLOOR_ROWS = {"random_init": "--", "random_init_stock_bn": ":"}
SWARM_MODES = {"old": ["--averager", "old"], "improved": ["--averager", "improved"]}
# Rough cost of one run on the 2-core machine when quiet (steps of 60-100 ms with 3 peers on the 2 cores, from
# VISSL's "Average train batch time"; a busy machine makes them 2-3x slower): start-up of the processes, seconds per
# step, one kNN evaluation. Only for the estimate printed at start and the per-run deadline (4x it + 10 min).
STARTUP_S = {"isolated": 10.0, "old": 15.0, "improved": 15.0, "ddp": 12.0}
SECONDS_PER_STEP = {"isolated": 0.08, "old": 0.13, "improved": 0.11, "ddp": 0.11}
EVAL_S = 0.5


class BenchError(Exception):
    """A run that cannot start or did not finish; the message says which and where its log is."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data_path", type=Path, default=REPO / "data/digits", help="exported digits (train/ val/)")
    parser.add_argument("--steps", type=int, default=870,
                        help="training steps per peer in every mode, the budget (rounded up to whole epochs; "
                             "870: 10 epochs of the digits)")
    parser.add_argument("--seeds", type=int, default=3, help="runs per mode: seeds 0 .. SEEDS-1")
    parser.add_argument("--peers", type=int, default=3, help="peers per run (ddp: local processes)")
    parser.add_argument("--curve_points", type=int, default=8, help="checkpoints evaluated along each run")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help=f"a Hydra override of {CONFIG} for every process and the initial model, e.g. "
                             "config.LOSS.swav_loss.epsilon=0.03 (repeat for more); to compare recipes")
    parser.add_argument("--out", type=Path, default=None,
                        help="checkpoints and logs, a new or empty folder; default: benchmarks/out/learning/<time>")
    parser.add_argument("--json", type=Path, default=None, help="write settings, runs and summary here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here")
    parser.add_argument("--plot", type=Path, default=None, help="write kNN accuracy against samples seen (PNG)")
    return parser


@dataclass(frozen=True)
class Schedule:
    """Steps per peer, identical in every mode. All modes train on the same DATA_LIMIT images: a single-process
    peer takes ``steps_per_epoch`` steps per epoch, each of ddp's ``peers`` processes 1/peers of that (VISSL's
    sampler gives every rank a fixed share), so ddp runs ``peers`` times the epochs for the same steps and the
    same LR schedule. DATA_LIMIT also matters for ddp's shares: VISSL samples the limited subset in random order,
    where the full folder is sorted by class and rank 0 would see the first classes only."""

    batch: int
    peers: int
    data_limit: int
    epochs: int
    steps_per_epoch: int
    checkpoint_every: int

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def epochs_of(self, mode: str) -> int:
        return self.epochs * self.peers if mode == "ddp" else self.epochs


def plan_schedule(steps: int, train_images: int, batch: int, peers: int, curve_points: int) -> Schedule:
    """The fewest whole epochs that give at least ``steps`` steps, each epoch as long as the dataset allows."""
    if steps < 1 or curve_points < 1 or peers < 2:
        raise BenchError(f"--steps and --curve_points must be at least 1 and --peers at least 2, got {steps}, "
                         f"{curve_points}, {peers}")
    most_per_rank = train_images // (batch * peers)
    if most_per_rank < 1:
        raise BenchError(f"{train_images} training images are fewer than {peers} processes x batch {batch}; "
                         "export more (scripts/export_digits.py) or pass fewer --peers")
    epochs = math.ceil(steps / (peers * most_per_rank))
    per_rank = math.ceil(steps / (peers * epochs))
    total = epochs * peers * per_rank
    return Schedule(batch=batch, peers=peers, data_limit=per_rank * batch * peers, epochs=epochs,
                    steps_per_epoch=peers * per_rank, checkpoint_every=max(1, math.ceil(total / curve_points)))


def count_train_images(data_path: Path) -> int:
    folder = data_path / "train"
    if not folder.is_dir() or not (data_path / "val").is_dir():
        raise BenchError(f"--data_path {data_path}: expected train/ and val/ ImageFolders "
                         f"(`python scripts/export_digits.py --out {data_path}` makes them)")
    return sum(1 for path in folder.glob("*/*") if path.suffix.lower() in IMAGE_SUFFIXES)


def batch_per_peer(overrides: list[str]) -> int:
    from config_loading import ConfigError, compose_config

    try:
        config, _ = compose_config(CONFIG, overrides, has_gpu=False)
    except ConfigError as error:
        raise BenchError(f"--override: {error}") from error
    return int(config.DATA.TRAIN.BATCHSIZE_PER_REPLICA)


def fresh_out_dir(out: Path | None) -> Path:
    """A folder no earlier run wrote into: peers would resume its checkpoints and report old trunks as new."""
    if out is None:
        out = REPO / "benchmarks/out/learning" / time.strftime("%Y%m%d-%H%M%S")
    if out.exists() and any(out.iterdir()):
        raise BenchError(f"--out {out} is not empty: its checkpoints would be resumed and evaluated as new. "
                         "Pass a new folder, or delete this one")
    out.mkdir(parents=True, exist_ok=True)
    return out


def estimated_seconds(mode: str, schedule: Schedule, curve_points: int) -> float:
    if mode == "random_init":
        return 3 * EVAL_S + 5.0
    trunks = 1 if mode == "ddp" else schedule.peers
    return STARTUP_S[mode] + schedule.steps * SECONDS_PER_STEP[mode] + trunks * curve_points * EVAL_S


# ---------------------------------------------------------------------------------------------- initial model


@dataclass(frozen=True)
class InitialModel:
    """What every process of one seed's runs starts from, in every mode, and its kNN accuracy as it is (the curves'
    step 0) and with BatchNorm statistics of the training split (the floor)."""

    path: Path
    trunk_fingerprint: str
    accuracy: float
    accuracy_adapted_bn: float


def run_id(seed: int) -> str:
    return f"learn{seed}"


def write_initial_model(seed: int, folder: Path, data_path: Path, overrides: list[str]) -> InitialModel:
    """The model the swarm peers of run ``learn<seed>`` build (decentralized_task.py seeds it from the run id),
    saved as VISSL weights. The stock-task modes (isolated, ddp) load it with MODEL.WEIGHTS_INIT, VISSL's own
    start-from-weights option: VISSL would otherwise initialise each of their processes from its SEED_VALUE."""
    import vissl_compat

    vissl_compat.apply()  # before VISSL is imported
    from vissl.models import build_model
    from vissl.utils.misc import set_torch_seed

    from config_loading import compose_config
    from initial_model import initial_model_seed, weights_fingerprint
    from run_eval import knn_accuracy

    config, _ = compose_config(CONFIG, overrides, has_gpu=False)
    init_seed = initial_model_seed(run_id(seed), CONFIG)
    config.MODEL._MODEL_INIT_SEED = init_seed  # as the task does: VISSL seeds the heads with it
    with set_torch_seed(init_seed):
        model = build_model(config.MODEL, config.OPTIMIZER)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run_id(seed)}.torch"
    torch.save({"classy_state_dict": {"base_model": model.get_classy_state()}}, path)
    return InitialModel(path, weights_fingerprint(model.trunk), knn_accuracy(path, data_path, CONFIG),
                        knn_accuracy(path, data_path, CONFIG, adapt_bn=True))


def started_from(mode: str, peers: list[LocalPeer], initial: InitialModel) -> bool:
    """Whether every process of the run logged that it started from the seed's initial model: a swarm peer logs
    its trunk's fingerprint, VISSL logs loading the weights file."""
    if mode in SWARM_MODES:
        return all(re.findall(r"trunk fingerprint (\w+)", peer.log_text()) == [initial.trunk_fingerprint]
                   for peer in peers)
    return all(f"Initializing model from: {initial.path}" in peer.log_text() for peer in peers)


# ---------------------------------------------------------------------------------------------------- training


def make_peers(mode: str, seed: int, out: Path, schedule: Schedule) -> list[LocalPeer]:
    run_dir = out / mode / f"seed{seed}"
    if mode == "ddp":  # gloo on the loopback only (it would pick the host name's interface otherwise)
        return [LocalPeer("ddp", run_dir, config=CONFIG, env={"GLOO_SOCKET_IFNAME": "lo"})]
    return [LocalPeer(f"peer{index}", run_dir, config=CONFIG) for index in range(schedule.peers)]


def trainer_arguments(mode: str, seed: int, schedule: Schedule, initial: InitialModel,
                      recipe: list[str]) -> tuple[list[str], list[str]]:
    """(flags, overrides) of every process of a run, ``recipe`` (--override) first; the peer's own SEED_VALUE is
    added per peer."""
    flags = ["--run_id", run_id(seed)]
    overrides = [*recipe, f"config.OPTIMIZER.num_epochs={schedule.epochs_of(mode)}",
                 f"config.DATA.TRAIN.DATA_LIMIT={schedule.data_limit}",
                 f"config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY={schedule.checkpoint_every}",
                 "config.CHECKPOINT.CHECKPOINT_FREQUENCY=1000000", "config.LOG_FREQUENCY=20"]
    if mode in SWARM_MODES:
        flags += ["--target_group_size", str(schedule.peers), "--min_matchmaking_time", "3",
                  "--averaging_timeout", "30", "--next_chunk_timeout", "5", "--load_state_timeout", "0",
                  *SWARM_MODES[mode]]
    else:  # VISSL's stock self_supervision_task, from the run's initial model
        flags.append("--isolated")
        overrides.append(f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={initial.path}")
    if mode == "ddp":
        overrides.append(f"config.DISTRIBUTED.NUM_PROC_PER_NODE={schedule.peers}")
    return flags, overrides


def peer_seed(seed: int, index: int) -> list[str]:
    return [f"config.SEED_VALUE={1000 * seed + index}"]


def train(mode: str, seed: int, peers: list[LocalPeer], args: argparse.Namespace, schedule: Schedule,
          initial: InitialModel) -> float:
    """Start the run's processes, wait until all exited, return the wall-clock seconds; BenchError if one failed."""
    flags, overrides = trainer_arguments(mode, seed, schedule, initial, args.override)
    deadline_s = 4 * estimated_seconds(mode, schedule, args.curve_points) + 600
    started = time.monotonic()
    try:
        if mode in SWARM_MODES:
            start_swarm_together(peers, args.data_path, flags, overrides,
                                 per_peer_overrides=lambda peer: peer_seed(seed, peers.index(peer)))
        else:
            for index, peer in enumerate(peers):
                peer.start(args.data_path, [], flags, overrides + peer_seed(seed, index))
        while any(peer.is_running() for peer in peers):
            check_exits(mode, seed, peers)  # one crashed: stop the others rather than wait for them
            if time.monotonic() - started > deadline_s:
                raise BenchError(f"{mode} seed {seed} did not finish within {deadline_s:.0f} s; logs: "
                                 f"{peers[0].out_dir}")
            time.sleep(1.0)
    except (RuntimeError, TimeoutError) as error:  # a peer that died or hung before its join line
        raise BenchError(f"{mode} seed {seed}: {error}{crash_report(peers)}") from error
    finally:
        stop_all(peers)
    check_exits(mode, seed, peers)
    return time.monotonic() - started


def crash_report(peers: list[LocalPeer]) -> str:
    """Every process that exited with an error, with the last error line of its log (the first to crash may not
    be the one that was waited for: a joiner fails when the first peer died)."""
    return "".join(f"\n  {peer.name} exited with code {peer.process.poll()} ({peer.log_path}): {last_error_line(peer)}"
                   for peer in peers if peer.process is not None and peer.process.poll() not in (None, 0))


def check_exits(mode: str, seed: int, peers: list[LocalPeer]) -> None:
    if report := crash_report(peers):
        raise BenchError(f"{mode} seed {seed}: a process failed{report}")


def last_error_line(peer: LocalPeer) -> str:
    lines = [line for line in peer.log_text().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["(empty log)"])[-1][:300]


# -------------------------------------------------------------------------------------------------- evaluation


def checkpoints_by_iteration(folder: Path) -> dict[int, Path]:
    """A peer's checkpoints every CHECKPOINT_ITER_FREQUENCY steps and its final one, keyed by iteration (not those
    at epoch ends: ddp's epochs are shorter, its curve would get more points)."""
    finals = list(folder.glob("model_final_checkpoint*.torch"))
    if not finals:
        raise BenchError(f"{folder} holds no final checkpoint (model_final_checkpoint_*.torch): training did not end")
    found = {}
    for path in [*folder.glob("model_iteration*.torch"), *finals]:  # the final one last: it wins a shared key
        found[int(torch.load(path, map_location="cpu", weights_only=True)["iteration"])] = path
    return found


def trunk_weights(checkpoint: Path) -> list[torch.Tensor]:
    return [tensor.double() for _, tensor in sorted(load_trunk_state(checkpoint).items()) if tensor.is_floating_point()]


def mean_pairwise_distance(checkpoints: list[Path]) -> float | None:
    weights = [trunk_weights(path) for path in checkpoints]
    distances = [math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True)))
                 for a, b in itertools.combinations(weights, 2)]
    return mean(distances) if distances else None


def evaluate_run(mode: str, seed: int, peers: list[LocalPeer], data_path: Path, wall_s: float,
                 initial: InitialModel) -> dict:
    """kNN of every peer's checkpoints along the run (from the initial model's, at step 0); the last one (the final
    checkpoint) is the run's result."""
    from run_eval import knn_accuracy

    per_peer = [checkpoints_by_iteration(peer.checkpoint_dir) for peer in peers]
    accuracies = [{iteration: knn_accuracy(path, data_path, CONFIG) for iteration, path in found.items()}
                  for found in per_peer]
    common = sorted(set.intersection(*(set(found) for found in per_peer)))
    finals = [found[max(found)] for found in per_peer]
    final_accuracies = [by_iteration[max(by_iteration)] for by_iteration in accuracies]
    return {
        "mode": mode, "seed": seed, "wall_s": round(wall_s, 1),
        "same_initial_model": started_from(mode, peers, initial),
        "accuracy": round(mean(final_accuracies), 4),
        "accuracy_per_peer": [round(accuracy, 4) for accuracy in final_accuracies],
        "peer_distance": _rounded(mean_pairwise_distance(finals)),
        "steps_per_peer": [max(found) for found in per_peer],
        "rounds_per_peer": [len(peer.applied_rounds()) for peer in peers],
        "curve": [[0, round(initial.accuracy, 4)]] + [
            [iteration, round(mean(by_iteration[iteration] for by_iteration in accuracies), 4)] for iteration in common
        ],
    }  # fmt: skip


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def floor_runs(seed: int, initial: InitialModel) -> list[dict]:
    """The run's initial model, untrained: with BatchNorm statistics of the training split (the floor) and as is."""
    return [{"mode": mode, "seed": seed, "wall_s": 0.0, "accuracy": round(accuracy, 4), "peer_distance": None,
             "steps_per_peer": [0], "rounds_per_peer": [0], "curve": []}
            for mode, accuracy in (("random_init", initial.accuracy_adapted_bn),
                                   ("random_init_stock_bn", initial.accuracy))]


def run_one(mode: str, seed: int, args: argparse.Namespace, schedule: Schedule, initial: InitialModel) -> list[dict]:
    if mode == "random_init":
        return floor_runs(seed, initial)
    peers = make_peers(mode, seed, args.out, schedule)
    wall_s = train(mode, seed, peers, args, schedule, initial)
    result = evaluate_run(mode, seed, peers, args.data_path, wall_s, initial)
    if not result["same_initial_model"]:
        print(f"warning: {mode} seed {seed}: not every process logged starting from {initial.path} (trunk "
              f"{initial.trunk_fingerprint}); the modes of this seed may not share their start. Logs: "
              f"{peers[0].out_dir}", file=sys.stderr, flush=True)
    return [result]


# ----------------------------------------------------------------------------------------------------- reports


def summarize(mode: str, runs: list[dict], batch: int) -> dict:
    """Mean ± std over the seeds that finished (std needs two)."""
    done = [run for run in runs if "error" not in run]
    if not done:
        return {"mode": mode, "seeds": 0, "failed": len(runs)}

    def spread(values: list[float]) -> tuple[float, float | None]:
        return mean(values), (stdev(values) if len(values) > 1 else None)

    accuracy, accuracy_std = spread([run["accuracy"] for run in done])
    distances = [run["peer_distance"] for run in done if run["peer_distance"] is not None]
    curves = [dict(run["curve"]) for run in done]
    common = sorted(set.intersection(*(set(curve) for curve in curves)))
    return {
        "mode": mode, "seeds": len(done), "failed": len(runs) - len(done),
        "accuracy_mean": round(accuracy, 4), "accuracy_std": _rounded(accuracy_std),
        "peer_distance_mean": _rounded(mean(distances)) if distances else None,
        "steps_per_peer_mean": round(mean(s for run in done for s in run["steps_per_peer"]), 1),
        "rounds_per_peer_mean": round(mean(r for run in done for r in run["rounds_per_peer"]), 1),
        "wall_s_mean": round(mean(run["wall_s"] for run in done), 1),
        "curve": [[iteration * batch, *map(_rounded, spread([curve[iteration] for curve in curves]))]
                  for iteration in common],
    }  # fmt: skip


def markdown(summaries: list[dict], batch: int) -> str:
    def cell(value: float | None, digits: int) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    rows = []
    for summary in summaries:
        if not summary["seeds"]:
            rows.append({"mode": summary["mode"], "kNN top-1 (mean ± std)": f"failed ({summary['failed']} runs)",
                         "seeds": 0, "peer distance": "—", "steps per peer": "—", "samples per peer": "—",
                         "rounds per peer": "—", "wall-clock per run (s)": "—"})
            continue
        failed = f" ({summary['failed']} failed)" if summary["failed"] else ""
        steps = summary["steps_per_peer_mean"]
        rows.append({
            "mode": summary["mode"],
            "kNN top-1 (mean ± std)": f"{summary['accuracy_mean']:.4f} ± {cell(summary['accuracy_std'], 4)}",
            "seeds": f"{summary['seeds']}{failed}",
            "peer distance": cell(summary["peer_distance_mean"], 3),
            "steps per peer": f"{steps:g}", "samples per peer": f"{steps * batch:g}",
            "rounds per peer": f"{summary['rounds_per_peer_mean']:g}",
            "wall-clock per run (s)": "—" if summary["mode"] in FLOOR_ROWS else f"{summary['wall_s_mean']:.0f}",
        })  # fmt: skip
    return markdown_table(rows)


def plot(summaries: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for summary in summaries:
        if not summary["seeds"]:
            continue
        if summary["mode"] in FLOOR_ROWS:
            axis.axhline(summary["accuracy_mean"], color="gray", linestyle=FLOOR_ROWS[summary["mode"]],
                         label=summary["mode"])
            continue
        samples = [point[0] for point in summary["curve"]]
        means = [point[1] for point in summary["curve"]]
        stds = [point[2] or 0.0 for point in summary["curve"]]
        (line,) = axis.plot(samples, means, marker="o", label=summary["mode"])
        axis.fill_between(samples, [m - s for m, s in zip(means, stds, strict=True)],
                          [m + s for m, s in zip(means, stds, strict=True)], color=line.get_color(), alpha=0.2)
    axis.set_xlabel("samples seen per peer (ddp: per process)")
    axis.set_ylabel("kNN top-1 on the held-out digits")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(args: argparse.Namespace, settings: dict, runs: list[dict], schedule: Schedule) -> list[dict]:
    modes = [row for mode in args.modes for row in (FLOOR_ROWS if mode == "random_init" else [mode])]
    summaries = [summarize(mode, [run for run in runs if run["mode"] == mode], schedule.batch)
                 for mode in modes if any(run["mode"] == mode for run in runs)]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": settings, "summary": summaries, "runs": runs}, indent=1) + "\n")
    return summaries


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.seeds < 1:
            raise BenchError(f"--seeds must be at least 1, got {args.seeds}")
        args.out = fresh_out_dir(args.out)
        batch = batch_per_peer(args.override)
        schedule = plan_schedule(args.steps, count_train_images(args.data_path), batch, args.peers,
                                 args.curve_points)
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # one thread for the kNN evaluations: with two, a busy machine makes each 10x slower (OpenMP threads spinning)
    torch.set_num_threads(1)
    seeds = list(range(args.seeds))
    settings = {"config": CONFIG, "overrides": args.override, "peers": args.peers, "seeds": seeds,
                "steps_requested": args.steps, **asdict(schedule), "steps_per_peer": schedule.steps,
                "epochs_per_mode": {mode: schedule.epochs_of(mode) for mode in args.modes}, "out": str(args.out)}
    expected = sum(estimated_seconds(mode, schedule, args.curve_points) for mode in args.modes) * len(seeds)
    print(f"{len(args.modes)} modes x {len(seeds)} seeds, {schedule.steps} steps per peer at batch {batch} "
          f"({schedule.epochs} epochs of {schedule.steps_per_epoch} steps; ddp {schedule.epochs_of('ddp')} of "
          f"{schedule.steps_per_epoch // args.peers}), into {args.out}; expected about {expected / 60:.0f} min "
          "on a quiet 2-core machine", flush=True)
    initials = {seed: write_initial_model(seed, args.out / "initial", args.data_path, args.override) for seed in seeds}
    runs: list[dict] = []
    for mode, seed in itertools.product(args.modes, seeds):
        try:
            new = run_one(mode, seed, args, schedule, initials[seed])
        except BenchError as error:  # e.g. one mode crashing: report it, keep measuring the others
            print(f"error: {error}", file=sys.stderr, flush=True)
            new = [{"mode": mode, "seed": seed, "error": str(error)}]
        runs += new
        for run in new:
            print(f"{run['mode']} seed {seed}: {json.dumps({k: v for k, v in run.items() if k != 'curve'})}",
                  flush=True)
        write_outputs(args, settings, runs, schedule)  # partial results survive an interrupted benchmark
    summaries = write_outputs(args, settings, runs, schedule)
    table = markdown(summaries, batch)
    print(table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    if args.plot:
        title = f"{CONFIG}, {args.peers} peers x batch {batch}, mean ± std over {len(seeds)} seed(s)"
        plot(summaries, args.plot, title)
    return 0 if all("error" not in run for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
