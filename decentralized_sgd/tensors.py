"""The tensors a peer averages, where finished results wait, and the few bulk operations on them.

What is averaged, in this order: the optimizer's parameters (fixed objects), the model's float buffers (looked up
by name: BatchNorm statistics), and param-shaped optimizer state (looked up by parameter and key:
``optimizer.load_state_dict`` replaces those tensors). The averager keeps fp32 CPU copies in its buffers.

Results wait in ``ResultSlots``, outside the averager's buffers: a finished round's update (``averaged −
snapshot``) must wait for the trainer's next step boundary, while the next round reuses the buffers at once. A slot
holds a round's snapshot from its fill, then its update, until the trainer applied it; two slots suffice because
at most one round runs an AllReduce while at most one older result waits (the scheduler starts no round that would
need a third). A slot is the ``views`` of a ``staging.FlatStaging`` (fp32, one flat buffer per device, pinned for a
GPU): the fill copies the trainer's tensors into it, the apply adds it back (see ``staging``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from hivemind.optim.state_averager import initialize_optimizer_state_

if TYPE_CHECKING:
    from .staging import FlatStaging


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
        """One pass per tensor, one sync: an L2 norm is nan/inf iff an element is (or exceeds ~1e19, whose square
        overflows: no trained weight is that large, so it is rejected too). ~15x faster than isfinite or max |x|."""
        tensors = [t for t in tensors if t.numel() > 0]
        if not tensors:
            return True
        return bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all())

    @staticmethod
    def norm(tensors: Sequence[torch.Tensor]) -> float:
        """The L2 norm of all of them together, in the same pass and sync as ``all_finite``: inf or nan iff that says
        not finite (the update check of ``vetting`` needs the size of an update that is checked for finiteness)."""
        tensors = [t for t in tensors if t.numel() > 0]
        if not tensors:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)).double()))


class ResultSlots:
    """Two preallocated sets of fp32 host tensors (``make()``: a staging for the averaged tensors); a round takes
    one at its fill and gives it back when retired."""

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
