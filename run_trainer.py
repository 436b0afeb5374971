#!/usr/bin/env python3
"""Train SwAV with the stock VISSL trainer on one box, averaging with a hivemind swarm of other boxes.

    # first peer: prints the line the others run to join
    python run_trainer.py --config swav_resnet50 --data_path /datasets/imagenet --host_maddrs /ip4/0.0.0.0/tcp/31337
    # every other box
    python run_trainer.py --config swav_resnet50 --data_path /datasets/imagenet --initial_peers /ip4/.../p2p/Qm...

Any number of VISSL overrides ``config.SECTION.KEY=VALUE`` may follow the flags.
"""

from __future__ import annotations

import argparse
import difflib
import faulthandler
import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vissl_swarm import preflight, swarm, vissl_compat
from vissl_swarm.config_loading import ConfigError, available_configs, check_overrides, config_path
from vissl_swarm.ctrl_c import ctrl_c
from vissl_swarm.recipe import recipe_fixes, swarm_recipe

if TYPE_CHECKING:
    from hivemind import DHT

# a spawned worker (VISSL's multi-GPU workers, where they are spawned) re-imports this module as __mp_main__ before
# unpickling VISSL's worker function, which imports classy_vision (see vissl_compat); the trainer itself applies the
# patches in main(), after the flags are checked: a wrong flag fails at once, without 3 s of imports
if __name__ == "__mp_main__":
    vissl_compat.apply()

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--config", required=True, help=f"config name in configs/ (available: {', '.join(available_configs())})"
    )
    parser.add_argument(
        "--data_path",
        type=Path,
        default=None,
        help="dataset root in ImageFolder layout: DATA_PATH/train/<class>/<image>; default: the config's own",
    )
    parser.add_argument(
        "--checkpoint_dir",
        type=Path,
        default=None,
        help="where VISSL writes checkpoints, logs and metrics; a restarted peer resumes from here",
    )
    add_swarm_arguments(parser)
    parser.add_argument("overrides", nargs="*", help="VISSL overrides such as config.OPTIMIZER.num_epochs=10")
    return parser


