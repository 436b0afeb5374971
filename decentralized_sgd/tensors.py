"""The tensors a peer averages (looked up anew each time: ``load_state_dict`` replaces them) and the host copies
they travel through: ``FlatStaging``, one flat buffer per device and dtype (pinned for a GPU); finished results wait
in two (``ResultSlots``), as the next round reuses the averager's buffers at once. On a GPU, host copies run on a side
stream that waits for the trainer's step-boundary mark (``StepBoundaryMarks``), and copies back make the trainer's
stream wait, not its thread. BatchNorm statistics change outside the lock; the delta rule keeps every local update.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hivemind.optim.state_averager import initialize_optimizer_state_


def copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """dst <- src, one fused op when devices and dtypes agree."""
    assert len(dst) == len(src)
    if all(a.device == b.device and a.dtype == b.dtype for a, b in zip(dst, src, strict=True)):
        torch._foreach_copy_(list(dst), list(src))
    else:
        for a, b in zip(dst, src, strict=True):
            a.copy_(b)


def averaged_minus_(slot: Sequence[torch.Tensor], averaged: Sequence[torch.Tensor]) -> None:
    """slot <- averaged − slot (the delta rule's update from the snapshot in slot), in one pass over each tensor."""
    assert len(slot) == len(averaged)
    for mine, theirs in zip(slot, averaged, strict=True):
        torch.sub(theirs, mine, out=mine)


def add_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """dst += src (src: fp32 CPU), one fused op when dst is fp32 CPU too."""
    assert len(dst) == len(src)
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in dst):
        torch._foreach_add_(list(dst), list(src))
    else:
        for t, delta in zip(dst, src, strict=True):
            t.add_(delta.to(t.device, t.dtype))


class AveragedTensors:
    """Which local tensors are averaged, in the averager's order; ``local()`` returns the current references."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module | None,
        *,
        average_buffers: bool,
        average_optimizer_state: bool,
    ):
        self.optimizer, self.model = optimizer, model
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.buffer_names = [
            name
            for name, buf in (model.named_buffers() if model is not None and average_buffers else ())
            if buf.is_floating_point()
        ]
        if average_optimizer_state and not any(optimizer.state.values()):
            self.init_optimizer_state()
        self.opt_keys = [
            (i, key)
            for i, p in enumerate(self.params)
            for key, value in sorted(optimizer.state.get(p, {}).items())
            if average_optimizer_state
            and key != "step"
            and torch.is_tensor(value)
            and value.is_floating_point()
            and value.shape == p.shape
        ]

    def local(self) -> list[torch.Tensor]:
        buffers = dict(self.model.named_buffers()) if self.buffer_names else {}
        return (
            self.params
            + [buffers[name] for name in self.buffer_names]
            + [self.optimizer.state[self.params[i]][key] for i, key in self.opt_keys]
        )

    def zeros(self) -> list[torch.Tensor]:
        """fp32 CPU tensors shaped like local(): the averager's buffers."""
        return [torch.zeros(t.shape, dtype=torch.float32) for t in self.local()]

    def init_optimizer_state(self) -> None:
        """Create lazily-initialized optimizer state (e.g. momentum) with a zero-gradient step; params are kept."""
        with torch.no_grad():
            backup = [p.detach().clone() for p in self.params]
            initialize_optimizer_state_(self.optimizer)
            for p, saved in zip(self.params, backup, strict=True):
                p.copy_(saved)

    @staticmethod
    def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
        """One sync: an L2 norm is nan/inf iff an element is (or its square overflows: rejected too)."""
        return math.isfinite(AveragedTensors.norm(tensors))

    @staticmethod
    def norm(tensors: Sequence[torch.Tensor]) -> float:
        """The L2 norm of all of them together, in one sync."""
        tensors = [t for t in tensors if t.numel() > 0]
        if not tensors:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)).double()))


class ResultSlots:
    """Two preallocated stagings (``make()``); a round takes one at its fill and gives it back when retired."""

    count = 2

    def __init__(self, make: Callable[[], FlatStaging]):
        self._stagings = [make() for _ in range(self.count)]
        self._free = list(range(self.count))

    def free(self) -> int:
        return len(self._free)

    def take(self) -> list[torch.Tensor]:
        return self._stagings[self._free.pop()].views

    def give_back(self, slot: list[torch.Tensor]) -> None:
        self._free.append(next(i for i, s in enumerate(self._stagings) if s.views is slot))

    def staging(self, slot: list[torch.Tensor]) -> FlatStaging:
        """The staging whose views ``slot`` is: it copies them to and from the trainer's devices."""
        return next(s for s in self._stagings if s.views is slot)


class StepBoundaryMarks:
    """The trainer's step boundaries on each GPU holding its tensors, and the side stream copies run on."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.devices = list(dict.fromkeys(t.device for t in tensors if t.is_cuda))
        self._marks = {device: torch.cuda.Event() for device in self.devices}
        self._side_streams = {device: torch.cuda.Stream(device) for device in self.devices}
        self.record()  # what the model's construction (or a load) queued counts as the first boundary

    def record(self) -> None:
        """Holding ``dsgd.lock``, after the tensors changed (a step boundary, a state download)."""
        for device, mark in self._marks.items():
            mark.record(torch.cuda.current_stream(device))

    def mark(self, device: torch.device) -> torch.cuda.Event:
        return self._marks[device]

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """Used only under ``dsgd.lock`` (fills, serving, the apply, a download): one copy at a time."""
        return self._side_streams[device]


def _event_after(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event at the end of what ``stream`` has queued; a thread that waits for it sleeps instead of spinning."""
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


