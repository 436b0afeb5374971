"""An outer optimizer on the averaged progress (SlowMo, arXiv 1910.00643; DiLoCo's outer Nesterov, arXiv
2311.08105), per peer (a gossip swarm has no global outer step), on the parameters. Each peer keeps its anchor ``x``
(as its last applied round left it) and momentum ``u``; a round that averages the group's snapshots to ``m``::

    d = x − m;  u ← b·u + d;  step = a·u (SlowMo) or a·(d + b·u) (Nesterov);  x ← x − step;  update = x − snapshot

``a = 1, b = 0`` is the plain delta rule; local steps since the snapshot enter the next round's ``d``. ``reset``
when our parameters are replaced wholesale (the buffer described progress from a lost anchor).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OuterSettings:
    """``momentum`` b in [0, 1), ``lr`` a > 0, ``nesterov``: DiLoCo's form of the step. b = 0, a = 1: off."""

    momentum: float = 0.0
    lr: float = 1.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(
                f"outer_momentum must be in [0, 1) (0: no outer momentum; SlowMo used 0.5-0.7), got {self.momentum}"
            )
        if not self.lr > 0.0:
            raise ValueError(f"outer_lr must be > 0 (1: the plain average), got {self.lr}")

    @property
    def enabled(self) -> bool:
        return self.momentum != 0.0 or self.lr != 1.0


class OuterOptimizer:
    """One peer's anchor and momentum buffer (fp32 host tensors shaped like the parameters)."""

    def __init__(self, settings: OuterSettings, params: Sequence[torch.Tensor]):
        self.settings = settings
        self.lock = threading.Lock()  # step_ (scheduler) vs reset / state_dict (trainer or a loading thread)
        self.anchor = [torch.empty(p.shape, dtype=torch.float32) for p in params]
        self.buffer = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
        self.steps = 0
        self.reset(params)

    @torch.no_grad()
    def reset(self, params: Sequence[torch.Tensor]) -> None:
        """Our parameters were replaced (start, state download, heal): they are the anchor, the buffer restarts."""
        with self.lock:
            for anchor, p in zip(self.anchor, params, strict=True):
                anchor.copy_(p.detach())
            torch._foreach_zero_(self.buffer)

    @torch.no_grad()
    def step_(
        self, update: Sequence[torch.Tensor], averaged: Sequence[torch.Tensor], skip: Callable[[], bool] | None = None
    ) -> float | None:
        """``update`` (``m − snapshot``) ← ``x_new − snapshot``; returns the outer step's norm, or None if ``skip()``
        (asked under our lock: a replacement marks the round stale before its ``reset``) says the round is stale."""
        b, a = self.settings.momentum, self.settings.lr
        count = len(self.anchor)
        update, averaged = list(update[:count]), list(averaged[:count])
        with self.lock:
            if skip is not None and skip():
                return None
            progress = torch._foreach_sub(self.anchor, averaged)  # d = x − m
            torch._foreach_mul_(self.buffer, b)
            torch._foreach_add_(self.buffer, progress)  # u ← b·u + d
            if self.settings.nesterov:
                step = torch._foreach_add(progress, self.buffer, alpha=b)  # d + b·u
                torch._foreach_mul_(step, a)
            else:
                step = torch._foreach_mul(self.buffer, a)  # a·u
            # update = x_new − s = (m − s) + (x − m) − step = update + d − step
            torch._foreach_add_(update, progress)
            torch._foreach_sub_(update, step)
            torch._foreach_sub_(self.anchor, step)  # x ← x − step
            self.steps += 1
            return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(step)).double()))

    def state_dict(self) -> dict:
        with self.lock:
            anchor, buffer = [t.clone() for t in self.anchor], [t.clone() for t in self.buffer]
            return {"settings": vars(self.settings).copy(), "anchor": anchor, "buffer": buffer, "steps": self.steps}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's anchor and buffer. Shapes must match ours (the same model)."""
        shapes = [tuple(t.shape) for t in self.anchor]
        loaded = [tuple(t.shape) for t in state["anchor"]]
        if loaded != shapes or [tuple(t.shape) for t in state["buffer"]] != shapes:
            raise ValueError(
                "the checkpoint's outer-optimizer state does not match this model's parameters "
                f"({len(loaded)} tensors vs {len(shapes)}): was it saved by another model or config?"
            )
        with self.lock:
            torch._foreach_copy_(self.anchor, [t.float() for t in state["anchor"]])
            torch._foreach_copy_(self.buffer, [t.float() for t in state["buffer"]])
            self.steps = int(state.get("steps", 0))
