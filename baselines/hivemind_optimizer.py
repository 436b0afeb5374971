"""``--averager hivemind_optimizer``: what a user would pick instead of this example, hivemind's own
``hivemind.Optimizer(use_local_updates=True)``, inside the stock VISSL trainer; kept as a baseline of the benchmarks.

**How it is wired.** VISSL builds ClassyOptimizer -> LARC (``task.optimizer.optimizer``) -> torch SGD (LARC's
``optim``). :meth:`HivemindOptimizerAverager.install` replaces LARC's ``optim`` with a ``hivemind.Optimizer`` built
around that same SGD (a config without LARC: ClassyOptimizer's ``optimizer`` itself). A VISSL step then runs as
before up to the update: ClassyOptimizer writes the step's LR and weight decay into ``param_groups``, LARC scales
the gradients, and ``hivemind.Optimizer.step()`` applies an averaging round that has finished (delta rule), takes
the local SGD step, reports the box's samples to its ProgressTracker and, once the swarm has accumulated
``target_batch_size`` samples since the last *global epoch*, starts the next epoch's state averaging round in the
background (``average_state_every=1``: every epoch). ``scheduler=None``: VISSL's schedulers keep the LR, from the
swarm-wide schedule as with the other averagers. One change makes that work: ``hivemind.Optimizer.param_groups``
returns *copies* of the groups, on which VISSL's LR writes would be lost; :class:`VisslHivemindOptimizer` returns
the SGD's own groups (without offloading, which local updates do not use, both hold the same tensors).

**Settings** (as hivemind.Optimizer's docstring guides a user): ``use_local_updates=True``,
``batch_size_per_step`` = the box's batch, ``matchmaking_time`` = ``--min_matchmaking_time``,
``averaging_timeout`` = ``--averaging_timeout``, ``next_chunk_timeout``, ``target_group_size`` and
``request_timeout`` as for our averager, groups of at least 2, compression ``--compression`` on the wire, the
model's floating-point buffers (BatchNorm statistics) as ``extra_tensors`` as our averager averages them, and the
momentum (``average_opt_statistics``) with ``--average_optimizer_state``.

**target_batch_size**: the swarm's samples per global epoch, i.e. between two averaging rounds. Chosen so that a
round comes about as often as DecentralizedSGD's: ``SWAV_HIVEMIND_TARGET_BATCH_SIZE`` when set (the learning
benchmark sets it to boxes x box batch x the local steps per round that ``--averager improved`` measured in the
same regime: the same steps-per-round ratio), else ``target_group_size`` x box batch x
``DEFAULT_STEPS_PER_EPOCH`` (20: a full group of boxes reaches a global epoch every ~20 local steps each, one
round per default 5 s matchmaking for boxes stepping every 0.25 s; DecentralizedSGD measured 6-9 local steps per
round with 3 boxes, 3 s matchmaking and full groups on the loaded 2-core machine). It is a fixed number, the same
on every box, as a hivemind user sets it: hivemind has no time-based setting (its ETA only estimates when the
samples will be there), and a number derived from each box's own speed would differ between boxes.

**What hivemind does differently from DecentralizedSGD**, all of it left as hivemind does it (this is the
baseline, not a fix):

- The trainer waits for the averaging round at its *next* optimizer step: with local updates hivemind averages
  with the delta rule, and ``TrainingStateAverager.step`` waits for every pending background update before an
  optimizer step (``should_wait``). So a round overlaps one step's forward and backward, not the following ones
  (staleness 0 in every round measured here); ``counters["seconds_in_step"]`` holds the trainer's time inside
  ``hivemind.Optimizer.step``.
- Rounds start at global epochs only (one at a time), matchmaking pre-scheduled from the tracker's ETA.
- A box whose epoch falls behind the swarm's downloads the whole state from a peer inside its step, dropping that
  step's gradients (``counters["state_downloads"]``); its own local updates since the last round are lost.
- At construction hivemind runs one SGD step with zero gradients to create the momentum buffers
  (``initialize_optimizer``): with weight decay this scales the initial weights by (1 - lr * wd), ~1e-7 here.
- The snapshot is copied from hivemind's background thread without our lock, as in a plain training loop: the
  prototypes' normalisation right after the step may be seen half done by that copy (it is done again after every
  step).

**What this module adds**, without changing how hivemind trains and averages: the ``averaging_protocol.Averaging``
interface (``lock``, counters, one record per round with group size and staleness, written to
``averaging_rounds.jsonl``) by observing hivemind's state averager (:class:`_ObservedStateAverager`). Departures
from hivemind's own, at the end and in the log only: the rounds in flight are cancelled first and hivemind's
shutdown is waited for at most ``SHUTDOWN_DEADLINE_S`` (it waits up to the averaging timeout for a round that finds
no group: the last box of a swarm); the averager process leaves as ours do (``shut_down_averager``) and waits for the
DHT stores it sent (see ``_ObservedStateAverager._shutdown``); a round without a group, a departed groupmate and a
state download that hivemind retries (hivemind#504) are one log line, not an ERROR with a traceback (as our
averager's log filters). One departure is a crash fix: the state a peer downloads is served as copies, as ours
is (``hivemind_averagers.served_as_copies``: hivemind's own serving moves the live CPU tensors into shared memory under
the trainer's running step). ``load_state_from_peers`` takes a peer's parameters and optimizer state through hivemind's
state averager and shares no VISSL progress (returns None), like ``--averager old``; with the swarm-wide schedule
the box still follows the swarm's sample count from the DHT. One process per box: a multi-GPU box (VISSL DDP) is
refused (its local ranks' optimizer state is not kept in step). No swarm secret (run_trainer.py refuses the
combination).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID

from baselines.hivemind_averagers import ServesStateAsCopies
from baselines.steps_in_flight import KeepsStepsInFlight
from decentralized_sgd import make_compression, schema_fingerprint
from decentralized_sgd.hivemind_fixes import (
    cancel_step_first,
    quiet_hivemind_logs,
    rewrite_as_one_line,
    shut_down_averager,
)

logger = logging.getLogger(__name__)  # debug lines; what a user reads goes to the root logger, as VISSL's

TARGET_BATCH_ENV = "SWAV_HIVEMIND_TARGET_BATCH_SIZE"
DEFAULT_STEPS_PER_EPOCH = 20  # local steps per box between two global epochs (rounds) of a full group, by default
AVERAGER_SHUTDOWN_S = 5.0  # hivemind's shutdown_timeout: how long its averager process may take to leave
SHUTDOWN_DEADLINE_S = 20.0  # shutdown() returns within this, even if hivemind's own shutdown still waits


def target_batch_size(box_batch: int, target_group_size: int, environ: dict[str, str] | None = None) -> int:
    """The swarm's samples per global epoch: ``SWAV_HIVEMIND_TARGET_BATCH_SIZE`` if set, else
    ``target_group_size`` x ``box_batch`` x ``DEFAULT_STEPS_PER_EPOCH`` (see the module docstring)."""
    text = (os.environ if environ is None else environ).get(TARGET_BATCH_ENV, "").strip()
    if text:
        value = int(text)
        if value < 1:
            raise ValueError(f"{TARGET_BATCH_ENV} must be a positive number of samples, got {text!r}")
        return value
    return box_batch * target_group_size * DEFAULT_STEPS_PER_EPOCH


class _Rounds:
    """The rounds hivemind runs, as the Averaging interface reports them. ``begin`` (trainer thread, the step that
    starts a round), ``attach`` (hivemind's executor thread, the round's StepControl) and ``applied`` (trainer
    thread, when hivemind applies a round's result) fill one record each; ``take_finished`` hands finished records
    to the trainer's step end. Rounds are applied in the order they started (hivemind runs their background work
    in order and applies at most one per step), so open rounds are a queue: a round whose wait timed out in
    hivemind is applied later and still matched to its own record."""

    def __init__(self, local_steps: Callable[[], int]) -> None:
        self._local_steps = local_steps
        self._lock = threading.Lock()
        self._open: deque[tuple[dict[str, Any], list[StepControl | None]]] = deque()  # (record, [its control])
        self._finished: list[dict] = []
        self._started = 0

    def begin(self, epoch: int) -> None:
        with self._lock:
            self._open.append(
                (
                    {
                        "round": self._started,
                        "epoch": epoch,
                        "t_start": time.time(),
                        "step_at_snapshot": self._local_steps(),
                        "error": None,
                    },
                    [None],
                )
            )
            self._started += 1

    def attach(self, control: StepControl | None) -> None:
        with self._lock:
            if self._open:
                self._open[-1][1][0] = control

    def applied(self) -> None:
        """hivemind just applied the oldest open round's result (``w += averaged - snapshot``); a round that failed is
        applied too (its delta is zero), and is recorded as failed."""
        with self._lock:
            if not self._open:
                return
            record, (control,) = self._open.popleft()
        outcome, error = None, "no group (hivemind did not start the round)"
        if control is not None and control.done():
            if control.cancelled():
                error = "cancelled"
            elif control.exception() is not None:
                error = repr(control.exception())
            else:
                outcome, error = control.result(), None
        elif control is not None:
            error = "not finished within hivemind's timeout"
        applied = bool(outcome) and len(outcome) >= 2
        record.update(
            applied=applied,
            error=None if applied else error,
            t_end=time.time(),
            step_at_apply=self._local_steps() - 1,
            group_size=len(outcome) if outcome else 0,
        )
        record["staleness_steps"] = record["step_at_apply"] - record["step_at_snapshot"] if applied else None
        with self._lock:
            self._finished.append(record)

    def in_flight(self) -> list[tuple[dict, StepControl | None]]:
        """(record, StepControl) of each round started and not applied yet: a benchmark's timeline polls their
        stages and writes them into the records."""
        with self._lock:
            return [(record, control) for record, (control,) in self._open]

    def controls_in_flight(self) -> list[StepControl]:
        """The StepControls of the rounds started and not finished yet."""
        with self._lock:
            controls = [control for _, (control,) in self._open]
        return [control for control in controls if control is not None and not control.done()]

    def take_finished(self) -> list[dict]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished


class _PendingStores:
    """Averager process, inside its event loop: the DHT requests still in flight that hivemind sent as tasks of
    their own (``asyncio.wait_for(dht.store(...))``), looked up whenever asked, so that late ones count too."""

    @staticmethod
    def _tasks() -> list[asyncio.Task]:
        current = asyncio.current_task()
        return [
            task
            for task in asyncio.all_tasks()
            if task is not current and not task.done() and getattr(task.get_coro(), "__qualname__", "") == "wait_for"
        ]

    def __iter__(self) -> Iterator[asyncio.Task]:
        return iter(self._tasks())

    def __len__(self) -> int:
        return len(self._tasks())


class _ObservedStateAverager(KeepsStepsInFlight, ServesStateAsCopies, TrainingStateAverager):
    """hivemind's TrainingStateAverager, observed: which round started, with which StepControl, and when its
    result was applied (:class:`_Rounds`); and an averager process that ends without tracebacks. Every override
    calls hivemind's own method: behaviour unchanged, except that the state is served as copies (a crash fix,
    ``ServesStateAsCopies``)."""

    _rpc_handlers = None  # hivemind caches handlers per class and names them after it: collect this class's own
    _stub_type = None

    def __init__(self, *, rounds: _Rounds, **kwargs: Any) -> None:
        self._rounds = rounds
        super().__init__(**kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """hivemind.Optimizer's call, in the trainer's thread: a round starts here (the snapshot is taken in the
        background right after this step's local update)."""
        if kwargs.get("averaging_round"):
            self._rounds.begin(epoch=self.local_epoch + int(bool(kwargs.get("increment_epoch"))))
        return super().step(*args, **kwargs)

    def _do(
        self,
        wait_for_trigger: Any,
        optimizer_step: bool,
        zero_grad: bool,
        averaging_round: bool,
        averaging_control: StepControl | None,
        grad_scaler: Any,
        set_to_none: bool,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        """hivemind's background work. A round without a usable pre-scheduled group gets its StepControl here,
        made exactly as ``TrainingStateAverager._do`` would make it, so that we hold it and see its outcome."""
        if averaging_round:
            if averaging_control is None or averaging_control.triggered or averaging_control.done():
                try:
                    averaging_control = DecentralizedAverager.step(
                        self, gather=self.local_epoch, require_trigger=True, timeout=timeout, wait=False, **kwargs
                    )
                except Exception as error:  # hivemind's _do tries once more, logs its failure, and goes on
                    logger.debug(f"hivemind_optimizer: could not start an averaging round: {error!r}")
                    averaging_control = None
            self._rounds.attach(averaging_control)
        super()._do(
            wait_for_trigger,
            optimizer_step,
            zero_grad,
            averaging_round,
            averaging_control,
            grad_scaler,
            set_to_none,
            timeout=timeout,
            **kwargs,
        )

    def _apply_averaging_results_(self) -> None:
        super()._apply_averaging_results_()
        self._rounds.applied()

    def run(self) -> None:
        """Averager process: a round without a group, and a groupmate that left, are one log line each (as for our
        averager, see hivemind_fixes), not an ERROR with a traceback: a box at the end of the swarm's budget
        looks for a group in vain, every time."""
        quiet_hivemind_logs()
        super().run()

    async def _shutdown(self, timeout: float | None) -> None:
        """Leave as our averagers do (``shut_down_averager``), and wait (bounded) for the DHT stores this process
        sent without waiting: hivemind's ``_declare_for_download_periodically`` stores once per averaged tensor per
        round. One that reaches the DHT after this process is gone fails there, and hivemind's DHT then sleeps 3 s
        per failed request (``DHT._run``): seen as "[Errno 2] No such file or directory" every 3 s and a box's
        last sample count not published."""
        await shut_down_averager(self, timeout, steps=self._steps, dht_requests=_PendingStores())


class _RetriedStateDownloadIsOneLine(logging.Filter):
    """hivemind.Optimizer retries a state download that failed (``load_state_from_peers``: "Failed to load state from
    peers: ..., retrying ...") and logs each failure with a traceback. The first download of a box that joins a
    running box can fail on an optimizer state whose tensors and metadata do not match ("IndexError: list index out
    of range" in ``load_optimizer_state``), then the retry succeeds: seen once in the suite, on a loaded machine.
    Upstream: hivemind#504 (open). Nothing is lost (hivemind tries again): one WARNING line, as our averager's
    departures. Trainer's process, on hivemind.Optimizer's own logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.getMessage().startswith("Failed to load state from peers"):
            message = f"hivemind.Optimizer: {record.getMessage()} (hivemind#504)"
            rewrite_as_one_line(record, message, level=logging.WARNING)
        return True


class VisslHivemindOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` as LARC's inner optimizer: ``param_groups`` are the wrapped SGD's own (VISSL writes
    LR and weight decay into them, LARC zeroes and restores weight decay around the step), it counts its steps,
    and its state averager is observed (:class:`_ObservedStateAverager`)."""

    def __init__(self, *, rounds_factory: Callable[[VisslHivemindOptimizer], _Rounds], **kwargs: Any) -> None:
        self.local_updates = 0  # calls of step(), counted at their start (a round's snapshot follows its update)
        self.seconds_in_step = 0.0
        self.state_downloads = 0
        self.rounds = rounds_factory(self)
        super().__init__(**kwargs)
        assert not self.offload_optimizer, "local updates do not offload: param_groups below rely on it"

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        """hivemind.Optimizer._make_state_averager with our observed subclass."""
        return _ObservedStateAverager(
            rounds=self.rounds,
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    @property
    def param_groups(self) -> list[dict]:
        return self.state_averager.optimizer.param_groups

    def step(
        self, closure: Callable[[], torch.Tensor] | None = None, batch_size: int | None = None, grad_scaler: Any = None
    ) -> torch.Tensor | None:
        self.local_updates += 1
        started = time.perf_counter()
        try:
            return super().step(closure=closure, batch_size=batch_size, grad_scaler=grad_scaler)
        finally:
            self.seconds_in_step += time.perf_counter() - started

    def load_state_from_peers(self, **kwargs: Any) -> None:
        self.state_downloads += 1  # hivemind calls it from step() when this box's epoch is behind the swarm's
        super().load_state_from_peers(**kwargs)


class HivemindOptimizerAverager:
    """``hivemind.Optimizer(use_local_updates=True)`` behind the ``averaging_protocol.Averaging`` interface, so
    that the VISSL task and hooks drive it unchanged (see the module docstring)."""

    needs_lock_for_forward = False  # hivemind applies rounds inside its step(), which runs under our lock

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dht: hivemind.DHT,
        *,
        prefix: str,
        box_batch: int,
        model: torch.nn.Module | None = None,
        target_group_size: int = 4,
        min_matchmaking_time: float = 5.0,
        request_timeout: float = 3.0,
        allreduce_timeout: float = 60.0,
        next_chunk_timeout: float = 10.0,
        average_optimizer_state: bool = False,
        compression: str = "fp16",
        records_path: str | None = None,
        client_mode: bool = False,
        load_state_timeout: float = 60.0,
        target_batch: int | None = None,
    ) -> None:
        self.dht, self.records_path = dht, records_path
        self.lock = threading.RLock()
        self.local_step = 0
        self.records: list[dict] = []
        self.counters: dict[str, float] = {
            "rounds_applied": 0,
            "rounds_failed": 0,
            "state_downloads": 0,
            "seconds_in_step": 0.0,
        }
        self.target_batch_size = target_batch or target_batch_size(box_batch, target_group_size)
        buffers = [b for b in (model.buffers() if model is not None else ()) if b.is_floating_point()]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._shut_down = False
        retried_downloads = logging.getLogger("hivemind.optim.optimizer")
        if not any(isinstance(f, _RetriedStateDownloadIsOneLine) for f in retried_downloads.filters):
            retried_downloads.addFilter(_RetriedStateDownloadIsOneLine())
        self.hivemind_optimizer = VisslHivemindOptimizer(
            rounds_factory=lambda owner: _Rounds(lambda: owner.local_updates),
            dht=dht,
            run_id=f"{prefix}_hivemind_{schema_fingerprint(params + buffers)}",
            optimizer=optimizer,
            params=None,
            scheduler=None,
            use_local_updates=True,
            batch_size_per_step=box_batch,
            target_batch_size=self.target_batch_size,
            matchmaking_time=min_matchmaking_time,
            averaging_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            load_state_timeout=load_state_timeout,
            average_state_every=1,
            client_mode=client_mode,
            state_averaging_compression=make_compression(compression),
            average_opt_statistics=("momentum_buffer",) if average_optimizer_state else (),
            extra_tensors=buffers,
            averager_opts={
                "target_group_size": target_group_size,
                "min_group_size": 2,
                "request_timeout": request_timeout,
            },
            shutdown_timeout=AVERAGER_SHUTDOWN_S,
        )
        logging.info(
            f"hivemind.Optimizer(use_local_updates=True): a global epoch (an averaging round) every "
            f"{self.target_batch_size} samples of the swarm, batch_size_per_step {box_batch}, "
            f"matchmaking_time {min_matchmaking_time} s"
        )

    @classmethod
    def install(cls, task: Any, settings: Any, options: dict[str, Any]) -> HivemindOptimizerAverager:
        """Build it around the task's torch optimizer, from the options the task builds its averager with, and put
        the hivemind.Optimizer where that optimizer was: inside LARC (``task.optimizer.optimizer.optim``), or as
        ClassyOptimizer's optimizer without LARC."""
        from vissl_swarm import local_replicas

        if local_replicas.is_box():
            raise RuntimeError(
                "--averager hivemind_optimizer runs one process per box: drop "
                "config.DISTRIBUTED.NUM_PROC_PER_NODE, or use the default averager"
            )
        options = dict(options)
        options.pop("get_extra_state")  # hivemind.Optimizer serves its own progress (its epoch) to joiners
        if options.pop("max_staleness") is not None:  # run_trainer.py refuses it first, with the flag's name
            raise ValueError("hivemind.Optimizer has no staleness bound: drop --max_staleness")
        holder = task.optimizer.optimizer
        inner = getattr(holder, "optim", holder)
        averager = cls(
            inner,
            task.dht,
            box_batch=int(task.get_global_batchsize()),
            load_state_timeout=max(settings.load_state_timeout, settings.averaging_timeout),
            **options,
        )
        if holder is inner:
            task.optimizer.optimizer = averager.hivemind_optimizer
        else:
            holder.optim = averager.hivemind_optimizer
        return averager

    @property
    def peer_id(self) -> PeerID:
        return self.dht.peer_id

    def on_step_end(self, batch_size: int | None = None) -> int:
        """Count the step; the rounds hivemind applied inside it become records (and lines of the rounds file).
        Returns how many of them were applied."""
        self.local_step += 1
        return self._take_rounds()

    def _take_rounds(self) -> int:
        optimizer = self.hivemind_optimizer
        self.counters["state_downloads"] = optimizer.state_downloads
        self.counters["seconds_in_step"] = round(optimizer.seconds_in_step, 3)
        finished = optimizer.rounds.take_finished()
        for record in finished:
            self.counters["rounds_applied" if record["applied"] else "rounds_failed"] += 1
            self.records.append(record)
        if finished and self.records_path:
            with open(self.records_path, "a") as file:
                file.writelines(json.dumps(record) + "\n" for record in finished)
        return sum(1 for record in finished if record["applied"])

    def last_applied_record(self) -> dict | None:
        return next((record for record in reversed(self.records) if record["applied"]), None)

    def load_state_from_peers(self, timeout: float | None = None, accept: Callable[[dict], bool] | None = None) -> None:
        """Take a peer's parameters, buffers and optimizer state (hivemind's state averager); returns None: no VISSL
        progress is shared (``accept`` is asked about ``{}``, as with the old design: a box resumed from a
        checkpoint keeps it)."""
        if accept is not None and not accept({}):
            logging.info("load_state_from_peers: hivemind.Optimizer shares no training progress; keeping our state")
            return None
        optimizer = self.hivemind_optimizer
        try:
            with self.lock:
                optimizer.state_averager.load_state_from_peers(timeout=timeout)
                optimizer.tracker.report_local_progress(local_epoch=optimizer.local_epoch, samples_accumulated=0)
        except TimeoutError:
            logging.info("load_state_from_peers: no peer shared its state in time; keeping our own")
        return None

    def shutdown(self) -> None:
        """Cancel the rounds in flight (the one started, the one pre-scheduled), then hivemind.Optimizer.shutdown in a
        thread, waited for at most ``SHUTDOWN_DEADLINE_S``: without the cancel, hivemind's shutdown waits for a
        round that looks for a group until the averaging timeout (the last box of a swarm finds none). Past the
        deadline the averager process is killed (the thread is a daemon: it never keeps the process alive).
        Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        optimizer = self.hivemind_optimizer
        for control in [*optimizer.rounds.controls_in_flight(), optimizer.scheduled_state]:
            if control is not None and not control.done():
                cancel_step_first(control)
        optimizer.scheduled_state = None  # cancelled above: hivemind's shutdown would cancel it a second time
        thread = threading.Thread(target=optimizer.shutdown, name="hivemind-optimizer-shutdown", daemon=True)
        thread.start()
        thread.join(SHUTDOWN_DEADLINE_S)
        if thread.is_alive():
            logging.error(
                f"hivemind.Optimizer did not shut down within {SHUTDOWN_DEADLINE_S:.0f} s: killing its averager process"
            )
            if optimizer.state_averager.is_alive():
                optimizer.state_averager.kill()
        else:
            self._take_rounds()  # hivemind's shutdown applies a round that finished after the last step
