"""bench_optimizer's peer (``python -m benchmarks.optimizer_peer CONFIG``): the shared loop, its mode's ``Driver``."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

import torch
import torch.nn as nn

from benchmarks.common import decentralized_sgd, write_json
from benchmarks.optimizer_churn import (
    CHECKPOINT_EVERY,
    PROGRESS_EVERY,
    ChurnPlan,
    ProgressFiles,
    crash,
    load_checkpoint,
    save_checkpoint,
)
from benchmarks.optimizer_plan import (
    JOIN_TIMEOUT_S,
    LOCAL,
    SETUP_TIMEOUT_S,
    SWARM_MODES,
    Batches,
    FashionMNIST,
    RunSpec,
    Settings,
    checkpoint_steps,
    lr_at,
    make_model,
    test_accuracy,
)


@dataclass
class PeerConfig:
    """What one process needs (written as JSON by the orchestrator)."""

    settings: dict
    spec: dict
    rank: int
    run_dir: str
    deadline: float  # time.time() after which the process kills its own session
    orchestrator_pid: int
    ddp_port: int = 0
    restarted: bool = False  # churn kill: the churned peer started again (optimizer_churn)

    def paths(self) -> dict[str, Path]:
        run = Path(self.run_dir)
        return {
            "maddrs": run / "maddrs.json",
            "go": run / "go.json",
            "ready": run / f"ready{self.rank}.json",
            "result": run / f"result{self.rank}.json",
        }


def watchdog(deadline: float, orchestrator_pid: int) -> None:
    """Kill this process's session after the deadline or once the orchestrator is gone: no peer outlives its run."""

    def watch() -> None:
        while True:
            orphaned = os.getppid() != orchestrator_pid
            if orphaned or time.time() > deadline:
                print(
                    f"[bench peer] {'orchestrator gone' if orphaned else 'deadline passed'}: killing my session",
                    file=sys.stderr,
                    flush=True,
                )
                os.killpg(os.getpgrp(), signal.SIGKILL)
            time.sleep(1.0)

    threading.Thread(target=watch, name="bench-watchdog", daemon=True).start()


def wait_for_file(path: Path, deadline: float, what: str) -> dict:
    while not path.exists():
        if time.time() > deadline:
            raise TimeoutError(f"no {what} ({path}) before the deadline")
        time.sleep(0.1)
    time.sleep(0.05)  # written with a rename, but be gentle with slow file systems
    return json.loads(path.read_text())


class LogCounter(logging.Handler):
    """Counts hivemind.Optimizer's own status lines (it reports averaging rounds only in its log)."""

    PATTERNS = {
        "rounds_applied": re.compile(r"Averaged parameters with (\d+) peers"),
        "rounds_failed": re.compile(r"Averaging failed with"),
        "loaded_state": re.compile(r"Peer is out of sync"),
    }

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.counts = dict.fromkeys(self.PATTERNS, 0)
        self.group_sizes: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for name, pattern in self.PATTERNS.items():
            found = pattern.search(message)
            if found:
                self.counts[name] += 1
                if found.groups():
                    self.group_sizes.append(int(found.group(1)))