def add_swarm_arguments(parser: argparse.ArgumentParser) -> None:
    """hivemind's flags (as in its ALBERT example) and the averaging knobs of DecentralizedSGD."""
    defaults = swarm.SwarmSettings()
    group = parser.add_argument_group("swarm")
    group.add_argument(
        "--run_id",
        default=defaults.run_id,
        help="name of the training run: peers with the same run_id and config average together",
    )
    group.add_argument(
        "--initial_peers",
        nargs="*",
        default=[],
        help="multiaddrs of one or more running peers (the join line the first peer printed); none: start a new swarm",
    )
    group.add_argument(
        "--host_maddrs",
        nargs="+",
        default=defaults.host_maddrs,
        help="multiaddrs to listen on, e.g. /ip4/0.0.0.0/tcp/31337 (a fixed port to open in firewalls)",
    )
    group.add_argument(
        "--announce_maddrs",
        nargs="*",
        default=[],
        help="public multiaddrs to announce when behind a port forward, e.g. /ip4/203.0.113.5/tcp/31337",
    )
    group.add_argument(
        "--identity_path",
        default="",
        help="file with this peer's private key: a stable peer id, so the join line stays valid "
        "across restarts (created if missing)",
    )
    group.add_argument(
        "--client_mode", action="store_true", help="accept no incoming connections (behind NAT without a port forward)"
    )
    group.add_argument(
        "--use_auto_relay", action="store_true", help="be reachable through relays of public peers (behind NAT)"
    )
    group.add_argument("--no_relay", action="store_true", help="disable libp2p circuit relays")
    group.add_argument(
        "--force_reachability",
        choices=["", "private", "public"],
        default="",
        help="tell libp2p whether this box can be dialed instead of letting AutoNAT guess "
        "(with --use_auto_relay behind NAT: private)",
    )
    group.add_argument(
        "--target_group_size",
        type=int,
        default=defaults.target_group_size,
        help="average with up to this many peers per round",
    )
    group.add_argument(
        "--min_matchmaking_time",
        type=float,
        default=defaults.min_matchmaking_time,
        help="seconds to gather a group before AllReduce",
    )
    group.add_argument(
        "--averaging_timeout",
        type=float,
        default=defaults.averaging_timeout,
        help="give up an AllReduce after this many seconds (dead peers are dropped sooner, see --next_chunk_timeout)",
    )
    group.add_argument(
        "--next_chunk_timeout",
        type=float,
        default=defaults.next_chunk_timeout,
        help="drop a groupmate that sends nothing for this many seconds",
    )
    group.add_argument(
        "--max_staleness",
        type=int,
        default=defaults.max_staleness,
        help="-1: never wait for averaging (ASP); s >= 0: before a step, wait for a round when "
        "more than s steps passed since the last applied one (SSP)",
    )
    group.add_argument(
        "--compression",
        choices=["none", "fp16"],
        default=defaults.compression,
        help="compression of the averaged tensors on the wire (no 8-bit: see the README)",
    )
    group.add_argument(
        "--average_optimizer_state", action="store_true", help="average momentum buffers too (more traffic)"
    )
    group.add_argument(
        "--outer_momentum",
        type=float,
        default=defaults.outer_momentum,
        help="momentum b of the outer step each peer takes on a round's average (SlowMo; with "
        "--outer_nesterov DiLoCo's form); 0 with --outer_lr 1: the plain average. README: Tips",
    )
    group.add_argument(
        "--outer_lr", type=float, default=defaults.outer_lr, help="the outer step's LR a (1: the whole average)"
    )
    group.add_argument(
        "--outer_nesterov",
        action="store_true",
        help="the outer step in Nesterov's form: a·(d + b·u) instead of a·u (DiLoCo's)",
    )
    group.add_argument(
        "--load_state_timeout",
        type=float,
        default=defaults.load_state_timeout,
        help="seconds a new peer (no checkpoint of its own) waits to download the swarm's state and "
        "progress; 0: start from its own initialization",
    )
    group.add_argument(
        "--equal_weights",
        action="store_true",
        help="every box weighs the same in a round; default: its weight is the samples it trained on "
        "since its last round (a box with more GPUs counts more, as FedAvg weights clients)",
    )
    group.add_argument(
        "--join_timeout",
        type=float,
        default=defaults.join_timeout,
        help="seconds to keep dialing --initial_peers at start before giving up with an error",
    )
    group.add_argument(
        "--alone_warning_after",
        type=float,
        default=defaults.alone_warning_after,
        help="seconds without an averaging round before the box logs a warning that it is alone, "
        "once, with the likely cause and its fix; 0: never",
    )
    group.add_argument(
        "--averager",
        choices=["improved", "old", "hivemind_optimizer"],
        default=defaults.averager,
        help="improved: this example's DecentralizedSGD; old: hivemind's TrainingAverager driven one "
        "round at a time; hivemind_optimizer: hivemind.Optimizer(use_local_updates=True) inside "
        "VISSL's LARC, an averaging round every global epoch (baselines/hivemind_optimizer.py); "
        "old and hivemind_optimizer are the baselines of benchmarks/bench_learning.py",
    )
    group.add_argument(
        "--schedule",
        choices=["swarm", "local"],
        default=defaults.schedule,
        help="swarm: the recipe (num_epochs) is the whole swarm's budget, its LR schedule follows the "
        "samples all boxes trained on, and each box stops when the swarm is done (more boxes: "
        "done sooner); local: each box runs the whole recipe on its own (more boxes: more "
        "samples in the same time)",
    )
    group.add_argument(
        "--swarm_lr",
        choices=["box", "sqrt", "linear"],
        default=defaults.swarm_lr,
        help="with --schedule swarm: each box's LR (the recipe's, for its own batch) x 1 (box), "
        "x sqrt(swarm batch / box batch) (sqrt) or x swarm batch / box batch (linear, as DDP); "
        "the swarm batch sums the batches of the boxes training now",
    )
    group.add_argument(
        "--isolated",
        action="store_true",
        help="train alone with VISSL's stock self_supervision_task (no swarm), e.g. as a baseline",
    )
    swarm.add_secret_arguments(group)
    group.add_argument(
        "--preflight",
        type=float,
        nargs="?",
        const=preflight.DEFAULT_SECONDS,
        default=None,
        metavar="SECONDS",
        help="a pre-flight check before the long run: every box runs this command with --preflight "
        "at the same time; each trains SECONDS (default "
        f"{preflight.DEFAULT_SECONDS:g}) from its first round with another box (waiting for one up to "
        "max(SECONDS, 120 s)) on a subset of the data under run id "
        f"<run_id>{preflight.SUFFIX}, in <checkpoint_dir>/{preflight.FOLDER}/<time>, then prints "
        "what it measured (groups, rounds, AllReduce seconds and bytes, link rate, staleness) and "
        "the settings it advises for these links",
    )


