"""Every N steps, publish this peer's progress into the DHT, where run_monitor.py shows the whole swarm."""

from __future__ import annotations

import logging
import time
from typing import Any

from classy_vision.hooks import ClassyHook
from hivemind.utils import get_dht_time

from hooks.samples_per_second import SamplesPerSecond
from vissl_swarm.averaging_protocol import Averaging
from vissl_swarm.swarm_metrics import make_record, metrics_key, metrics_validators, owner_subkey


class PublishProgressOnStepHook(ClassyHook):
    """Stores a signed :class:`swarm_metrics.PeerMetrics` under ``<run_id>_metrics`` / this peer's public key.

    Only the peer that is in the swarm publishes (local rank 0, ``task.decentralized_sgd`` set). The store is
    fire-and-forget: the trainer never waits for the DHT, a store still in flight is not stacked up behind, and
    a DHT failure is a warning, never an exception in training. Records expire (``expiration_s``, longer if
    publishing is slower), so a peer that dies drops out of the monitor on its own.
    """

    on_phase_start = ClassyHook._noop
    on_forward = ClassyHook._noop
    on_loss_and_meter = ClassyHook._noop
    on_backward = ClassyHook._noop
    on_update = ClassyHook._noop
    on_phase_end = ClassyHook._noop
    on_end = ClassyHook._noop
    on_exception = ClassyHook._noop

    def __init__(self, publish_every: int = 10, expiration_s: float = 60.0) -> None:
        super().__init__()
        self.publish_every = max(1, publish_every)
        self.expiration_s = expiration_s
        self._key: str | None = None
        self._subkey: bytes | None = None
        self._peer_id = ""
        self._pending: Any = None  # the MPFuture of the last store
        self._rate = SamplesPerSecond()
        self._warned = False
        self._started = time.time()  # no_group_s counts from here until the first applied round

    def on_start(self, task) -> None:
        if getattr(task, "decentralized_sgd", None) is None or getattr(task, "dht", None) is None:
            return
        run_id = task.swarm_settings.run_id
        try:
            # the DHT signs our records only with a signing validator for our key: make sure it has one (a no-op
            # if run_trainer.py added the same validators when it started the DHT)
            task.dht.add_validators(metrics_validators(run_id))
        except Exception as error:  # a broken DHT must not stop training
            logging.warning(f"Not publishing progress to the swarm monitor: {error!r}")
            return
        self._key, self._subkey = metrics_key(run_id), owner_subkey()
        self._peer_id = str(task.dht.peer_id)  # asks the DHT process once; on_step never waits for it
        self._rate.start(task.iteration)
        self._started = time.time()

    def on_step(self, task) -> None:
        if self._key is None or not task.train or task.iteration % self.publish_every != 0:
            return
        if getattr(task, "decentralized_sgd", None) is None:  # left the swarm (end of training)
            return
        if self._pending is not None and not self._check_pending():
            return  # the previous store is still in flight: skip this one rather than queue behind it
        try:
            record, interval = self._record(task)
            expiration = get_dht_time() + max(self.expiration_s, 3 * interval)
            self._pending = task.dht.store(
                self._key, record, expiration_time=expiration, subkey=self._subkey, return_future=True
            )
        except Exception as error:
            self._warn(f"could not publish progress to the DHT: {error!r}")

    def _record(self, task) -> tuple[dict, float]:
        samples_per_s, interval = self._rate.update(task.iteration, task.get_global_batchsize())
        optimizer: Averaging = task.decentralized_sgd
        last = optimizer.last_applied_record() or {}
        loss = getattr(task.last_batch, "loss", None) if task.last_batch is not None else None
        record = make_record(
            step=task.iteration,
            samples_per_s=samples_per_s,
            loss=None if loss is None else float(loss.item()),
            group_size=last.get("group_size"),
            staleness_steps=last.get("staleness_steps"),
            rounds_ok=optimizer.counters["rounds_applied"],
            rounds_failed=optimizer.counters["rounds_failed"],
            averager_failures=optimizer.counters.get("averager_failures", 0),
            time=time.time(),
            peer_id=self._peer_id,
            no_group_s=time.time() - (last.get("t_end") or self._started),
        )
        return record, interval

    def _check_pending(self) -> bool:
        """True when the last store is finished (a failure is logged); False while it is still in flight."""
        if not self._pending.done():
            return False
        try:
            stored = self._pending.result()
        except Exception as error:
            self._warn(f"publishing progress to the DHT failed: {error!r}")
        else:
            if stored:
                self._warned = False
            else:
                self._warn(
                    "the DHT rejected our progress record (do all peers and the monitor add "
                    "swarm_metrics.metrics_validators to their DHT?)"
                )
        self._pending = None
        return True

    def _warn(self, message: str) -> None:
        """Once per streak of failures: a swarm that is down for an hour should not flood the log."""
        if not self._warned:
            logging.warning(message)
            self._warned = True
