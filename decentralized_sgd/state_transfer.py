"""State transfer: serve our live training state to late joiners (parameters, model buffers, optimizer state, counts
and ``get_extra_state()``, copied under ``dsgd.lock``), and take over a donor's if its model matches ours and
``accept(extra_state)`` agrees (rounds filled before turn stale). A download cut short (hivemind#504) is tried again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch
from hivemind.optim.state_averager import load_optimizer_state
from hivemind.utils import nested_flatten

from .averager import Averager
from .hivemind_fixes import shared_memory_manager_timed_out
from .outer import OuterOptimizer
from .rounds import RoundBook, TrainerState
from .tensors import StagingCache

logger = logging.getLogger(__name__)

SERVE_LOCK_TIMEOUT_S = 10.0
DOWNLOAD_ATTEMPTS = 3  # downloads of a donor's state that arrived cut short (hivemind#504) before we keep our own


class StateTransfer:
    """Serves and loads one peer's training state through ``staging``; ``load`` is given the current averager."""

    def __init__(
        self,
        trainer: TrainerState,
        staging: StagingCache,
        book: RoundBook,
        get_extra_state: Callable[[], dict] | None,
        outer: OuterOptimizer | None = None,
    ):
        self.trainer, self.tensors, self.staging, self.marks = trainer, trainer.tensors, staging, staging.marks
        self.optimizer, self.model = trainer.tensors.optimizer, trainer.tensors.model
        self.book, self.get_extra_state = book, get_extra_state
        self.outer = outer  # reset when a donor's weights replace ours (a joiner's download, a heal)

    def model_buffers(self) -> list[torch.Tensor]:
        return list(self.model.buffers()) if self.model is not None else []

    def serve(self) -> tuple[dict, list[torch.Tensor], None]:
        """hivemind's state-fetching thread: our state as (metadata, tensors, compression infos)."""
        trainer = self.trainer
        if not trainer.lock.acquire(timeout=SERVE_LOCK_TIMEOUT_S):
            raise TimeoutError(f"the trainer held its lock for over {SERVE_LOCK_TIMEOUT_S}s; not serving our state now")
        with contextlib.ExitStack() as staging_held:  # dsgd.lock first, then the staging's, released last
            try:
                opt_metadata, opt_tensors = optimizer_state(self.optimizer)
                params, buffers = self.tensors.params, self.model_buffers()
                served = [*params, *buffers, *opt_tensors]
                staging_held.enter_context(self.staging.lock)
                staging = self.staging.for_layout(served)
                with torch.no_grad():
                    staging.download_(served)
                metadata = dict(
                    local_step=trainer.local_step,
                    samples=trainer.samples,
                    num_params=len(params),
                    num_buffers=len(buffers),
                    optimizer=opt_metadata,
                    extra_state=self.get_extra_state() if self.get_extra_state else {},
                )
            finally:
                trainer.lock.release()
            # hivemind sends what we return (moving it to shared memory): copies, made while the trainer goes on
            tensors = [
                torch.empty_like(t, device="cpu").copy_(view) for t, view in zip(served, staging.views, strict=True)
            ]
        return metadata, tensors, None

    def load(self, averager: Averager, timeout: float, accept: Callable[[dict], bool] | None) -> dict | None:
        """Trainer thread: see DecentralizedSGD.load_state_from_peers."""
        loaded = self._download_whole(averager, timeout)
        if loaded is None:
            return None
        metadata, tensors = loaded
        num_params, num_buffers = metadata["num_params"], metadata["num_buffers"]
        own_params, own_buffers = self.tensors.params, self.model_buffers()
        params, buffers = tensors[:num_params], tensors[num_params : num_params + num_buffers]
        if [p.shape for p in params] != [p.shape for p in own_params] or (
            [b.shape for b in buffers] != [b.shape for b in own_buffers]
        ):
            logger.warning("load_state_from_peers: the peer's model does not match ours, ignoring its state")
            return None
        extra_state = metadata.get("extra_state") or {}
        if accept is not None and not accept(extra_state):
            logger.info("load_state_from_peers: keeping our own state (the peer's was not accepted)")
            return None
        with self.trainer.lock, torch.no_grad():
            opt_metadata, opt_tensors = metadata["optimizer"], tensors[num_params + num_buffers :]
            if not any(self.optimizer.state.values()):
                self.tensors.init_optimizer_state()  # the peer's momentum etc. needs a place to go
            if len(opt_metadata) == len(list(nested_flatten(self.optimizer.state_dict()))):
                load_optimizer_state(self.optimizer, opt_metadata, opt_tensors)
            else:
                logger.warning("load_state_from_peers: optimizer state layout differs, keeping local optimizer state")
            self._take_over_model_tensors([*own_params, *own_buffers], [*params, *buffers])
            self.trainer.took_over(int(metadata["local_step"]), int(metadata["samples"]))
            self.book.state_reloaded(self.trainer.local_step)  # before the outer reset: see OuterOptimizer.step_
            if self.outer is not None:  # the donor's weights are our anchor; its buffer is not ours (see outer)
                self.outer.reset(self.tensors.params)
        return extra_state

    def _download_whole(self, averager: Averager, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """Trainer thread: a donor's (metadata, tensors) with every tensor its metadata lists, or None (logged)."""
        deadline, attempts_left = time.monotonic() + timeout, DOWNLOAD_ATTEMPTS
        while True:
            loaded = self._download(averager, max(0.0, deadline - time.monotonic()))
            if loaded is None:
                return None
            metadata, arrived = loaded[0], len(loaded[1])  # as many tensors as the donor's metadata lists?
            expected = int(metadata["num_params"]) + int(metadata["num_buffers"])
            expected += sum(entry.get("type") == "tensor" for entry in metadata["optimizer"])
            if arrived == expected:
                return loaded
            attempts_left -= 1
            again = attempts_left > 0 and time.monotonic() < deadline
            logger.warning(
                f"load_state_from_peers: the donor's state arrived cut short ({arrived} of {expected} tensors; "
                f"hivemind#504): {'downloading it again' if again else 'keeping our own state'}"
            )
            if not again:
                return None

    @staticmethod
    def _download(averager: Averager, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """Trainer thread: one download with hivemind, or None (logged) if nobody could share or it could not start."""
        try:
            loaded = averager.load_state_from_peers(timeout=timeout)
        except TimeoutError:
            loaded = None
        except RuntimeError as error:
            if not shared_memory_manager_timed_out(error):
                raise
            logger.warning(
                "load_state_from_peers: could not start the download: torch's shared-memory manager did not answer "
                "in time (this machine is overloaded); keeping our own state for now"
            )
            return None
        if loaded is None:
            logger.info(
                "load_state_from_peers: no peer could share its state (peers in --client_mode never do: "
                "README, Behind NAT)"
            )
        return loaded

    def _take_over_model_tensors(self, targets: list[torch.Tensor], loaded: list[torch.Tensor]) -> None:
        """Holding dsgd.lock: ``targets ← loaded`` through the served state's staging, then a new boundary mark."""
        with self.staging.lock:
            staging = self.staging.for_layout([*targets, *optimizer_state(self.optimizer)[1]])
            staging.write_(loaded)
            staging.copy_to_(targets)
        self.marks.record()


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[list[dict], list[torch.Tensor]]:
    """hivemind's ``dump_optimizer_state`` with the live tensors (hivemind's copies each to the CPU, blocking)."""
    metadata, tensors = [], []
    for value in nested_flatten(optimizer.state_dict()):
        if isinstance(value, torch.Tensor):
            metadata.append(dict(type="tensor", index=len(tensors)))
            tensors.append(value)
        else:
            metadata.append(dict(type="value", value=value))
    return metadata, tensors
