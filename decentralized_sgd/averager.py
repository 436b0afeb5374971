"""The averager process: a ``hivemind.DecentralizedAverager`` with the fixes of ``hivemind_fixes`` and
``hivemind_slow_peer_fixes``, and two features.

It serves the trainer's *live* state to late joiners (``get_current_state`` asks the optimizer, which copies under
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
from collections.abc import Callable

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

    def __init__(self, *args, state_fn: Callable[[], tuple], **kwargs):
        self.state_fn = state_fn
        super().__init__(*args, **kwargs)

    def get_current_state(self) -> tuple:
        """Runs in hivemind's state-fetching thread of the trainer's process, when a peer downloads our state."""
        return self.state_fn()