class Driver:
    """One mode's optimizer as the loop uses it; ``lock`` guards forward to step where needed, and evaluation's copy."""

    needs_lock_for_forward = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.lock: Any = contextlib.nullcontext()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, batch_size: int) -> None:
        self.optimizer.step()

    def weights(self) -> nn.Module:
        return self.model

    def stats(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


def start_dht(config: PeerConfig, user_dht: bool) -> Any:
    """Peer 0 starts the swarm and publishes its multiaddrs, the others join through them: our peers with the product's
    ``swarm.start_dht`` (it redials a busy peer 0), hivemind_optimizer with a plain hivemind.DHT, as its users would."""
    import hivemind

    from vissl_swarm import swarm

    paths = config.paths()
    initial = [] if config.rank == 0 else wait_for_file(paths["maddrs"], config.deadline, "peer 0's addresses")
    if user_dht:
        dht = hivemind.DHT(start=True, host_maddrs=[LOCAL], initial_peers=initial or None, startup_timeout=60)
    else:
        settings = swarm.SwarmSettings(host_maddrs=[LOCAL], initial_peers=initial, join_timeout=JOIN_TIMEOUT_S)
        dht = swarm.start_dht(settings, startup_timeout=60)
    if config.rank == 0:
        write_json(paths["maddrs"], [str(address) for address in dht.get_visible_maddrs()])
    return dht


class SwarmDriver(Driver):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: PeerConfig, spec: RunSpec):
        super().__init__(model, optimizer)
        self.dht = start_dht(config, user_dht=False)
        self.dsgd = decentralized_sgd(
            optimizer,
            self.dht,
            prefix=f"benchopt_{Path(config.run_dir).name}",
            model=model,
            target_group_size=spec.target_group_size,
            min_matchmaking_time=spec.min_matchmaking_time,
            weight_by_samples=spec.weight_by_samples,
            compression="none",
            outer_momentum=spec.outer_momentum,
            outer_lr=spec.outer_lr,
            outer_nesterov=spec.outer_nesterov,
        )
        self.lock = self.dsgd.lock  # rounds are applied at step boundaries, in this thread: only the copy needs it

    def step(self, batch_size: int) -> None:
        self.dsgd.step(batch_size=batch_size)

    def stats(self) -> dict:
        applied = [record for record in self.dsgd.records if record.get("applied")]
        staleness = [record["staleness_steps"] for record in applied if record.get("staleness_steps") is not None]
        counters = {key: value for key, value in self.dsgd.counters.items() if value}
        return {
            "rounds_applied": int(self.dsgd.counters["rounds_applied"]),
            "rounds_failed": int(self.dsgd.counters["rounds_failed"]),
            "group_size_mean": mean(r["group_size"] for r in applied) if applied else None,
            "staleness_steps_mean": mean(staleness) if staleness else None,
            "counters": counters,
        }

    def shutdown(self) -> None:
        self.dsgd.shutdown()
        self.dht.shutdown()


class OldDriver(Driver):
    needs_lock_for_forward = True  # OldDesignAverager applies a round from its own thread, under its lock

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: PeerConfig, spec: RunSpec):
        super().__init__(model, optimizer)
        from baselines.old_design import OldDesignAverager

        self.dht = start_dht(config, user_dht=False)
        self.averager = OldDesignAverager(
            optimizer,
            self.dht,
            prefix=f"benchopt_{Path(config.run_dir).name}",
            model=model,
            target_group_size=spec.target_group_size,
            min_matchmaking_time=spec.min_matchmaking_time,
            compression="none",
        )
        self.lock = self.averager.lock

    def step(self, batch_size: int) -> None:
        self.optimizer.step()
        self.averager.on_step_end(batch_size)

    def stats(self) -> dict:
        applied = [record for record in self.averager.records if record.get("applied")]
        staleness = [record["staleness_steps"] for record in applied if record.get("staleness_steps") is not None]
        return {
            "rounds_applied": int(self.averager.counters["rounds_applied"]),
            "rounds_failed": int(self.averager.counters["rounds_failed"]),
            "group_size_mean": mean(r["group_size"] for r in applied) if applied else None,
            "staleness_steps_mean": mean(staleness) if staleness else None,
        }

    def shutdown(self) -> None:
        self.averager.shutdown()
        self.dht.shutdown()


class HivemindDriver(Driver):
    """hivemind.Optimizer with local updates; its ``param_groups`` are copies, so the LR is set on ``opt.opt``."""

    def __init__(self, model: nn.Module, config: PeerConfig, spec: RunSpec, momentum: float):
        import hivemind

        settings = Settings(**config.settings)
        self.counter = LogCounter()
        for name in ("hivemind.optim.state_averager", "hivemind.optim.optimizer"):
            logging.getLogger(name).addHandler(self.counter)
        self.dht = start_dht(config, user_dht=True)
        self.opt = hivemind.Optimizer(
            dht=self.dht,
            run_id=f"benchopt_{Path(config.run_dir).name}",
            params=model.parameters(),
            optimizer=lambda params: torch.optim.SGD(params, lr=settings.lr, momentum=momentum),
            batch_size_per_step=spec.batches(settings)[config.rank],
            target_batch_size=settings.hivemind_target_batch_size,
            use_local_updates=True,
            matchmaking_time=spec.min_matchmaking_time,
            averaging_timeout=settings.hivemind_averaging_timeout,
            average_state_every=1,
            verbose=True,
        )
        super().__init__(model, self.opt.opt)

    def step(self, batch_size: int) -> None:
        self.opt.step(batch_size=batch_size)

    def stats(self) -> dict:
        sizes = self.counter.group_sizes
        return {
            **self.counter.counts,
            "epochs": int(self.opt.local_epoch),
            "group_size_mean": mean(sizes) if sizes else None,
        }

    def shutdown(self) -> None:
        self.opt.shutdown()
        self.dht.shutdown()


