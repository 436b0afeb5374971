"""The flat host staging on the CPU: its layout, and every copy through it (the GPU path shares the structure)."""

from __future__ import annotations

import os

import pytest
import torch

from decentralized_sgd.tensors import FlatStaging, StagingCache, StepBoundaryMarks


def mixed_tensors() -> list[torch.Tensor]:
    """What a model and its optimizer hold: fp32 weights, an fp16 one, an int64 counter, a 0-dim step."""
    torch.manual_seed(0)
    return [
        torch.randn(3, 4),
        torch.randn(5).half(),
        torch.tensor([7, 8], dtype=torch.int64),
        torch.randn(2, 2),
        torch.tensor(3.0),
    ]


@pytest.mark.timeout(30)
def test_views_are_laid_out_flat_per_group_and_round_trip() -> None:
    tensors, marks = mixed_tensors(), StepBoundaryMarks(mixed_tensors())
    assert marks.devices == []  # on a CPU nothing is marked
    own = FlatStaging(tensors, marks)  # own dtypes: one flat buffer per dtype
    assert [(v.shape, v.dtype) for v in own.views] == [(t.shape, t.dtype) for t in tensors]
    fp32 = [v for v, t in zip(own.views, tensors, strict=True) if t.dtype == torch.float32]
    assert len({v.untyped_storage().data_ptr() for v in fp32}) == 1  # the fp32 tensors share one buffer...
    assert fp32[1].data_ptr() == fp32[0].data_ptr() + 4 * fp32[0].numel()  # ...back to back, in layout order

    own.download_(tensors)
    assert all(torch.equal(v, t) for v, t in zip(own.views, tensors, strict=True))
    assert all(v.data_ptr() != t.data_ptr() for v, t in zip(own.views, tensors, strict=True))  # copies
    targets = [torch.zeros_like(t) for t in tensors]
    own.copy_to_(targets)
    assert all(torch.equal(a, t) for a, t in zip(targets, tensors, strict=True))

    slot = FlatStaging(tensors, marks, torch.float32)  # a round's slot: fp32 host copies of everything
    assert {v.dtype for v in slot.views} == {torch.float32}
    assert len({v.untyped_storage().data_ptr() for v in slot.views}) == 1
    slot.download_(tensors)
    slot.add_to_(targets)  # targets = 2 x tensors, each in its own dtype
    assert all(
        a.dtype == t.dtype and torch.allclose(a.double(), 2 * t.double(), atol=1e-2)
        for a, t in zip(targets, tensors, strict=True)
    )


@pytest.mark.timeout(30)
def test_host_buffers_are_shared_so_a_fork_does_not_make_them_copy_on_write() -> None:
    """The averager process is a fork of the trainer's (so are data-loader workers): private pages turn
    copy-on-write, and the first fill into a 100 MB slot after a fork took 168 ms instead of 5. Shared pages do not."""
    tensors = mixed_tensors()
    slot = FlatStaging(tensors, StepBoundaryMarks(tensors), torch.float32)
    assert all(view.is_shared() for view in slot.views)
    child = os.fork()
    if child == 0:  # the child writes into the buffer too: the parent must see it (the same pages, not a copy)
        slot.views[0].fill_(42.0)
        os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    assert torch.equal(slot.views[0], torch.full_like(slot.views[0], 42.0))


@pytest.mark.timeout(30)
def test_a_download_writes_and_copies_the_first_tensors_of_the_layout_only() -> None:
    tensors = mixed_tensors()
    staging = FlatStaging(tensors, StepBoundaryMarks(tensors))
    staging.download_(tensors)
    loaded = [-t for t in tensors[:3]]  # a donor's params and buffers; the optimizer's tensors come after them
    staging.write_(loaded)
    targets = [t.clone() for t in tensors]
    staging.copy_to_(targets[:3])
    assert all(torch.equal(a, b) for a, b in zip(targets[:3], loaded, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(targets[3:], tensors[3:], strict=True))  # untouched
    assert torch.equal(staging.views[3], tensors[3])


@pytest.mark.timeout(30)
def test_the_state_staging_is_made_again_only_when_the_layout_changes() -> None:
    tensors = mixed_tensors()
    cache = StagingCache(StepBoundaryMarks(tensors))
    with cache.lock:
        first = cache.for_layout(tensors)
        assert cache.for_layout([t.clone() for t in tensors]) is first  # same shapes and dtypes: same buffers
        grown = cache.for_layout([*tensors, torch.zeros(6)])  # e.g. momentum appeared at the first step
    assert grown is not first and grown.views[-1].shape == (6,)
