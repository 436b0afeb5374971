"""local_replicas: the collective device follows the backend, and two real gloo processes end up identical."""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import REPO
from vissl_swarm import local_replicas

COLLECTIVES = {
    "broadcast",
    "broadcast_object_list",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "reduce",
    "scatter",
    "gather",
    "barrier",
    "all_to_all",
    "reduce_scatter",
}


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("nccl", torch.device("cuda", 3)),
        ("gloo", torch.device("cpu")),
        ("cpu:gloo,cuda:nccl", torch.device("cuda", 3)),
        ("mpi", torch.device("cpu")),
    ],
)
def test_collective_device_follows_the_backend(
    monkeypatch: pytest.MonkeyPatch, backend: str, expected: torch.device
) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert local_replicas.collective_device() == expected


def test_hooks_and_task_call_collectives_only_through_local_replicas() -> None:
    """The device choice lives in one place: no hook and no task code calls torch.distributed's collectives."""
    for path in [REPO / "decentralized_task.py", *sorted((REPO / "hooks").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
                assert not (isinstance(node.value, ast.Name) and node.value.id == "dist"), f"{path.name}: {node.attr}"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(16, 4)).square().mean().backward()
    optimizer.step()


def _worker(rank: int, init_file: str, results: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    seen_devices = set()
    broadcast = dist.broadcast

    def recording_broadcast(tensor: torch.Tensor, *args, **kwargs):
        seen_devices.add(tensor.device)
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast = recording_broadcast
    try:
        model = _model(seed=rank)  # different weights and BatchNorm statistics on each rank
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        if rank == 0:  # rank 0 has momentum (it downloaded the swarm's), rank 1 none yet: layouts differ
            _step(model, optimizer, seed=10)
            optimizer.param_groups[0]["lr"] = 0.05
        assert local_replicas.broadcast_object({"iteration": 7 * (rank == 0)}) == {"iteration": 7}
        local_replicas.sync_replicas(model, optimizer)
        after_download = local_replicas.replica_checksums(model, optimizer)
        lr_after_download = optimizer.param_groups[0]["lr"]

        _step(model, optimizer, seed=20 + rank)  # each rank its own step: replicas differ again
        applied = local_replicas.broadcast_flag(rank == 0)
        momentum = optimizer.state[next(iter(model.parameters()))]["momentum_buffer"]
        if applied:  # the same layout on both ranks now: received in place
            local_replicas.sync_replicas(model, optimizer)
        same_momentum_object = optimizer.state[next(iter(model.parameters()))]["momentum_buffer"] is momentum
        after_round = local_replicas.replica_checksums(model, optimizer)
        torch.save(
            dict(
                after_download=after_download,
                after_round=after_round,
                lr=lr_after_download,
                applied=applied,
                same_momentum_object=same_momentum_object,
                devices=seen_devices,
            ),
            results / f"rank{rank}.pt",
        )
    finally:
        dist.broadcast = broadcast
        dist.destroy_process_group()


def test_two_gloo_processes_take_rank0s_parameters_buffers_and_momentum(tmp_path: Path) -> None:
    """Spawned, not forked: a fork of the pytest process copies the threads of earlier tests' hivemind peers (their
    locks too), and a child can hang on one of them before it reaches init_process_group."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.start_processes(
        _worker, args=(str(tmp_path / "init"), tmp_path), nprocs=2, start_method="spawn", join=False
    )
    deadline = time.monotonic() + 400  # two spawned interpreters importing torch: minutes on a loaded 2-core machine
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the two gloo processes did not finish within 400 s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    rank0, rank1 = (torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1))
    for moment in ("after_download", "after_round"):
        assert rank0[moment]["optimizer_checksum"] != 0.0, moment  # there is momentum to compare
        for key in ("param_checksum", "buffer_checksum", "optimizer_checksum"):
            assert rank1[moment][key] == pytest.approx(rank0[moment][key], rel=1e-12), (moment, key)
    assert rank1["lr"] == 0.05  # hyperparameters too
    assert rank0["applied"] and rank1["applied"]
    assert rank1["same_momentum_object"]  # per-round syncs write into the optimizer's own tensors
    assert rank0["devices"] == rank1["devices"] == {torch.device("cpu")}  # gloo: the CPU
