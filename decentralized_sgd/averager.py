"""The averager process: a ``hivemind.DecentralizedAverager`` with the fixes of ``hivemind_fixes`` and
``hivemind_slow_peer_fixes``, and two features.

It stamps when its AllReduce began and ended (``allreduce_stamps``), in shared memory the trainer's process reads:
the scheduler sees hivemind's stage only at its next tick, so its own times would shorten every AllReduce by up to
a tick and add that to our overhead in the staleness. It also stamps when the latest groupmate's part that
it had to refuse arrived (``early_part_refused_at``): a group we were too late to trigger, whose groupmates dropped us.

It serves the trainer's *live* state to late joiners (``get_current_state`` asks ``state_transfer``, which copies under
its lock) instead of hivemind's default, the averager's buffers, which hold whatever the last round left there.
And it guards its groups (``guard.GroupGuard``): outsiders and recent outliers are refused at matchmaking, a group's
outliers are left out of its AllReduce.

Why not ``hivemind.optim.TrainingStateAverager(delta_rule_averaging=True)``, which implements the delta rule too:
it takes over the optimizer (it runs ``optimizer.step()`` in its own executor, where VISSL steps LARC/AMP itself),
runs one round at a time (its executor thread holds ``lock_averaging`` from the trigger to the end of the AllReduce,
so the next matchmaking cannot overlap it), fills the buffers when the caller asks for a round rather than when the
group has formed, clones the snapshot on every round, never checks that values are finite, and serves state under
the averager's buffer lock (a late joiner then waits for a whole AllReduce). What it shares with us we reuse:
``dump_optimizer_state`` / ``load_optimizer_state`` / ``initialize_optimizer_state_`` (``state_transfer``).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import multiprocessing.sharedctypes
import time
from collections.abc import Callable
from typing import Any

import torch

from .guard import GroupGuard
from .hivemind_fixes import HivemindFixes
from .hivemind_slow_peer_fixes import SlowPeerFixes


def handler_address_slot() -> multiprocessing.sharedctypes.SynchronizedArray:
    """Shared memory for the address an averager registers its handlers from (see HivemindFixes.add_p2p_handlers);
    one per peer, handed to each averager it starts."""
    return mp.Array(ctypes.c_char, 1024)


class Averager(SlowPeerFixes, GroupGuard, HivemindFixes):
    """Our averager: hivemind's, fixed, guarding its groups, serving ``state_fn()`` (``(metadata, tensors, infos)``)
    to joiners."""

    _rpc_handlers = None  # part of the wire protocol: handler names are "<prefix>::Averager.rpc_..."
    _stub_type = None

    def __init__(self, *args, state_fn: Callable[[], tuple] | None = None, **kwargs):
        self.state_fn = state_fn
        # wall-clock stamps the averager process writes, the trainer's reads: [AllReduce began, ended, refused part]
        self._stamps = torch.zeros(3, dtype=torch.float64).share_memory_()
        super().__init__(*args, **kwargs)

    def allreduce_stamps(self) -> tuple[float, float]:
        """Trainer's process: (began, ended) of the latest AllReduce; ended < began while it runs."""
        began, ended = self._stamps[:2].tolist()
        return began, ended

    def early_part_refused_at(self) -> float:
        """Trainer's process: when (time.time()) the latest groupmate's part that we refused arrived; 0.0: none."""
        return float(self._stamps[2])

    def early_part_refused(self, arrived: float) -> None:
        """Averager process (see HivemindFixes.rpc_aggregate_part): keep the latest arrival."""
        self._stamps[2] = max(arrived, float(self._stamps[2]))

    async def _allreduce(self, *args: Any, **kwargs: Any) -> Any:
        """Averager process: an AllReduce runs (not for a group the guard refused: it runs none)."""
        self._stamps[0] = time.time()
        try:
            return await super()._allreduce(*args, **kwargs)
        finally:
            self._stamps[1] = time.time()

    def get_current_state(self) -> tuple:
        """Runs in hivemind's state-fetching thread of the trainer's process, when a peer downloads our state."""
        return self.state_fn() if self.state_fn is not None else super().get_current_state()