def swarm_settings(args: argparse.Namespace) -> swarm.SwarmSettings:
    if args.target_group_size < 2:
        raise swarm.SwarmError(f"--target_group_size must be at least 2, got {args.target_group_size}")
    for flag in ("min_matchmaking_time", "averaging_timeout", "next_chunk_timeout"):
        if getattr(args, flag) <= 0:
            raise swarm.SwarmError(f"--{flag} must be positive, got {getattr(args, flag)}")
    if args.alone_warning_after < 0:
        raise swarm.SwarmError(
            f"--alone_warning_after must be 0 (never) or a number of seconds, got {args.alone_warning_after}"
        )
    if "." in args.run_id or not args.run_id:
        raise swarm.SwarmError(f"--run_id must be a non-empty name without '.', got {args.run_id!r}")
    if args.preflight is not None:
        if not args.preflight > 0:  # also NaN
            raise swarm.SwarmError(f"--preflight takes a positive number of seconds, got {args.preflight}")
        if args.isolated or args.averager != "improved":
            raise swarm.SwarmError(
                "--preflight measures this example's averager in a swarm: it runs neither with "
                "--isolated nor with --averager old or hivemind_optimizer"
            )
    run_id = args.run_id + (preflight.SUFFIX if args.preflight else "")
    settings = swarm.SwarmSettings(
        run_id=run_id,
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        announce_maddrs=args.announce_maddrs,
        identity_path=args.identity_path,
        client_mode=args.client_mode,
        use_auto_relay=args.use_auto_relay,
        use_relay=not args.no_relay,
        force_reachability=args.force_reachability,
        target_group_size=args.target_group_size,
        min_matchmaking_time=args.min_matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        next_chunk_timeout=args.next_chunk_timeout,
        max_staleness=args.max_staleness,
        compression=args.compression,
        average_optimizer_state=args.average_optimizer_state,
        outer_momentum=args.outer_momentum,
        outer_lr=args.outer_lr,
        outer_nesterov=args.outer_nesterov,
        load_state_timeout=args.load_state_timeout,
        averager=args.averager,
        schedule=args.schedule,
        swarm_lr=args.swarm_lr,
        join_timeout=args.join_timeout,
        weight_by_samples=not args.equal_weights,
        alone_warning_after=args.alone_warning_after,
        config_name=args.config,
        recipe=swarm_recipe(args.overrides, {"--schedule": args.schedule, "--swarm_lr": args.swarm_lr}),
        preflight_s=args.preflight or 0.0,
        **swarm.secret_settings(args),
    )
    if args.averager != "improved" and settings.secret() is not None:
        raise swarm.SwarmError(
            f"--swarm_secret / --swarm_secret_file need the improved averager (--averager "
            f"{args.averager} has no swarm secret)"
        )
    settings.outer_options()  # a bad --outer_momentum / --outer_lr fails now, with what to pass
    if args.averager != "improved" and (settings.outer_momentum != 0.0 or settings.outer_lr != 1.0):
        raise swarm.SwarmError(
            f"--outer_momentum / --outer_lr need the improved averager (--averager {args.averager} has no "
            "outer step): drop them, or drop --averager"
        )
    if args.averager != "improved" and settings.max_staleness >= 0:
        raise swarm.SwarmError(
            f"--max_staleness needs the improved averager (--averager {args.averager} has no "
            f"staleness bound): drop it, or drop --averager"
        )
    for flag in ("--initial_peers", "--host_maddrs", "--announce_maddrs"):
        swarm.check_multiaddrs(flag, getattr(settings, flag[2:]))
    return settings