def layout(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> list[tuple]:
    """What a staging for ``tensors`` must match: shapes, devices and host dtypes (``dtype``, else the tensors')."""
    return [(tuple(t.shape), t.device, dtype or t.dtype) for t in tensors]


@dataclass(eq=False)
class _Group:
    device: torch.device
    indices: list[int]  # their positions in the layout, ascending
    flat: torch.Tensor
    views: list[torch.Tensor]
    last_read: torch.cuda.Event | None = None  # a GPU group: the end of the last host → device copy out of `flat`

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def first(self, count: int) -> int:
        """How many of this group's tensors are among the layout's first ``count``."""
        return sum(i < count for i in self.indices)


class FlatStaging:
    """Host copies of the tensors of one layout (``dtype``: default each tensor's own). Its methods run holding
    ``dsgd.lock``; ``views`` belong to whoever owns the staging (a round's slot: the scheduler until DONE)."""

    def __init__(self, like: Sequence[torch.Tensor], marks: StepBoundaryMarks, dtype: torch.dtype | None = None):
        self.layout, self.marks = layout(like, dtype), marks
        by_group: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, (_, device, host_dtype) in enumerate(self.layout):
            by_group.setdefault((device, host_dtype), []).append(i)
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(like)
        self._groups: list[_Group] = []
        for (device, host_dtype), indices in by_group.items():
            if device.type == "cuda" and device not in marks.devices:
                raise ValueError(f"a tensor on {device}, whose stream the trainer does not mark (only {marks.devices})")
            sizes = [like[i].numel() for i in indices]
            flat = torch.zeros(sum(sizes), dtype=host_dtype, pin_memory=device.type == "cuda")
            if device.type != "cuda":  # shared: after a fork (averager, data loaders) private pages turn copy-on-write
                flat.share_memory_()
            views = [part.view(like[i].shape) for part, i in zip(flat.split(sizes), indices, strict=True)]
            for i, view in zip(indices, views, strict=True):
                self.views[i] = view
            self._groups.append(_Group(device, indices, flat, views))

    @torch.no_grad()
    def download_(self, sources: Sequence[torch.Tensor]) -> None:
        """``views ← sources`` (the layout's live tensors). The caller holds ``dsgd.lock`` (see the module)."""
        assert len(sources) == len(self.views)
        copied = []
        for group in self._groups:
            group_sources = [sources[i] for i in group.indices]
            if not group.on_gpu:
                copy_(group.views, group_sources)
                continue
            side = self.marks.side_stream(group.device)
            with torch.cuda.stream(side):
                side.wait_event(self.marks.mark(group.device))  # the boundary's values, not the next forward's
                if group.last_read is not None:
                    side.wait_event(group.last_read)
                # the sources stay alive and unchanged until the sync below: the caller holds dsgd.lock
                for view, source in zip(group.views, group_sources, strict=True):
                    view.copy_(source, non_blocking=True)
                copied.append(_event_after(side))
        for event in copied:
            event.synchronize()  # this thread waits for the copy only, not for the trainer's stream

    @torch.no_grad()
    def write_(self, sources: Sequence[torch.Tensor]) -> None:
        """``views[:len(sources)] ← sources`` (host tensors), once the device has read the buffers."""
        for group in self._groups:
            count = group.first(len(sources))
            if not count:
                continue
            if group.on_gpu and group.last_read is not None:
                group.last_read.synchronize()
            copy_(group.views[:count], [sources[i] for i in group.indices[:count]])

    def add_to_(self, targets: Sequence[torch.Tensor]) -> None:
        """``targets += views`` (the layout's first ``len(targets)`` tensors, live). Trainer thread, ``dsgd.lock``."""
        self._to_device(targets, add=True)

    def copy_to_(self, targets: Sequence[torch.Tensor]) -> None:
        """``targets ← views`` (the layout's first ``len(targets)`` tensors, live). Trainer thread, ``dsgd.lock``."""
        self._to_device(targets, add=False)

    @torch.no_grad()
    def _to_device(self, targets: Sequence[torch.Tensor], add: bool) -> None:
        for group in self._groups:
            count = group.first(len(targets))
            if not count:
                continue
            group_targets, views = [targets[i] for i in group.indices[:count]], group.views[:count]
            if not group.on_gpu:
                (add_ if add else copy_)(group_targets, views)
                continue
            trainer, side = torch.cuda.current_stream(group.device), self.marks.side_stream(group.device)
            used = sum(view.numel() for view in views)
            with torch.cuda.stream(side):  # allocated on the side stream, so the copy need not wait for the trainer's
                flat = group.flat[:used].to(group.device, non_blocking=True)
                group.last_read = _event_after(side)
            trainer.wait_event(group.last_read)  # the GPU waits, not this thread
            flat.record_stream(trainer)  # freed only once the trainer's stream has used it
            on_device = [
                part.view(view.shape) for part, view in zip(flat.split([v.numel() for v in views]), views, strict=True)
            ]
            if add:
                torch._foreach_add_(group_targets, on_device)
            else:
                torch._foreach_copy_(group_targets, on_device)


class StagingCache:
    """One ``FlatStaging`` for a layout that changes now and then (the served state), made again when it does. Hold
    ``lock`` while using it (after ``dsgd.lock``)."""

    def __init__(self, marks: StepBoundaryMarks):
        self.lock, self.marks = threading.Lock(), marks
        self._staging: FlatStaging | None = None

    def for_layout(self, tensors: Sequence[torch.Tensor]) -> FlatStaging:
        if self._staging is None or self._staging.layout != layout(tensors):
            self._staging = None  # the old buffers go first
            self._staging = FlatStaging(tensors, self.marks)
        return self._staging
