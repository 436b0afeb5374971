"""bench_time_to_trunk's peer: one box of a run, in a network namespace of its own (``python -m
benchmarks.trunk_peer CONFIG``). It runs bench_optimizer's peer loop (``optimizer_peer.train``) with four names
rebound, so that the loop, the model and the evaluation stay the very ones bench_optimizer measures:

- ``LOCAL``: hivemind listens on this box's address behind its shaped link, not on 127.0.0.1;
- ``SWARM_MODES``: every arm's step is paced (a box whose GPU takes a fixed time per step), not only averaging ones;
- ``make_driver``: the swarm with the pre-flight's flags (``TrunkSwarmDriver``), DDP over the shaped link with
  torch's fp16 compression hook (``LinkDdpDriver``); alone and hivemind.Optimizer as bench_optimizer builds them;
- ``test_accuracy``: timed, so that each curve point gets its training seconds (evaluations excluded).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import torch

from benchmarks import netns, optimizer_peer, optimizer_plan
from benchmarks.common import decentralized_sgd, write_json
from benchmarks.optimizer_peer import Driver, PeerConfig, SwarmDriver, make_driver, start_dht

EVALUATIONS: list[tuple[float, float]] = []  # (start, end) of each evaluation of this process


def timed_accuracy(timing: Path, model: torch.nn.Module, data: optimizer_plan.FashionMNIST) -> float:
    """Written at each evaluation: the result comes before the shutdown, which hivemind.Optimizer's may not end."""
    start = time.time()
    accuracy = optimizer_plan.test_accuracy(model, data)
    EVALUATIONS.append((start, time.time()))
    write_json(timing, {"evaluations": EVALUATIONS})
    return accuracy


class TrunkSwarmDriver(SwarmDriver):
    """DecentralizedSGD as the README builds it, with the flags the pre-flight advises for the emulated link."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: PeerConfig, flags: dict):
        Driver.__init__(self, model, optimizer)
        self.dht = start_dht(config, user_dht=False)
        self.dsgd = decentralized_sgd(
            optimizer, self.dht, prefix="trunk_" + re.sub(r"\W", "_", Path(config.run_dir).name), model=model, **flags
        )
        self.lock = self.dsgd.lock

    def stats(self) -> dict:
        seconds = [record["allreduce_s"] for record in self.dsgd.records if record.get("applied")]
        seconds = [value for value in seconds if value is not None]
        return {**super().stats(), "allreduce_s_median": median(seconds) if seconds else None}


class LinkDdpDriver(Driver):
    """torch DistributedDataParallel over gloo on the shaped links (rank 0's address), bucketed as torch does, with
    its fp16 compression hook when ``fp16``: what a user with torchrun runs across boxes."""

    def __init__(self, model: torch.nn.Module, config: PeerConfig, lr: float, momentum: float, fp16: bool):
        import datetime

        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{netns.host_address(0)}:{config.ddp_port}",
            rank=config.rank,
            world_size=config.settings["peers"],
            timeout=datetime.timedelta(seconds=optimizer_plan.SETUP_TIMEOUT_S),
        )
        self.inner = model
        wrapped = DistributedDataParallel(model)
        if fp16:
            wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        super().__init__(wrapped, torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=momentum))

    def weights(self) -> torch.nn.Module:
        return self.inner

    def shutdown(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def trunk_driver(extra: dict):
    def build(model, config, spec, settings) -> Driver:
        peak = spec.peak_lr(settings, config.rank)
        if spec.mode == "swarm":
            optimizer = torch.optim.SGD(model.parameters(), lr=peak, momentum=settings.momentum)
            return TrunkSwarmDriver(model, optimizer, config, extra["swarm_flags"])
        if spec.mode == "ddp":
            return LinkDdpDriver(model, config, peak, settings.momentum, extra["ddp_fp16"])
        return make_driver(model, config, spec, settings)

    return build


def wait_for_address(rank: int, timeout: float) -> None:
    """The orchestrator plugs this namespace's link in after we entered it: wait until it has our address."""
    deadline = time.monotonic() + timeout
    while (
        netns.host_address(rank) + "/"
        not in subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    ):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no address {netns.host_address(rank)} after {timeout} s: the link was not plugged in")
        time.sleep(0.05)


def main(config_path: Path) -> int:
    raw = json.loads(config_path.read_text())
    extra = raw.pop("trunk")
    config = PeerConfig(**raw)
    netns.enter_own_namespace()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    optimizer_peer.watchdog(config.deadline, config.orchestrator_pid)
    wait_for_address(config.rank, optimizer_plan.SETUP_TIMEOUT_S)
    optimizer_peer.LOCAL = f"/ip4/{netns.host_address(config.rank)}/tcp/0"
    optimizer_peer.SWARM_MODES = optimizer_plan.MODES if extra["paced"] else ()
    optimizer_peer.make_driver = trunk_driver(extra)
    timing = Path(config.run_dir) / f"timing{config.rank}.json"
    write_json(timing, {"evaluations": []})  # a box that never evaluates (DDP's ranks but 0) has none
    optimizer_peer.test_accuracy = functools.partial(timed_accuracy, timing)
    torch.set_num_threads(1)
    data = optimizer_plan.FashionMNIST.load(Path(config.settings["data_dir"]))
    optimizer_peer.train(config, data)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
