"""What hivemind's own averagers need to run as the benchmarks' baselines (``old_design``, ``hivemind_optimizer``).

- ``ServesStateAsCopies``: hivemind's ``TrainingAverager`` and ``TrainingStateAverager`` serve their *live* tensors
  (averaging/averager.py, ``_background_thread_fetch_current_state``: ``.cpu().detach()`` is a view of a CPU
  tensor). Pickled through a multiprocessing pipe, torch moves each CPU tensor's storage into shared memory in
  place (``torch.multiprocessing.reductions.reduce_storage``): the first state download moves every parameter and
  momentum buffer from hivemind's thread while the trainer may run a kernel on it, which then writes into freed
  memory (a corrupted heap). Serve copies. Our ``StateTransfer.serve`` already does. PR to file:
  "DecentralizedAverager: serve copies of CPU tensors" (a few lines).
- ``keep_ctrl_c``: averager.py, ``run_in_background`` sets SIGINT to SIG_IGN in the *calling* process (so that its
  child inherits it; hivemind#530): afterwards Ctrl-C no longer stops the trainer. Restore the handler. Our
  averager ignores SIGINT in its own process instead. PR to file: "run_in_background: ignore SIGINT in the child".
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import torch


def served_as_copies(state: tuple) -> tuple:
    """A ``get_current_state`` result whose tensors are copies (taken without the trainer's lock, as hivemind reads)."""
    metadata, tensors, *rest = state
    with torch.no_grad():
        copies = [tensor.detach().clone() for tensor in tensors]
    return (metadata, copies, *rest)


class ServesStateAsCopies:
    """Mixin put before the hivemind averager class: ``get_current_state`` returns copies (hivemind's serving
    thread, in the trainer's process)."""

    def get_current_state(self) -> tuple:
        return served_as_copies(super().get_current_state())  # type: ignore[misc]


@contextlib.contextmanager
def keep_ctrl_c() -> Iterator[None]:
    """Around the creation of a hivemind averager with ``start=True``: the caller's SIGINT handler is kept."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
