"""``DecentralizedSGD``: what a training loop calls. ``step()`` / ``on_step_end()`` count the step and add the
updates of finished rounds (``w ← w + averaged − snapshot``); the rest runs in the background. The ``_make_*`` methods
build the parts, as hivemind's ``Optimizer`` does. The contract: change the parameters only while holding
``dsgd.lock`` (``step()`` does; else call ``optimizer.step()`` and ``on_step_end()`` under it): fills and late
joiners copy them under it, never half an update.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import hivemind
import torch
from hivemind.p2p import PeerID

from . import vetting
from .averager import Averager, handler_address_slot
from .compression import make_compression, schema_fingerprint
from .hivemind_slow_peer_fixes import SLOW_PEER_COUNTS, SharedCounts, install_slow_reply_blacklist
from .outer import OuterOptimizer, OuterSettings
from .rounds import ROUND_COUNTS, RoundBook, TrainerState
from .scheduler import EXCHANGE_COUNTS, RoundExchange, RoundScheduler, RoundSettings
from .secret import MembershipCheck, SwarmSecret, SwarmSecretValidator, keyed_prefix, members_key
from .starvation import STARVATION_COUNTS, StarvationMonitor
from .state_transfer import StateTransfer
from .supervisor import AVERAGER_SHUTDOWN_S, STOP_S, AveragerSupervisor
from .tensors import AveragedTensors, FlatStaging, ResultSlots, StagingCache, StepBoundaryMarks

logger = logging.getLogger(__name__)

SCHEDULER_JOIN_S = 5.0  # shutdown() waits this long for the scheduler (its own waits are bounded too)
SHUTDOWN_DEADLINE_S = SCHEDULER_JOIN_S + STOP_S  # then the averager and the starvation monitor, side by side
TRAINER_COUNTS = ("ssp_waits", "ssp_timeouts", "ssp_wait_s", "trainer_s")  # DecentralizedSGD's own
COUNTERS = (  # every count of a peer (DecentralizedSGD.counters), in this order; each part counts its own
    *ROUND_COUNTS,
    *TRAINER_COUNTS,
    *"averager_failures averager_restarts".split(),
    *EXCHANGE_COUNTS,
    *STARVATION_COUNTS,
    *SLOW_PEER_COUNTS,
    *vetting.COUNTERS,
    *vetting.JOIN_COUNTS,
)


class TorchOptimizerFacade:
    """What a trainer expects of a ``torch.optim.Optimizer``, passed through to the wrapped one (``self.optimizer``);
    loading a state dict holds ``self.lock`` like every other change of the local state."""

    optimizer: torch.optim.Optimizer
    lock: threading.RLock

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        with self.lock:
            self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        logger.warning("Parameters added after DecentralizedSGD was created are trained locally but not averaged")
        self.optimizer.add_param_group(param_group)


class DecentralizedSGD(TorchOptimizerFacade):
    """Wraps any torch optimizer; averages params (+ BN buffers) with peers all the time. Call ``step()`` (or
    ``optimizer.step()`` then ``on_step_end()``) once per local step. The arguments up to ``client_mode`` are
    hivemind's averager's; ``max_staleness``: SSP's bound on local steps without an applied round (None: never
    waits); ``outer``: an outer optimizer (``outer``); ``settings``: what tests and benchmarks tune (``RoundSettings``);
    ``on_group``: told each round's group (e.g. an address book's ``vissl_swarm.dht_rejoin.groupmates_listener``).
    Non-finite values are never averaged in; a dead averager is restarted; diverged peers and outsiders are left out
    (``vetting``, ``secret``). ``shutdown()`` returns within ``SHUTDOWN_DEADLINE_S``.
    """

    needs_lock_for_forward = False  # results are applied at step boundaries, by the trainer's own thread

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dht: hivemind.DHT,
        *,
        prefix: str,
        model: torch.nn.Module | None = None,
        target_group_size: int = 4,
        min_matchmaking_time: float = 5.0,
        request_timeout: float = 3.0,
        allreduce_timeout: float = 60.0,
        next_chunk_timeout: float = 10.0,
        compression: str = "none",
        client_mode: bool | None = None,
        max_staleness: int | None = None,
        average_optimizer_state: bool = False,
        weight_by_samples: bool = False,
        records_path: str | None = None,
        get_extra_state: Callable[[], dict] | None = None,
        swarm_secret: SwarmSecret | None = None,
        outer: OuterSettings | None = None,
        settings: RoundSettings | None = None,
        on_group: Callable[[list[str]], None] | None = None,
    ):
        assert "." not in prefix, "prefix may not contain '.'"
        self.settings = settings = settings or RoundSettings()
        if outer is not None and outer.enabled and not settings.delta_rule:
            raise ValueError(
                "outer_momentum / outer_lr need delta_rule=True: the outer step is taken from the anchor the delta "
                "rule keeps (set outer_momentum=0 and outer_lr=1 to overwrite with the plain average)"
            )
        self.optimizer, self.dht, self.model, self.max_staleness = optimizer, dht, model, max_staleness
        self.swarm_secret, self.peer = swarm_secret, str(dht.peer_id)
        self._closed = False
        self._counts = dict.fromkeys(TRAINER_COUNTS, 0)  # what the trainer's side costs and waits

        self.averaged_tensors = self._make_averaged_tensors(average_optimizer_state)
        self.trainer = TrainerState(self.averaged_tensors)
        self.lock = self.trainer.lock  # the contract: change the parameters only while holding it
        self.outer = OuterOptimizer(outer, self.averaged_tensors.params) if outer and outer.enabled else None
        self.run = f"{prefix}_{schema_fingerprint(self.averaged_tensors.local())}"
        self.prefix = keyed_prefix(self.run, swarm_secret)  # with a secret, its keyed hash: see secret
        if swarm_secret is not None:  # (merged with the one swarm.start_dht added, if any)
            dht.add_validators([SwarmSecretValidator(swarm_secret, exempt_keys=[members_key(self.run)])])
        self.boundary_marks = StepBoundaryMarks([*self.averaged_tensors.local(), *(model.buffers() if model else ())])
        self.round_book = self._make_round_book(records_path, on_group)
        self.records: list[dict] = self.round_book.records
        self.state_transfer = StateTransfer(
            self.trainer, StagingCache(self.boundary_marks), self.round_book, get_extra_state, self.outer
        )
        self.slow_peer_counts = SharedCounts(SLOW_PEER_COUNTS)  # added to by the averager and DHT processes
        sketch = vetting.WeightSketch([t.numel() for t in self.averaged_tensors.local()], seed=self.prefix)
        self.guard = vetting.GroupGuard(sketch, swarm_secret)
        self.averager_opts = dict(  # what every averager process of this peer is built with (see _make_averager)
            prefix=self.prefix,
            target_group_size=target_group_size,
            min_group_size=settings.min_group_size,
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            compression=make_compression(compression),
            client_mode=client_mode,
            trigger_grace=next_chunk_timeout,
            handler_address=handler_address_slot(),  # one per peer: each restart registers its handlers there
            shutdown_timeout=AVERAGER_SHUTDOWN_S,
            slow_peer_fixes=settings.slow_peer_fixes,
        )
        self.starvation = self._make_starvation_monitor()
        self._supervisor = AveragerSupervisor(self._make_averager, settings.averager_timeout, self.starvation)
        self.vetting = self._make_vetting(heal_timeout=allreduce_timeout)
        self.exchange = self._make_exchange(weight_by_samples)
        self._scheduler = self._make_scheduler()
        self.start()

    # --- the parts (each built once, by a method a subclass may override) ---
    def _make_averaged_tensors(self, average_optimizer_state: bool) -> AveragedTensors:
        return AveragedTensors(
            self.optimizer,
            self.model,
            average_buffers=self.settings.average_buffers,
            average_optimizer_state=average_optimizer_state,
        )

    def _make_round_book(self, records_path: str | None, on_group: Callable[[list[str]], None] | None) -> RoundBook:
        slots = ResultSlots(lambda: FlatStaging(self.averaged_tensors.local(), self.boundary_marks, torch.float32))
        return RoundBook(slots, records_path, self.settings.verbose, self.peer, on_group)

    def _make_averager(self) -> Averager:
        """The averager process; called again on each restart (see supervisor)."""
        return Averager(
            self.averaged_tensors.zeros(),
            self.dht,
            state_fn=self.state_transfer.serve,
            slow_peer_counts=self.slow_peer_counts,
            guard=self.guard,
            **self.averager_opts,
        )

    def _make_starvation_monitor(self) -> StarvationMonitor | None:
        return StarvationMonitor(start=False) if self.settings.slow_peer_fixes else None

    def _make_vetting(self, heal_timeout: float) -> vetting.RoundVetting:
        membership = MembershipCheck(self.dht, self.run, self.swarm_secret, patience=self.settings.no_group_patience)
        return vetting.RoundVetting(
            self.guard,
            self.trainer,
            self.round_book,
            self._supervisor,
            self.state_transfer,
            membership,
            peer_id=self.dht.peer_id,
            heal_timeout=heal_timeout,
        )

    def _make_exchange(self, weight_by_samples: bool) -> RoundExchange:
        return RoundExchange(
            self.settings,
            self.trainer,
            self.round_book,
            self._supervisor,
            self.vetting,
            self.outer,
            weight_by_samples=weight_by_samples,
        )

    def _make_scheduler(self) -> RoundScheduler:
        opts = self.averager_opts
        return RoundScheduler(
            self.exchange,
            min_matchmaking_time=opts["min_matchmaking_time"],
            next_chunk_timeout=opts["next_chunk_timeout"],
            allreduce_timeout=opts["allreduce_timeout"],
        )

    @property
    def counters(self) -> dict[str, float]:
        """Every count of this peer, read now from the parts that count (each its own, in COUNTERS' order)."""
        counters, supervisor = dict.fromkeys(COUNTERS, 0), self._supervisor
        counters.update(self.round_book.counters, **self._counts, **self.exchange.counts, **self.vetting.counts)
        counters.update(averager_failures=supervisor.failures, averager_restarts=supervisor.restarts)
        counters.update(self.slow_peer_counts.as_dict())
        counters.update(self.guard.counts.as_dict(), **(self.starvation.counts() if self.starvation else {}))
        return counters

    @property
    def local_step(self) -> int:
        return self.trainer.local_step

    @property
    def samples(self) -> int:
        return self.trainer.samples

    @property
    def peer_id(self) -> PeerID:
        return self.dht.peer_id

    @property
    def membership_problem(self) -> str | None:
        """Why no peer of the run averages with us, when the run's members tell (``secret.MembershipCheck``)."""
        return None if self.vetting.membership is None else self.vetting.membership.problem

    @property
    def averager(self) -> Averager:
        """The current averager process (a new one after a restart)."""
        return self._supervisor.averager

    def start(self) -> None:
        """Start the averager process, the starvation monitor and the scheduler (the constructor calls it)."""
        if self.settings.slow_peer_fixes:
            install_slow_reply_blacklist(self.dht, self.slow_peer_counts, self.settings.averager_timeout)
        self._supervisor.start()
        self._scheduler.start()

    # --- the trainer's side ---
    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:
        """The wrapped optimizer's step and the step boundary (see ``on_step_end``); returns the loss, as torch does."""
        with self.lock:  # one hold: the step and its count are seen together by the scheduler and by late joiners
            loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
            self._step_boundary(batch_size)
        self._enforce_staleness_bound()
        self.vetting.heal_if_asked()
        return loss

    def on_step_end(self, batch_size: int | None = None) -> int:
        """Call once per local step, after the optimizer step. Returns how many changes it made to the parameters
        (rounds applied, plus 1 for a heal): a box with several GPUs then broadcasts them to its replicas."""
        with self.lock:
            applied = self._step_boundary(batch_size)
        applied += self._enforce_staleness_bound()
        healed = self.vetting.heal_if_asked()
        return applied + int(healed)

    def _step_boundary(self, batch_size: int | None) -> int:
        """Trainer thread, holding self.lock: count the step and apply finished rounds; returns how many applied."""
        t0 = time.perf_counter()
        self.trainer.count_step(batch_size)
        applied = self._apply_finished_rounds()
        self.boundary_marks.record()  # a fill copies this boundary's values (see tensors)
        self._scheduler.wake()
        self._counts["trainer_s"] += time.perf_counter() - t0  # what averaging costs the training loop
        return applied

    def _apply_finished_rounds(self) -> int:
        """Trainer thread, holding self.lock: add the updates of finished rounds; returns how many."""
        finished = [] if self._closed else self.exchange.apply_finished()
        if not finished:
            return 0
        self.vetting.applied(finished)  # their averages are our reference now (see vetting)
        self.trainer.synced()
        if not self.averager.client_mode:  # let late joiners prefer the most trained peer
            self.averager.state_sharing_priority = float(self.local_step)
        return len(finished)

    def _enforce_staleness_bound(self) -> int:
        """SSP, if asked for: returns how many rounds were applied while waiting."""
        if self.max_staleness is not None and self.trainer.steps_since_sync > self.max_staleness:
            return self._wait_for_round()
        return 0

    def _wait_for_round(self) -> int:
        """SSP: block until a round is applied, at most staleness_timeout s (``dsgd.lock`` released while asleep). The
        scheduler wakes us when a round changes; each wake is a step boundary. Returns how many rounds were applied."""
        trainer, counters, timeout = self.trainer, self._counts, self.settings.staleness_timeout
        t0, applied = time.monotonic(), 0
        counters["ssp_waits"] += 1
        with self.lock:
            while True:
                seen = trainer.round_changes  # a round that changes from here on wakes the wait below
                applied += self._apply_finished_rounds()
                self.boundary_marks.record()
                self._scheduler.wake()
                if trainer.steps_since_sync <= self.max_staleness or self._closed:
                    break
                left = timeout - (time.monotonic() - t0)
                if left <= 0:
                    logger.warning(
                        f"SSP: no round applied for {trainer.steps_since_sync} steps and {timeout}s, "
                        "continuing without averaging"
                    )
                    counters["ssp_timeouts"] += 1
                    trainer.synced()
                    break
                trainer.wait_for_round_change(seen, left)
                trainer.count_wait()
        counters["ssp_wait_s"] += time.monotonic() - t0
        return applied

    def last_applied_record(self) -> dict | None:
        return next((record for record in reversed(self.records) if record["applied"]), None)

    def in_flight_rounds(self) -> list[dict]:
        """Records (``applied=False``, ``state``: where the round is) of the rounds not resolved yet, oldest first."""
        return self.round_book.in_flight()

    def load_state_from_peers(
        self, timeout: float | None = None, accept: Callable[[dict], bool] | None = None
    ) -> dict | None:
        """Take over a donor's params, buffers, optimizer state and local_step. Returns its ``get_extra_state()``, or
        None (nothing changed) if nobody answered or ``accept(extra_state)`` said no."""
        return self.state_transfer.load(
            self.averager, self.averager_opts["allreduce_timeout"] if timeout is None else timeout, accept
        )

    def outer_state_dict(self) -> dict | None:
        """The outer optimizer's anchor and momentum buffer, for a checkpoint (None: it is off)."""
        if self.outer is None:
            return None
        with self.lock:
            return self.outer.state_dict()

    def load_outer_state_dict(self, state: dict | None) -> None:
        """A checkpoint's outer state, after its weights were loaded; None: the current weights are the anchor."""
        if self.outer is None:
            if state is not None:
                logger.info("The checkpoint holds an outer optimizer's state, but outer momentum is off: ignoring it")
            return
        with self.lock:
            if state is None:
                self.outer.reset(self.averaged_tensors.params)
            else:
                self.outer.load_state_dict(state)

    # --- lifecycle ---
    def shutdown(self) -> None:
        """Cancel pending rounds and stop the averager within a bounded time (see the class); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._scheduler.stop(timeout=SCHEDULER_JOIN_S)
        self.round_book.close("shut down")
        self._supervisor.shutdown()

    def __enter__(self) -> DecentralizedSGD:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
