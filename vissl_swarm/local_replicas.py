"""One box, several local processes (VISSL's DDP): keep every local rank's replica equal to rank 0's.

Only local rank 0 is in the swarm. When a state download or an averaging round changes its parameters, buffers
or optimizer state, it broadcasts them to the other local ranks over the box's process group: DDP copies
parameters only when it is built, and averages gradients, not weights or momentum.

Every collective here uses tensors on the device that the process group's backend serves
(:func:`collective_device`): an NCCL group has no CPU backend, so a CPU tensor broadcast there raises
("No backend type associated with device type cpu"), while gloo serves CPU tensors. Tensors travel flattened,
one collective per dtype, instead of one per tensor (a ResNet-50 has ~320 parameters and buffers).

torch.distributed only (no VISSL): the hooks and the task call it, the unit tests drive it with gloo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from hivemind.utils.nested import nested_flatten, nested_map, nested_pack
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def is_box() -> bool:
    """True in a process group of several local ranks (a multi-GPU box, or the gloo test's two CPU processes)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors for ``group``'s collectives must live: this rank's GPU under NCCL, else the CPU.

    A group made with several backends ("cpu:gloo,cuda:nccl") serves both; the GPU is then the faster choice.
    """
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_flag(value: bool, src: int = 0) -> bool:
    """``src``'s value on every rank (e.g. "rank 0 applied a round in this step")."""
    flag = torch.tensor([int(value)], dtype=torch.int64, device=collective_device())
    dist.broadcast(flag, src=src)
    return bool(flag.item())


def broadcast_ints(values: Sequence[int], src: int = 0) -> list[int]:
    """``src``'s integers on every rank, in one collective (e.g. the swarm's position and batch, which only local
    rank 0 reads)."""
    numbers = torch.tensor([int(value) for value in values], dtype=torch.int64, device=collective_device())
    dist.broadcast(numbers, src=src)
    return [int(number) for number in numbers.tolist()]


def broadcast_object(obj: object, src: int = 0) -> object:
    """``src``'s picklable object on every rank."""
    shared = [obj]
    dist.broadcast_object_list(shared, src=src, device=collective_device())
    return shared[0]


@torch.no_grad()
def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` in place with ``src``'s, one flat collective per dtype.

    Every rank passes tensors of the same shapes and dtypes in the same order; they may live on any device (a
    tensor that is not on the collective device travels through a staging copy on it).
    """
    device, is_src = collective_device(), dist.get_rank() == src
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for dtype, group in by_dtype.items():
        if is_src:
            flat = _flatten_dense_tensors([tensor.detach().to(device) for tensor in group])
        else:
            flat = torch.empty(sum(tensor.numel() for tensor in group), dtype=dtype, device=device)
        dist.broadcast(flat, src=src)
        if not is_src:
            for tensor, received in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                tensor.copy_(received)


@dataclass(frozen=True)
class _TensorSpec:
    """Stands for a tensor in the layout of an optimizer's state_dict that src sends before the tensors."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _layout(state_dict: dict) -> dict:
    return nested_map(lambda x: _TensorSpec(tuple(x.shape), x.dtype) if torch.is_tensor(x) else x, state_dict)


def _tensors(state_dict: dict) -> list[torch.Tensor]:
    return [x for x in nested_flatten(state_dict) if torch.is_tensor(x)]


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, src: int = 0) -> None:
    """Give every rank ``src``'s optimizer state (momentum, step counts) and hyperparameters.

    First the layout (one small object: hyperparameters, and the shape and dtype of each state tensor), then the
    tensors. A rank whose own state has that layout receives into its tensors in place (the case after every
    round); one whose state differs (no momentum yet, before its first step, while rank 0 downloaded the swarm's)
    receives into new tensors and loads them with ``load_state_dict``, which moves them to its parameters' device.
    """
    state = optimizer.state_dict()
    layout = broadcast_object(_layout(state), src=src)
    if dist.get_rank() == src or _layout(state) == layout:
        broadcast_tensors(_tensors(state), src=src)
        return
    device = collective_device()
    received = [
        torch.empty(spec.shape, dtype=spec.dtype, device=device)
        for spec in nested_flatten(layout)
        if isinstance(spec, _TensorSpec)
    ]
    broadcast_tensors(received, src=src)
    filled = iter(received)
    optimizer.load_state_dict(
        nested_pack([next(filled) if isinstance(x, _TensorSpec) else x for x in nested_flatten(layout)], layout)
    )


def sync_replicas(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, src: int = 0) -> None:
    """Every local rank takes ``src``'s parameters and buffers, and its optimizer state if one is given."""
    broadcast_tensors([*model.parameters(), *model.buffers()], src=src)
    if optimizer is not None:
        broadcast_optimizer_state(optimizer, src=src)


@torch.no_grad()
def replica_checksums(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
    """Sums of the parameters, the floating-point buffers and the optimizer's tensor state, in float64: equal
    on two ranks (to rounding) iff their replicas are; the box test compares them across local ranks."""

    def total(tensors: list[torch.Tensor]) -> float:
        return float(sum(t.double().sum() for t in tensors)) if tensors else 0.0

    state = [t for t in _tensors(optimizer.state_dict()) if t.is_floating_point()] if optimizer is not None else []
    return {
        "param_checksum": total(list(model.parameters())),
        "buffer_checksum": total([b for b in model.buffers() if b.is_floating_point()]),
        "optimizer_checksum": total(state),
    }


def compare_replica_logs(rank0: list[dict], rank1: list[dict], rel: float = 1e-9) -> dict:
    """Where the checksums that two local ranks logged (``replica_checksums``, every step) disagree.

    Parameters and optimizer state must agree at every step both ranks logged. Buffers must agree at the steps
    where rank 0 applied a round (its ``rounds_ok`` grew since the previous step) and broadcast them: between
    rounds each rank's BatchNorm statistics follow its own batches, as in any DDP run without SyncBatchNorm.
    """
    by_step0, by_step1 = ({entry["step"]: entry for entry in log} for log in (rank0, rank1))
    common = sorted(set(by_step0) & set(by_step1))
    round_steps = [
        entry["step"]
        for previous, entry in zip(rank0, rank0[1:], strict=False)
        if entry["step"] == previous["step"] + 1
        and entry["step"] in by_step1
        and entry.get("rounds_ok", 0) > previous.get("rounds_ok", 0)
    ]

    def differ(key: str, steps: list[int]) -> list[int]:
        return [
            step
            for step in steps
            if abs(by_step0[step][key] - by_step1[step][key]) > rel * max(abs(by_step0[step][key]), 1.0)
        ]

    return {
        "steps_compared": len(common),
        "first_step_compared": bool(common) and common[0] == min(by_step0),
        "optimizer_state_present": bool(common) and all(by_step0[step]["optimizer_checksum"] != 0 for step in common),
        "round_steps_compared": len(round_steps),
        "param_mismatch_steps": differ("param_checksum", common),
        "optimizer_mismatch_steps": differ("optimizer_checksum", common),
        "buffer_mismatch_steps": differ("buffer_checksum", round_steps),
    }
