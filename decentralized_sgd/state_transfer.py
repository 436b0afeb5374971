"""State transfer: serve our live training state to peers that join late, and take over a donor's.

Served: the parameters, all of the model's buffers, the optimizer's state and hyperparameters (hivemind's
``dump_optimizer_state``), ``local_step``, ``samples`` and the caller's progress (``get_extra_state``, e.g. VISSL's
iteration), copied under ``dsgd.lock`` so that a joiner never gets half an update. hivemind asks for it from its
state-fetching thread in our process; that thread waits for the lock at most ``SERVE_LOCK_TIMEOUT_S`` (then the
joiner's download from us fails and hivemind tries the next donor).

Loaded (``load_state_from_peers``): only if the donor's model matches ours and ``accept(extra_state)`` agrees;
under ``dsgd.lock``, with every round whose values went in before marked stale (its update is against the old
parameters: it is discarded when it ends).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from hivemind.optim.state_averager import dump_optimizer_state, load_optimizer_state
from hivemind.utils import nested_flatten

from .rounds import RoundState as S

if TYPE_CHECKING:
    from .optimizer import DecentralizedSGD

logger = logging.getLogger(__name__)

SERVE_LOCK_TIMEOUT_S = 10.0


def current_state(owner: DecentralizedSGD) -> tuple[dict, list[torch.Tensor], None]:
    """hivemind's state-fetching thread: our state as (metadata, tensors, compression infos)."""
    if not owner.lock.acquire(timeout=SERVE_LOCK_TIMEOUT_S):
        raise TimeoutError(f"the trainer held its lock for over {SERVE_LOCK_TIMEOUT_S}s; not serving our state now")
    try:
        with torch.no_grad():
            params = [p.detach().to("cpu", copy=True) for p in owner.averaged_tensors.params]
            buffers = [b.detach().to("cpu", copy=True) for b in (owner.model.buffers() if owner.model else ())]
            opt_metadata, opt_tensors = dump_optimizer_state(owner.optimizer)
            opt_tensors = [t.clone() for t in opt_tensors]
        metadata = dict(
            local_step=owner.local_step, samples=owner.samples, num_params=len(params), num_buffers=len(buffers),
            optimizer=opt_metadata, extra_state=owner.get_extra_state() if owner.get_extra_state else {},
        )  # fmt: skip
    finally:
        owner.lock.release()
    return metadata, params + buffers + opt_tensors, None


def load_state_from_peers(owner: DecentralizedSGD, timeout: float, accept: Callable[[dict], bool] | None
                          ) -> dict | None:  # fmt: skip
    """Trainer thread: download a donor's state and take it over; see DecentralizedSGD.load_state_from_peers."""
    try:
        loaded = owner.averager.load_state_from_peers(timeout=timeout)
    except TimeoutError:
        loaded = None
    if loaded is None:
        logger.info("load_state_from_peers: no peer could share its state")
        return None
    metadata, tensors = loaded
    num_params, num_buffers = metadata["num_params"], metadata["num_buffers"]
    own_params = owner.averaged_tensors.params
    own_buffers = list(owner.model.buffers()) if owner.model is not None else []
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
    with owner.lock, torch.no_grad():
        opt_metadata, opt_tensors = metadata["optimizer"], tensors[num_params + num_buffers :]
        if not any(owner.optimizer.state.values()):
            owner.averaged_tensors.init_optimizer_state()  # the peer's momentum etc. needs a place to go
        if len(opt_metadata) == len(list(nested_flatten(owner.optimizer.state_dict()))):
            load_optimizer_state(owner.optimizer, opt_metadata, opt_tensors)
        else:
            logger.warning("load_state_from_peers: optimizer state layout differs, keeping local optimizer state")
        for local, loaded_tensor in zip(own_params + own_buffers, params + buffers, strict=True):
            local.copy_(loaded_tensor)
        owner.took_over_state(int(metadata["local_step"]), int(metadata["samples"]))
        _mark_rounds_stale(owner)
    return extra_state


def _mark_rounds_stale(owner: DecentralizedSGD) -> None:
    """Holding dsgd.lock: a waiting update is dropped now, a round in the AllReduce when it ends."""
    book = owner.round_book
    with book.lock:
        for r in book.rounds:
            if r.state is S.DONE:
                r.discard("state reloaded since snapshot")
            elif r.state in (S.FILLED, S.TRIGGERED):
                r.stale = True
        book.retire(owner.local_step, owner.peer)
