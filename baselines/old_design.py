"""The old design, kept only as the baseline of the benchmarks: hivemind's ``TrainingAverager`` driven the way the
old hivemind DecentralizedSGD drove it.

A background thread loops ``TrainingAverager.step(data_lock=lock)``: one round at a time, the snapshot is taken
*before* matchmaking, the result is applied with the delta rule under the lock. The trainer must hold ``lock``
from before its forward pass until after its optimizer step (an in-place apply between forward and backward
would break autograd), so ``needs_lock_for_forward`` is True. It implements ``averaging_protocol.Averaging``, the
interface the VISSL task and hooks are written against, so ``run_trainer.py --averager old`` runs the same hooks.

TrainingAverager shares parameters and optimizer state with a late joiner, but no training progress: a peer that
joins with the old design restarts the LR schedule from iteration 0 (see ``load_state_from_peers``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.optim.training_averager import TrainingAverager
from hivemind.p2p import PeerID

from baselines.hivemind_averagers import ServesStateAsCopies
from baselines.steps_in_flight import KeepsStepsInFlight
from decentralized_sgd import make_compression, schema_fingerprint
from decentralized_sgd.hivemind_fixes import shut_down_averager

logger = logging.getLogger(__name__)
TIMEOUTS = {"min_matchmaking_time": 5.0, "request_timeout": 3.0, "allreduce_timeout": 60.0, "next_chunk_timeout": 10.0}


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


class _KeepsControl(DecentralizedAverager):
    """Under TrainingAverager in the MRO: its step waits inside ``DecentralizedAverager.step``, so nobody sees the
    round's StepControl; this starts that step without waiting, keeps its control in ``control`` (the round's stage:
    a benchmark's timeline polls it) and waits for it as hivemind would."""

    control: StepControl | None = None

    def step(self, *args: Any, wait: bool = True, **kwargs: Any) -> Any:
        control = super().step(*args, wait=False, **kwargs)
        self.control = control
        return control.result() if wait else control


class _TrainingAverager(KeepsStepsInFlight, ServesStateAsCopies, TrainingAverager, _KeepsControl):
    """hivemind's TrainingAverager with a shutdown that prints no traceback (``shut_down_averager``), serving copies of
    the state (``ServesStateAsCopies``), its round's StepControl in sight (``_KeepsControl``)."""

    _rpc_handlers = None  # hivemind caches handlers per class and names them after it: collect this class's own
    _stub_type = None

    async def _shutdown(self, timeout: float | None) -> None:
        # the trainer has no handle on TrainingAverager.step's StepControl: cancel the steps from here
        await shut_down_averager(self, timeout, steps=self._steps)


class OldDesignAverager:
    """TrainingAverager + a background thread: the pre-DecentralizedSGD way of averaging."""

    needs_lock_for_forward = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dht: hivemind.DHT,
        *,
        prefix: str,
        model: torch.nn.Module | None = None,
        target_group_size: int = 4,
        compression: str = "none",
        records_path: str | None = None,
        **options: Any,
    ) -> None:
        """``options``: TrainingAverager's timeouts (``TIMEOUTS``, by default as there); the task's other options
        (a staleness bound, the optimizer state, client mode, ...) have no counterpart in the old design."""
        self.dht, self.records_path = dht, records_path
        self.lock = threading.RLock()
        self.local_step = 0
        self.records: list[dict] = []
        self.current: dict | None = None  # the record of the round in flight
        self.counters: dict[str, float] = {"rounds_applied": 0, "rounds_failed": 0}
        self._applied_at_last_step = 0
        buffers = [b for b in (model.buffers() if model is not None else ()) if b.is_floating_point()]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.averager = _TrainingAverager(
            optimizer,
            average_parameters=True,
            average_gradients=False,
            extra_tensors=buffers,
            initialize_optimizer=False,
            dht=dht,
            prefix=f"{prefix}_old_{schema_fingerprint(params + buffers)}",
            start=True,
            target_group_size=target_group_size,
            min_group_size=2,
            compression=make_compression(compression),
            **{key: options.get(key, default) for key, default in TIMEOUTS.items()},
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._average_forever, name="old-design-averaging", daemon=True)
        self._thread.start()

    @property
    def peer_id(self) -> PeerID:
        return self.dht.peer_id

    def on_step_end(self, batch_size: int | None = None) -> int:
        """Count the step; returns the rounds its thread applied since the previous step (between the steps)."""
        self.local_step += 1
        applied, self._applied_at_last_step = (
            self.counters["rounds_applied"] - self._applied_at_last_step,
            self.counters["rounds_applied"],
        )
        return int(applied)

    def last_applied_record(self) -> dict | None:
        return next((record for record in reversed(self.records) if record["applied"]), None)

    def load_state_from_peers(self, timeout: float | None = None, accept: Callable[[dict], bool] | None = None) -> None:
        """Take over a peer's parameters and optimizer state (TrainingAverager's download); always returns None.

        TrainingAverager shares no training progress, so the caller keeps its own schedule: a new peer trains the
        swarm's weights from iteration 0 of the LR schedule. For the same reason ``accept`` can only be asked
        about an empty progress dict ``{}``: a peer that resumed from a checkpoint (the VISSL task then asks "is
        the donor ahead of my checkpoint?") keeps its checkpoint.
        """
        if accept is not None and not accept({}):
            logger.info("load_state_from_peers: the old design shares no training progress; keeping our own state")
            return None
        try:
            with self.lock:
                self.averager.load_state_from_peers(timeout=timeout)
        except TimeoutError:
            logger.info("load_state_from_peers: no peer shared its state in time; keeping our own")
        return None

    def _average_forever(self) -> None:
        while not self._stop.is_set():
            stamped = _StampedLock(self.lock, self)
            record: dict[str, Any] = {"round": len(self.records), "t_start": time.time(), "error": None}
            self.current, gathered = record, None
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
            self.current = None
            if self.records_path:
                with open(self.records_path, "a") as file:
                    file.write(json.dumps(record) + "\n")

    def shutdown(self) -> None:
        """Stop the averager process, which first cancels its steps in flight (see _TrainingAverager): the
        averaging thread's ``step()`` then fails and the thread ends on its own. It is not joined (it may wait for
        ``lock``, which a trainer interrupted by Ctrl-C can still hold); a daemon, it never keeps the process
        alive."""
        self._stop.set()
        if self.averager.is_alive():
            self.averager.shutdown()
