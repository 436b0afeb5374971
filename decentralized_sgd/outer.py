"""An outer optimizer on the averaged progress (SlowMo, Wang et al. ICLR 2020, arXiv 1910.00643; DiLoCo's outer
Nesterov, arXiv 2311.08105), per peer, with the delta rule kept.

Why per peer: there is no global outer step in a gossip swarm. Each peer keeps its own *anchor* ``x`` (where its
parameters were put by its last applied round, without the local steps that rode on top of it) and its own momentum
buffer ``u``. When a round averages the group's snapshots to ``m``::

    d = x − m                       the progress the group made from our anchor (a pseudo-gradient)
    u ← b·u + d
    step = a·u                      (SlowMo)   or   a·(d + b·u)   (Nesterov)
    x ← x − step                    the new anchor
    update = x − snapshot           what the delta rule adds at the next step boundary (``w ← w + update``)

With ``a = 1, b = 0`` the new anchor is ``m`` and the update is the plain delta rule's ``m − snapshot``. The local
steps made since the snapshot (during the AllReduce) ride on top of the new anchor, and are counted in the next
round's ``d``: the next snapshot is ``x + (local steps since this snapshot)``. So every local step enters exactly
one pseudo-gradient.

Only the parameters get the outer step (the first ``len(anchor)`` averaged tensors); BatchNorm statistics and
averaged optimizer state keep the plain update. Memory: the anchor and the buffer, two fp32 host copies of the
parameters (about 200 MB for ResNet-50), plus one transient copy per round.

Who calls what: ``step_`` runs in the scheduler thread while it owns the round's slot and the averager's buffers
(``exchange.finish``), once per round that is applied, in the order the rounds finish (which is the order their
updates are applied: the next round's snapshot already holds this round's update, see ``exchange``). ``reset``
runs under ``dsgd.lock`` when our parameters are replaced wholesale (a state download, a heal, a checkpoint load
without outer state): the buffer restarts at zero, since it described the progress from an anchor we no longer
have. ``state_dict`` / ``load_state_dict`` (under ``dsgd.lock``) carry both into checkpoints.
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
        self,
        update: Sequence[torch.Tensor],
        averaged: Sequence[torch.Tensor],
        skip: Callable[[], bool] | None = None,
    ) -> float | None:
        """``update`` (the slot, holding ``m − snapshot``) ← ``x_new − snapshot``, for the first ``len(anchor)``
        tensors; ``averaged``: the group's mean ``m``. Returns the norm of the outer step ``x − x_new``, or None if
        ``skip()`` (asked while holding our lock) says the round no longer counts: our parameters were replaced
        since its snapshot. A replacement marks the round stale before it calls ``reset``, so a step either sees
        the mark or runs before the reset, which then overwrites it."""
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
            return {
                "settings": vars(self.settings).copy(),
                "anchor": [t.clone() for t in self.anchor],
                "buffer": [t.clone() for t in self.buffer],
                "steps": self.steps,
            }

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