def check_data_path(data_path: Path) -> Path:
    """Fail before training starts if VISSL's disk_folder source would find no images."""
    train_dir = data_path / "train"
    if not train_dir.is_dir():
        raise ConfigError(
            f"--data_path {data_path}: no folder {train_dir}. Expected ImageFolder layout "
            f"{data_path}/train/<class>/<image>; `python scripts/export_digits.py --out {data_path}` makes a small one"
        )
    class_dirs = [path for path in train_dir.iterdir() if path.is_dir()]
    has_images = any(file.suffix.lower() in IMAGE_SUFFIXES for class_dir in class_dirs for file in class_dir.iterdir())
    if not has_images:
        raise ConfigError(
            f"--data_path {data_path}: {train_dir} has no images in class sub-folders "
            f"(expected {train_dir}/<class>/<image> with one of {sorted(IMAGE_SUFFIXES)})"
        )
    return train_dir


def trainer_overrides(args: argparse.Namespace) -> list[str]:
    """The user's overrides plus those our own flags stand for (ours last, so the flags win)."""
    overrides = list(args.overrides)
    if args.data_path is not None:
        train_dir = check_data_path(args.data_path).resolve()
        overrides += [f"config.DATA.TRAIN.DATA_PATHS=[{train_dir}]", f"config.DATA.TRAIN.LABEL_PATHS=[{train_dir}]"]
    if args.checkpoint_dir is not None:
        overrides.append(f"config.CHECKPOINT.DIR={args.checkpoint_dir.resolve()}")
    return overrides


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Overrides (KEY=VALUE words) may stand anywhere, also after flags that take several values. An unknown flag
    fails with one line that names the closest known one (argparse would print its whole usage)."""
    parser = build_parser()
    known = [flag for action in parser._actions for flag in action.option_strings]
    for word in argv:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            close = difflib.get_close_matches(flag.replace("-", "_").replace("__", "--", 1), known, n=1)
            hint = f"; did you mean {close[0]}?" if close else f" (see python {parser.prog} --help)"
            print(f"error: unknown flag {flag}{hint}", file=sys.stderr)
            sys.exit(2)
    overrides = [word for word in argv if "=" in word and not word.startswith("-")]
    args = parser.parse_args([word for word in argv if word not in overrides])
    args.overrides = [*args.overrides, *overrides]
    return args


def schedule_line(schedule: str, swarm_lr: str, config) -> str:
    """What num_epochs and the LR mean for this run (see --schedule, --swarm_lr)."""
    epochs = config.OPTIMIZER.num_epochs
    if schedule == "swarm":
        scaled = {
            "box": "x 1 (--swarm_lr box)",
            "sqrt": "x sqrt(swarm batch / this box's batch): x1.73 beside two boxes like this one",
            "linear": "x swarm batch / this box's batch: x3 beside two boxes like this one",
        }[swarm_lr]
        return (
            f"schedule swarm: num_epochs={epochs} epochs of the dataset for the whole swarm; the LR, prototype "
            "freezing, the queue and the end follow the samples all boxes trained on, and each box stops when "
            f"the swarm has done them (--schedule local: each box trains all of them); the LR above {scaled}, "
            "moving as boxes come and go (the progress log's lr_factor)"
        )
    return (
        f"schedule local: this box trains all num_epochs={epochs} epochs on its own schedule, whatever the "
        "other boxes do (--schedule swarm: the swarm shares them)"
    )


def another_recipe(dht: DHT, settings: swarm.SwarmSettings) -> str | None:
    """Why this box must not join: a box of its run id and config trains another recipe (its schedule, budget and
    end would differ from the swarm's), with the values to pass; None when none does, or when the DHT does not
    answer within --join_timeout (said on stderr: the recipe is then unchecked)."""
    from vissl_swarm.swarm_progress import fetch_records, live_records

    deadline = time.monotonic() + settings.join_timeout
    while True:
        try:
            records = live_records(fetch_records(dht, settings.run_id).values())
            break
        except TimeoutError:
            if time.monotonic() >= deadline:
                print(
                    f"warning: the swarm's records could not be read within {settings.join_timeout:g} s "
                    "(--join_timeout): this box trains without checking its recipe against the swarm's "
                    "(run_monitor.py with the same --run_id shows the boxes and their recipes)",
                    file=sys.stderr,
                )
                return None
    for record in records:
        if record["config"] == settings.config_name and record["peer_id"] != str(dht.peer_id):
            if fixes := recipe_fixes(settings.recipe, record["recipe"]):
                return (
                    f"the swarm of run {settings.run_id!r} trains --config {settings.config_name} with another "
                    f"recipe (box {record['peer_id'][-8:]}); every box of a swarm trains one recipe, so that all "
                    f"follow one schedule and budget: {'; '.join(fixes)} (or pass another --run_id to start "
                    "a swarm of its own)"
                )
    return None


def check_resume_checkpoint(config) -> None:
    """A truncated or corrupt newest checkpoint fails here, naming the file, not deep inside VISSL's loader."""
    import torch
    from vissl.utils.checkpoint import get_checkpoint_folder, get_resume_checkpoint

    path = get_resume_checkpoint(config, checkpoint_folder=get_checkpoint_folder(config))
    if path is None:
        return
    try:  # mmap: the zip's index and pickle are read and checked, the tensors are not (VISSL reads them next)
        torch.load(path, map_location="cpu", mmap=True)
    except Exception as error:
        raise ConfigError(
            f"cannot resume from {path}: the file is corrupt or truncated ({type(error).__name__}: {error}). "
            "Move it away to resume from the previous checkpoint in that folder, or pass another --checkpoint_dir"
        ) from error


def address_book_path(config) -> str:
    """The file in the box's checkpoint folder where it keeps the peers it met (a restart dials them)."""
    from vissl_swarm.address_book import KNOWN_PEERS_FILE

    return str(Path(config.CHECKPOINT.DIR) / KNOWN_PEERS_FILE)


def save_config(config) -> None:
    """``train_config.yaml`` in the checkpoint folder, as VISSL's own launcher writes it (VISSL's torch dtypes by
    name), once the box has joined."""
    from vissl.utils.io import save_file

    folder = Path(config.CHECKPOINT.DIR)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(json.loads(json.dumps(config.to_dict(), default=str)), str(folder / "train_config.yaml"))


def checkpoint_folder(config_name: str, overrides: list[str]) -> Path:
    """The checkpoint folder before VISSL composes the config (which creates it): the override's, else the
    config's."""
    from omegaconf import OmegaConf

    given = [word.split("=", 1)[1] for word in overrides if word.startswith("config.CHECKPOINT.DIR=")]
    return Path(given[-1] if given else OmegaConf.load(config_path(config_name)).config.CHECKPOINT.DIR)


def remove_if_new(folder: Path, new: bool) -> None:
    """A box that never trained leaves nothing behind: the checkpoint folder this run made goes, with the address
    book its DHT may have started there (anything else in it stays)."""
    from vissl_swarm.address_book import KNOWN_PEERS_FILE

    if new and folder.is_dir():
        (folder / KNOWN_PEERS_FILE).unlink(missing_ok=True)
        if not any(folder.iterdir()):
            folder.rmdir()


def report_fatal_errors() -> None:
    """Print every thread's Python stack to stderr (the trainer's log) when the trainer dies of a native crash: a
    segfault, or glibc aborting on a corrupted heap, otherwise leaves one line ("free(): corrupted unsorted chunks")
    that says neither where nor in which thread. In this process, and through ``PYTHONFAULTHANDLER`` in the
    processes VISSL spawns for a box's other GPUs. Nothing is printed on a run that does not crash."""
    faulthandler.enable(all_threads=True)
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def main(argv: list[str] | None = None, hook_generator: Callable[[Any], list] | None = None) -> int:
    """The trainer's command line; ``hook_generator`` (``cfg -> hooks``), if given, replaces ``swarm_hook_generator``
    (the GPU check's scripts/measured_trainer.py and the tests' tests/paced_trainer.py each add one hook to it)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config_path(args.config)
        check_overrides(args.overrides)
        overrides = trainer_overrides(args)
        settings = swarm_settings(args)
    except (ConfigError, swarm.SwarmError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    report_fatal_errors()
    vissl_compat.apply()
    import torch
    from vissl.utils.distributed_launcher import launch_distributed

    from decentralized_task import TASK_NAME, leave_swarm
    from hooks import swarm_hook_generator
    from vissl_swarm.config_loading import compose_trainer_config

    hook_generator = hook_generator or swarm_hook_generator

    new_folder = not checkpoint_folder(args.config, overrides).exists()  # removed again if this box cannot join
    try:
        composed = compose_trainer_config(args.config, overrides, has_gpu=torch.cuda.is_available())
        config = composed.config
        if args.preflight:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for change in preflight.configure(config, overrides, Path(config.CHECKPOINT.DIR), stamp):
                print(f"[preflight] {change}", file=sys.stderr)
        check_resume_checkpoint(config)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for change in composed.compat_changes:
        print(f"[compat] {change}", file=sys.stderr)
    for line in composed.recipe:  # the values that depend on this box's batch and dataset (vissl_swarm/recipe.py)
        print(f"[recipe] {line}", file=sys.stderr)
    if not args.isolated:
        print(f"[recipe] {schedule_line(args.schedule, args.swarm_lr, config)}", file=sys.stderr)
    vissl_compat.fork_start_method()
    averaging_task = TASK_NAME
    if args.isolated:
        config.TRAINER.TASK_NAME = "self_supervision_task"
    elif args.averager != "improved":  # a baseline of the benchmarks: this task with another averager
        from baselines.tasks import TASKS

        config.TRAINER.TASK_NAME = averaging_task = TASKS[args.averager]
    # VISSL logs its config and environment: the secret goes in a file
    settings = replace(swarm.hide_secret(settings), address_book=address_book_path(config))
    config.SWARM = settings.to_config()
    if not any(override.startswith("config.SEED_VALUE=") for override in overrides):
        # every peer its own data order (VISSL seeds its sampler with SEED_VALUE, identical in every peer's config)
        config.SEED_VALUE = secrets.randbelow(100_000)  # VISSL multiplies it by num_epochs; numpy needs < 2**32
        print(f"[swarm] this peer's seed: {config.SEED_VALUE} (set config.SEED_VALUE=... to fix it)", file=sys.stderr)
    if config.DISTRIBUTED.NUM_PROC_PER_NODE == 1:  # VISSL trains in this process: Ctrl-C stops at a step boundary
        ctrl_c.install()
    dht = None
    if config.TRAINER.TASK_NAME == averaging_task and config.DISTRIBUTED.NUM_PROC_PER_NODE == 1:
        try:  # fail fast on an unreachable swarm; the task reuses this DHT (several GPUs: local rank 0 starts one)
            dht = swarm.start_dht(settings)
        except swarm.SwarmError as error:
            print(f"error: {error}", file=sys.stderr)
            remove_if_new(Path(config.CHECKPOINT.DIR), new_folder)
            return 3
        if refusal := another_recipe(dht, settings):
            print(f"error: {refusal}", file=sys.stderr)
            dht.shutdown()
            remove_if_new(Path(config.CHECKPOINT.DIR), new_folder)
            return 2
        swarm.use_shared_dht(dht)
    save_config(config)
    try:
        launch_distributed(config, node_id=0, engine_name="train", hook_generator=hook_generator)
    finally:  # an error of the training run propagates after this (a return here would swallow it)
        left = leave(leave_swarm, dht)
    if not left:
        return 130
    return print_preflight_report(config, settings) if args.preflight else 0


def print_preflight_report(config, settings: swarm.SwarmSettings) -> int:
    """The pre-flight's table and advice on stdout (also as JSON next to its records); 4 if it measured nothing."""
    from vissl.utils.checkpoint import get_checkpoint_folder

    folder = Path(get_checkpoint_folder(config))
    current = preflight.Settings(
        target_group_size=settings.target_group_size,
        min_matchmaking_time=settings.min_matchmaking_time,
        averaging_timeout=settings.averaging_timeout,
        compression=settings.compression,
    )
    try:
        text, _ = preflight.report(folder, current)
    except preflight.PreflightError as error:
        print(f"error: the pre-flight measured nothing: {error}", file=sys.stderr)
        return 4
    print(text, flush=True)
    print(f"(as JSON: {folder / preflight.REPORT_FILE})", flush=True)
    if freed := preflight.remove_checkpoints(folder):
        print(
            f"(the pre-flight's checkpoints, {freed / 1e6:.1f} MB, were removed: the long run starts afresh)",
            flush=True,
        )
    return 0


def leave(leave_swarm: Callable[[], None], dht: DHT | None) -> bool:
    """The averager first (it still talks to the DHT while it stops), then the DHT and its p2pd. False when a
    second Ctrl-C cut it short: the averager and DHT processes then end with this one."""
    try:
        leave_swarm()
        if dht is not None:
            dht.shutdown()
    except KeyboardInterrupt:
        print("Ctrl-C again: stopping without waiting for the averager to leave its group", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
