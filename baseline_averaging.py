"""The old design, kept only as the baseline of the benchmarks: hivemind's ``TrainingAverager`` driven the way the
old hivemind DecentralizedSGD drove it.

A background thread loops ``TrainingAverager.step(data_lock=lock)``: one round at a time, the snapshot is taken
*before* matchmaking, the result is applied with the delta rule under the lock. The trainer must hold ``lock``
from before its forward pass until after its optimizer step (an in-place apply between forward and backward
would break autograd), so ``needs_lock_for_forward`` is True. Same interface as ``DecentralizedSGD`` where the
VISSL hooks touch it: ``on_step_end``, ``lock``, ``records``, ``counters``, ``peer_id``, ``shutdown``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import hivemind
import torch
from hivemind.optim.training_averager import TrainingAverager

from decentralized_sgd import make_compression, schema_fingerprint

logger = logging.getLogger(__name__)


class _StampedLock:
    """The data lock handed to TrainingAverager; remembers the local step at each acquisition (snapshot, apply)."""

    def __init__(self, lock: threading.RLock, owner: OldDesignAverager) -> None:
        self.lock, self.owner, self.steps = lock, owner, []

    def __enter__(self) -> _StampedLock:
        self.lock.acquire()
        self.steps.append(self.owner.local_step)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.lock.release()


class OldDesignAverager:
    """TrainingAverager + a background thread: the pre-DecentralizedSGD way of averaging."""

    needs_lock_for_forward = True

    def __init__(self, optimizer: torch.optim.Optimizer, dht: hivemind.DHT, *, prefix: str,
                 model: torch.nn.Module | None = None, target_group_size: int = 4, min_matchmaking_time: float = 5.0,
                 request_timeout: float = 3.0, allreduce_timeout: float = 60.0, next_chunk_timeout: float = 10.0,
                 compression: str = "none", records_path: str | None = None, **_ignored: Any) -> None:
        self.dht, self.records_path = dht, records_path
        self.lock = threading.RLock()
        self.local_step = 0
        self.records: list[dict] = []
        self.counters: dict[str, float] = {"rounds_applied": 0, "rounds_failed": 0}
        buffers = [b for b in (model.buffers() if model is not None else ()) if b.is_floating_point()]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.averager = TrainingAverager(
            optimizer, average_parameters=True, average_gradients=False, extra_tensors=buffers,
            initialize_optimizer=False, dht=dht, prefix=f"{prefix}_old_{schema_fingerprint(params + buffers)}",
            start=True, target_group_size=target_group_size, min_group_size=2,
            min_matchmaking_time=min_matchmaking_time, request_timeout=request_timeout,
            allreduce_timeout=allreduce_timeout, next_chunk_timeout=next_chunk_timeout,
            compression=make_compression(compression),
        )  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._average_forever, name="old-design-averaging", daemon=True)
        self._thread.start()

    @property
    def peer_id(self) -> Any:
        return self.dht.peer_id

    def on_step_end(self, batch_size: int | None = None) -> None:
        self.local_step += 1

    def load_state_from_peers(self, timeout: float | None = None) -> dict | None:
        self.averager.load_state_from_peers(timeout=timeout)
        return None  # TrainingAverager shares no training progress: the old design restarts the schedule

    def _average_forever(self) -> None:
        while not self._stop.is_set():
            stamped = _StampedLock(self.lock, self)
            record: dict[str, Any] = {"round": len(self.records), "t_start": time.time(), "error": None}
            gathered = None
            try:
                gathered = self.averager.step(data_lock=stamped)
            except Exception as error:  # a failed round is data, not a crash
                record["error"] = repr(error)
            record["t_end"] = time.time()
            record["applied"] = bool(gathered) and len(stamped.steps) >= 2
            record["group_size"] = len(gathered) if gathered else 0
            if record["applied"]:
                record["step_at_snapshot"], record["step_at_apply"] = stamped.steps[0], stamped.steps[1]
                record["staleness_steps"] = stamped.steps[1] - stamped.steps[0]
            self.counters["rounds_applied" if record["applied"] else "rounds_failed"] += 1
            self.records.append(record)
            if self.records_path:
                with open(self.records_path, "a") as file:
                    file.write(json.dumps(record) + "\n")

    def shutdown(self) -> None:
        self._stop.set()
        if self.averager.is_alive():
            self.averager.shutdown()
