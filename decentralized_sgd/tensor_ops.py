"""The few bulk operations on lists of tensors that the fill, the update and the apply share: one fused
``torch._foreach`` op where devices and dtypes allow it, else a loop. Apart from ``tensors`` and ``staging`` so that
both can use them without importing each other."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