class DdpDriver(Driver):
    def __init__(self, model: nn.Module, config: PeerConfig, momentum: float, lr: float):
        import datetime

        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{config.ddp_port}",
            rank=config.rank,
            world_size=config.settings["peers"],
            timeout=datetime.timedelta(seconds=SETUP_TIMEOUT_S),
        )
        self.inner = model
        wrapped = DistributedDataParallel(model)
        super().__init__(wrapped, torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=momentum))

    def weights(self) -> nn.Module:
        return self.inner

    def shutdown(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def make_driver(model: nn.Module, config: PeerConfig, spec: RunSpec, settings: Settings) -> Driver:
    peak = spec.peak_lr(settings, config.rank)
    if spec.mode == "swarm":
        optimizer = torch.optim.SGD(model.parameters(), lr=peak, momentum=settings.momentum)
        return SwarmDriver(model, optimizer, config, spec)
    if spec.mode == "old":
        optimizer = torch.optim.SGD(model.parameters(), lr=peak, momentum=settings.momentum)
        return OldDriver(model, optimizer, config, spec)
    if spec.mode == "hivemind_optimizer":
        return HivemindDriver(model, config, spec, settings.momentum)
    if spec.mode == "ddp":
        return DdpDriver(model, config, settings.momentum, peak)
    return Driver(model, torch.optim.SGD(model.parameters(), lr=peak, momentum=settings.momentum))


def train(config: PeerConfig, data: FashionMNIST) -> dict:
    """The plain PyTorch loop every mode shares; returns this peer's result (curve, rounds, pace)."""
    settings, spec = Settings(**config.settings), RunSpec(**config.spec)
    if spec.mode == "ideal":
        return train_ideal_replicas(config, spec, settings, data)
    batch = spec.batches(settings)[config.rank]
    steps, total_batch = spec.steps(settings), spec.total_batch(settings)
    peak, slowdown = spec.peak_lr(settings, config.rank), spec.slowdown(settings, config.rank)
    min_step_s = (spec.pace_s or settings.min_step_s) if spec.mode in SWARM_MODES else 0.0  # only averaging needs it
    model = make_model(spec.seed)
    evaluated = copy.deepcopy(model)
    batches = Batches(data, 1000 * spec.seed + config.rank + (100 if config.restarted else 0))
    run_dir = Path(config.run_dir)
    churn = ChurnPlan.of(spec.churn, settings.peers, steps)
    churned = churn is not None and config.rank == churn.rank
    progress = ProgressFiles(run_dir)
    others = [rank for rank in range(settings.peers) if rank != config.rank]
    saved = load_checkpoint(run_dir, config.rank) if config.restarted else None
    if saved is not None:
        model.load_state_dict(saved["model"])  # the box's last checkpoint, before it joins again
    driver = make_driver(model, config, spec, settings)
    paths = config.paths()
    write_json(paths["ready"], {"rank": config.rank, "t": time.time()})
    go = wait_for_file(paths["go"], config.deadline, "go from the orchestrator")
    time.sleep(max(0.0, go["start_at"] - time.time()))

    curve: list[dict] = []
    first = 0
    if saved is not None:  # the README's restart: resume the checkpoint, then take the swarm's state if it is ahead
        driver.optimizer.load_state_dict(saved["optimizer"])
        curve = saved["curve"]
        progress.wait_for(others, churn.resume_at, config.deadline, lambda: None)  # started early: see optimizer_churn
        taken = driver.dsgd.load_state_from_peers(timeout=60, accept=None)
        first = driver.dsgd.local_step if taken is not None else saved["step"]
        print(f"[bench peer] restarted: checkpoint of step {saved['step']}, continuing at {first}", flush=True)
        if first >= steps - (steps - churn.resume_at) // 2:  # it would miss most of the last third: not a churn run
            raise RuntimeError(
                f"the restarted peer came back at step {first} of {steps}, after most of the run: this machine "
                "started it too slowly for the pace (raise --churn_pace_s, or run on a quieter machine)"
            )
    evaluates = set(checkpoint_steps(steps, settings.curve_points)) if config.rank == 0 or spec.mode != "ddp" else set()

    def evaluate(step: int) -> None:
        with driver.lock:  # a consistent copy of the weights (the old design applies from its own thread)
            evaluated.load_state_dict(driver.weights().state_dict())
        curve.append(
            {
                "step": step,
                "swarm_samples": step * total_batch,
                "local_samples": step * batch,
                "accuracy": test_accuracy(evaluated, data),
            }
        )

    losses: list[float] = []
    t_train, train_s = time.time(), 0.0
    try:
        if 0 in evaluates and saved is None:
            evaluate(0)
        step = first - 1
        while step + 1 < steps:
            step += 1
            if step % PROGRESS_EVERY == 0:
                progress.write(config.rank, step)
            if churned and not config.restarted:
                if spec.churn == "kill" and step % CHECKPOINT_EVERY == 0:
                    save_checkpoint(run_dir, config.rank, model, driver.optimizer, step, curve)
                if step == churn.stop_at and spec.churn == "kill":
                    crash()
                if step == churn.stop_at:  # pause: in the swarm, training nothing, until the others are at 2/3,
                    progress.wait_for(others, churn.resume_at, config.deadline, lambda: None)
                    taken = driver.dsgd.load_state_from_peers(timeout=60, accept=None)  # then as the restart does
                    step = driver.dsgd.local_step if taken is not None else churn.resume_at
            t_step = time.perf_counter()
            images, labels = batches.next(batch)
            driver.set_lr(lr_at(step * total_batch, settings, peak))
            with driver.lock if driver.needs_lock_for_forward else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(driver.model(images), labels)
                driver.model.zero_grad(set_to_none=True)
                loss.backward()
                driver.step(batch)
            losses.append(float(loss))
            busy = time.perf_counter() - t_step
            train_s += busy
            pause = max(busy * (slowdown - 1.0), min_step_s - busy)
            time.sleep(max(0.0, pause))  # also lets the old design's averaging thread take its lock
            if step + 1 in evaluates:
                evaluate(step + 1)
        progress.write(config.rank, steps)
        result = {
            "rank": config.rank,
            "batch": batch,
            "steps": steps,
            "restarted": config.restarted,
            "resumed_at": first,
            "local_samples": steps * batch,
            "peak_lr": peak,
            "curve": curve,
            "final_accuracy": curve[-1]["accuracy"] if curve else None,
            "loss_tail": mean(losses[-50:]) if losses else None,
            "train_s": train_s,
            "wall_s": time.time() - t_train,
            **driver.stats(),
        }
        rounds = result.get("rounds_applied")
        result["steps_per_round"] = steps / rounds if rounds else None
        write_json(paths["result"], result)
        return result
    finally:
        driver.shutdown()


def train_ideal_replicas(config: PeerConfig, spec: RunSpec, settings: Settings, data: FashionMNIST) -> dict:
    """Mode ideal: every peer a replica in this process (``ideal_swarm``); its result holds theirs (``replicas``)."""
    from benchmarks import optimizer_plan
    from benchmarks.ideal_swarm import IdealOptions, train_ideal
    from decentralized_sgd.outer import OuterSettings

    outer = OuterSettings(spec.outer_momentum, spec.outer_lr, spec.outer_nesterov)
    paths = config.paths()
    write_json(paths["ready"], {"rank": config.rank, "t": time.time()})
    wait_for_file(paths["go"], config.deadline, "go from the orchestrator")
    t0 = time.time()
    replicas = train_ideal(spec, settings, data, IdealOptions(period=spec.period, outer=outer), optimizer_plan)
    result = {"replicas": [{**replica, "wall_s": time.time() - t0} for replica in replicas]}
    write_json(paths["result"], result)
    return result


def peer_main(config_path: Path) -> int:
    config = PeerConfig(**json.loads(config_path.read_text()))
    watchdog(config.deadline, config.orchestrator_pid)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    data = FashionMNIST.load(Path(config.settings["data_dir"]))
    train(config, data)
    return 0


if __name__ == "__main__":
    sys.exit(peer_main(Path(sys.argv[1])))
