"""What the VISSL task and hooks may ask of an averager: the one interface both averagers implement.

``decentralized_task.py`` and ``hooks/`` are written against :class:`Averaging`, never against a concrete class,
so that ``--averager old`` (``baselines.old_design.OldDesignAverager``, the benchmarks' baseline) and the default
``decentralized_sgd.DecentralizedSGD`` are interchangeable under the stock VISSL trainer. Before this interface
existed the hooks called whatever ``DecentralizedSGD`` had, and the old design crashed at start and at the first
progress line. ``runtime_checkable``: ``isinstance(averager, Averaging)`` checks that every member is there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from hivemind.p2p import PeerID


@runtime_checkable
class Averaging(Protocol):
    """An optimizer wrapper that averages parameters with a swarm while the trainer steps.

    ``records`` holds one dict per resolved round (at least ``applied``, ``group_size``, ``staleness_steps``,
    ``t_start``, ``t_end``); ``counters`` at least ``rounds_applied`` and ``rounds_failed`` (readers use
    ``.get(key, 0)`` for any other key, e.g. ``averager_failures``).
    """

    lock: threading.RLock  # held while the parameters change (optimizer step, applying a round, serving state)
    counters: dict[str, float]
    records: list[dict]
    needs_lock_for_forward: bool  # True: apply may happen at any time, hold ``lock`` from forward to update
    local_step: int

    @property
    def peer_id(self) -> PeerID: ...

    def on_step_end(self, batch_size: int | None = None) -> int:
        """Called once after every optimizer step, by the training thread, which may hold ``lock`` (re-entrant; the
        VISSL hooks hold it from backward through the end of the update). Returns how many averaging results (rounds,
        or a state taken over from the swarm) changed the parameters since the previous call."""

    def last_applied_record(self) -> dict | None:
        """The newest record with ``applied`` true, or None before the first applied round."""

    def load_state_from_peers(
        self, timeout: float | None = None, accept: Callable[[dict], bool] | None = None
    ) -> dict | None:
        """Take over a peer's parameters (and optimizer state); return its training progress (the VISSL task's
        ``training_progress()`` dict) or None when no progress was taken over: the trainer then keeps its own
        schedule. ``accept(progress)`` false: keep our own state."""

    def shutdown(self) -> None:
        """Leave the swarm; idempotent, returns within a bounded time."""
