"""Host copies of the trainer's tensors, laid out flat: the GPU data path without stalls, which the CPU path shares.

A ``FlatStaging`` holds host copies of a fixed list of tensors (its layout): one flat buffer per tensor group (the
layout's tensors on one device, in one host dtype), allocated once, pinned when the group is on a GPU. ``views``
are the host tensors, shaped like the layout's, in its order. The round results are two of them
(``tensors.ResultSlots``); the state served to late joiners and downloaded from a donor is one more
(``StagingCache``, ``state_transfer``).

On a GPU (a CUDA group):
- the trainer marks its stream at the end of each step boundary, right after the optimizer step and the apply were
  queued (``StepBoundaryMarks.record``, trainer thread, holding ``dsgd.lock``);
- ``download_`` (a fill, or serving our state) copies device → host with ``non_blocking=True`` on a side stream that
  waits on that mark, then synchronises once on the copy's event, in the calling background thread: the trainer's
  stream and the trainer's thread never wait for it. The caller holds ``dsgd.lock`` until it returns, so no
  optimizer step or apply can change the parameters while they are copied;
- ``add_to_`` / ``copy_to_`` (the apply, trainer thread) copy a group's flat buffer host → device in one
  non-blocking copy on the side stream (overlapping the optimizer step still running on the trainer's stream) into
  a transient device buffer of the same size (torch's caching allocator), make the trainer's stream wait for it on
  the GPU, and add it with one ``torch._foreach_add_``. Only a copy that outlasts the optimizer step's kernels
  delays the trainer's stream, by the rest of the copy;
- the host writes into a group's buffer only once the device has finished reading it: ``write_`` waits for the last
  host → device copy out of it; ``download_``'s side stream waits for it on the GPU.
The mark is taken on the stream that is current in the trainer's thread at ``on_step_end()`` / ``step()``: the
optimizer step must run on that stream (it does unless the training loop switches streams around it).

On a CPU (a CPU group) the same methods are plain copies: ``download_`` copies the tensors into the views once,
the apply adds the views in (``tensor_ops.add_``), as many copies as without a staging.

What "a step boundary's values" means. Parameters and optimizer state change only in the optimizer step and the
apply, both under ``dsgd.lock``, before the boundary's mark: a fill (or a serve) takes the lock after the mark and
releases it once its copy has finished, so it copies exactly that boundary's values. BatchNorm running statistics
change during forward, outside the lock: the copy runs while the next forward may run (on a GPU: on the side stream
while the trainer's stream runs forward; on a CPU: in our thread while the trainer's runs forward), so each element
holds its value at the boundary or a later one from the next forward (never an older one). The delta rule still
keeps every local update of them (``b ← b + avg − copy``, element by element); they are just not all from the same
boundary as the parameters.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tensor_ops import add_, copy_


class StepBoundaryMarks:
    """The trainer's step boundaries on each GPU that holds its tensors (an event on that GPU's current stream), and
    the side stream that copies of a boundary's values run on. Without GPU tensors it does nothing."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.devices = list(dict.fromkeys(t.device for t in tensors if t.is_cuda))
        self._marks = {device: torch.cuda.Event() for device in self.devices}
        self._side_streams = {device: torch.cuda.Stream(device) for device in self.devices}
        self.record()  # what the model's construction (or a load) queued counts as the first boundary

    def record(self) -> None:
        """Trainer thread, holding ``dsgd.lock``, at the end of a step boundary (the optimizer step and the apply
        queued) or after anything else changed the tensors (a state download)."""
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
    """The layout's tensors on one device in one host dtype, and their flat host buffer."""

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
    """Host copies of the tensors of one layout (``like``: shapes, devices; ``dtype``: the host dtype, default each
    tensor's own). Its methods are called holding ``dsgd.lock`` (see the module); ``views`` may be read and written
    without it by whoever owns the staging at the time (a round's slot: the scheduler until the round is DONE)."""

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
            if device.type != "cuda":  # shared: a fork (an averager process, data-loader workers) leaves it writable
                flat.share_memory_()  # at full speed (private pages turn copy-on-write: 168 ms for 100 MB, not 5)
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
        """``views[:len(sources)] ← sources`` (host tensors), written by this thread once the device has finished
        reading the buffers."""
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
    """One ``FlatStaging`` for a layout that changes now and then (the served state: optimizer state appears at the
    first step), made again when it does. Hold ``lock`` while using it: ``dsgd.lock`` first, if both."""

    def __init__(self, marks: StepBoundaryMarks):
        self.lock, self.marks = threading.Lock(), marks
        self._staging: FlatStaging | None = None

    def for_layout(self, tensors: Sequence[torch.Tensor]) -> FlatStaging:
        """Holding ``lock``: a staging laid out for ``tensors`` (their own dtypes)."""
        if self._staging is None or self._staging.layout != layout(tensors):
            self._staging = None  # the old buffers go first
            self._staging = FlatStaging(tensors, self.marks)
        return self._staging
