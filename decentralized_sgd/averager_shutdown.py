"""hivemind 1.1.12 work-arounds for the end of an averager process, so that a normal end prints no traceback.

All three run inside the averager's process, from its ``_shutdown`` (``hivemind/averaging/averager.py``), which is
the last thing that process does: a subclass of ``DecentralizedAverager`` (or ``TrainingAverager``) overrides
``_shutdown`` with ``await shut_down_averager(self, timeout)``. Patched in nowhere else: only the averagers of
this example use it, through their subclass.

1. **The last "no longer looking for a group" request reaches the DHT after its sender died.** A round still
   looking for a group at shutdown is destroyed when the process exits; the ``finally`` of
   ``Matchmaking._declare_averager_periodically`` (``hivemind/averaging/matchmaking.py``) then sends a
   ``dht.store`` whose MPFuture carries a reply pipe, which the DHT process must fetch from the sending process
   (multiprocessing's ``resource_sharer``). That process is gone by then, so the DHT's ``_run`` logs
   ``ConnectionResetError: [Errno 104] Connection reset by peer`` with a traceback (``hivemind/dht/dht.py``) and
   drops the request (harmless: the declaration expires on its own, but a user reads it as a crash). Fix: cancel
   the step that is looking for a group and wait (bounded) until matchmaking has let go of its lock: by then its
   last request has been answered, while the process is still alive. (DecentralizedSGD cancels its rounds from
   the trainer before it shuts its averager down; the old design's ``TrainingAverager.step`` gives the trainer no
   handle on its step, so the cancel comes from here.) Upstream: none found (hivemind#357 made the search await
   that withdrawal); still so on hivemind's master (4bd43b7).
2. **``_shutdown`` crashes on a running AllReduce.** hivemind 1.1.12 calls ``.finalize()`` on the asyncio
   Futures of ``_running_groups`` instead of on the AllReduce runners they hold (``AttributeError`` and a
   traceback in the averager process). Fix: finalize the runners. Upstream: none found; the regression came with
   hivemind#432 (``_running_groups`` became Futures of runners); still so on hivemind's master (4bd43b7).
3. **``_shutdown`` crashes when the p2p daemon is gone.** Ctrl-C in a terminal reaches the whole process group,
   the DHT's p2p daemon included, which exits at once; hivemind's ``remove_p2p_handlers`` then cannot reach its
   control socket (``FileNotFoundError`` and a traceback, ``hivemind/p2p/p2p_daemon_bindings/control.py``). With
   the daemon gone there is nothing to remove: say so at debug level. Upstream: none found (the call came with
   hivemind#501); still so on hivemind's master (4bd43b7).

What hivemind still prints, harmless: a peer that leaves during an AllReduce makes hivemind log, at WARN and
without a traceback, ``Reducer: received 51.0% of input tensors`` / ``Averaging: received 47.7% results``
(``hivemind/averaging/partition.py``), on itself and on its groupmates: that one round fails (it is counted in
``rounds_failed``) and the next one forms without the peer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from typing import Any

from hivemind.averaging.control import StepControl
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.mpfuture import MPFuture

logger = logging.getLogger(__name__)

LEAVE_POLL_S = 0.01


def cancel_step(control: StepControl) -> None:
    """Cancel a step from inside the averager's process.

    Not ``StepControl.cancel()``: called outside the process that made the step, it sets the step's cancel future
    here and then again in that process, which fails there (InvalidStateError, with a traceback). MPFuture.cancel
    asks that process to cancel the step, as a trainer's own ``cancel()`` would. Upstream: none found (the order
    came with hivemind#411); still so on hivemind's master (4bd43b7)."""
    if not control.done():
        MPFuture.cancel(control)


async def leave_matchmaking(averager: Any, timeout: float) -> bool:
    """Cancel every step that looks for a group (one at a time holds matchmaking's lock; queued ones follow) until
    none does; True if matchmaking is idle within ``timeout`` seconds."""
    matchmaking = getattr(averager, "_matchmaking", None)  # None: the averager never finished starting
    if matchmaking is None:
        return True
    deadline = time.monotonic() + timeout
    while matchmaking.is_looking_for_group:
        if time.monotonic() >= deadline:
            return False
        if matchmaking.step_control is not None:
            cancel_step(matchmaking.step_control)
        await asyncio.sleep(LEAVE_POLL_S)
    return True


async def shut_down_averager(
    averager: Any,
    timeout: float | None,
    steps: Collection[StepControl] = (),
    dht_requests: Collection[asyncio.Task] = (),
) -> None:
    """The body of ``DecentralizedAverager._shutdown``, without the problems 2 and 3 above. ``timeout`` is the
    averager's ``shutdown_timeout``, after which its owner terminates the process: this takes at most 80% of it
    (leaving matchmaking waits for one DHT request, which can take seconds on a busy machine).

    ``steps``: the live set of steps in flight (the averager's ``_step`` adds and discards them), for an owner that
    cannot cancel its steps itself. Cancelled here until none is left: a step whose AllReduce failed retries, and
    one the owner started just before it shut the averager down arrives late; both would look for a group again
    after we left matchmaking.

    ``dht_requests``: the live set of DHT requests the averager sent without waiting for them (its matchmaking
    declarations, see ``hivemind_slow_peer_fixes``); waited for after leaving matchmaking, whose last withdrawal is
    one of them, for the same reason as 1: each must reach the DHT while this process lives."""
    deadline = time.monotonic() + 0.8 * (timeout if timeout is not None else averager.shutdown_timeout)
    if not averager.client_mode:
        try:
            await averager.remove_p2p_handlers(averager._p2p, namespace=averager.prefix)
        except (OSError, P2PDaemonError) as error:  # 3: the daemon exited first (Ctrl-C), its handlers with it
            logger.debug(f"p2p daemon gone before the averager's handlers were removed: {error!r}")
    while True:
        for control in list(steps):
            cancel_step(control)
        idle = await leave_matchmaking(averager, max(0.0, deadline - time.monotonic()))
        for future in averager._running_groups.values():
            if future.done() and not future.cancelled():
                future.result().finalize(cancel=True)
        if (idle and not steps) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(LEAVE_POLL_S)
    if dht_requests:
        await asyncio.wait(list(dht_requests), timeout=max(0.0, deadline - time.monotonic()))
