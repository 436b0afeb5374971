"""``DecentralizedSGD``: what a training loop calls. Wraps any torch optimizer; averages its parameters (and BN
buffers, optionally optimizer state) with peers all the time, in the background.

The trainer's side is small on purpose: ``step()`` / ``on_step_end()`` count the step and, at this step boundary,
add the updates of finished rounds (``w ← w + averaged − snapshot``: local steps made during the round are kept).
Everything else happens in the scheduler thread (``scheduler``), the averager process (``averager``,
``supervisor``) and hivemind's state-fetching thread (``state_transfer``).

The contract: change the parameters only while holding ``dsgd.lock`` (``step()`` does; if you call
``optimizer.step()`` yourself, do it and ``on_step_end()`` under ``with dsgd.lock:``). The scheduler copies the
parameters into a formed round under that lock, and late joiners download them under it, so neither sees half an
update. LR schedulers should be given ``dsgd.optimizer``.
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
from .dht_rejoin import note_groupmates, rejoin_count
from .exchange import RoundExchange
from .hivemind_slow_peer_fixes import SLOW_PEER_COUNTS, SharedCounts, install_slow_reply_blacklist
from .outer import OuterOptimizer, OuterSettings
from .rounds import RoundBook
from .scheduler import RoundScheduler
from .secret import MembershipCheck, SwarmSecret, SwarmSecretValidator, keyed_prefix, members_key
from .settings import RoundSettings
from .staging import FlatStaging, StagingCache, StepBoundaryMarks
from .starvation import STARVATION_COUNTS, StarvationMonitor
from .state_transfer import StateTransfer
from .step_clock import StepClock
from .supervisor import AveragerSupervisor
from .tensors import AveragedTensors, ResultSlots
from .trainer_state import TrainerState
from .vetting import GroupGuard, RoundVetting

logger = logging.getLogger(__name__)

SCHEDULER_JOIN_S = 5.0  # shutdown() waits this long for the scheduler (its own waits are bounded too)
AVERAGER_SHUTDOWN_S = 5.0  # hivemind's shutdown_timeout: how long the averager may take to leave its groups
SHUTDOWN_DEADLINE_S = SCHEDULER_JOIN_S + AVERAGER_SHUTDOWN_S + 7.0  # see Averager.shutdown
COUNTERS = (
    "rounds_applied",
    "rounds_failed",
    "rounds_no_group",
    "rounds_discarded_nonfinite",
    "rounds_skipped_local_nonfinite",
    "rounds_cancelled",
    "ssp_waits",
    "ssp_timeouts",
    "ssp_wait_s",
    "trainer_s",
    "dht_rejoins",
    "averager_failures",
    "averager_restarts",
    *STARVATION_COUNTS,
    *SLOW_PEER_COUNTS,
    "fills",
    "fill_s",
    "fill_locked_s",
    "applies",
    "apply_s",  # the data path's cost: see _count_apply, scheduler
) + vetting.COUNTERS


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
    """Wraps any torch optimizer; averages params (+ BN buffers) with peers all the time.

    Call ``step()`` (or ``optimizer.step()`` then ``on_step_end()``) once per local step.

    Non-finite values: a peer whose own values are not finite contributes zeros with weight 0 (its groupmates
    average without it) and keeps its local params; a round whose averaged result is not finite is discarded.
    A peer whose trainer stalls joins at most one group it does not trigger; its groupmates drop it after
    ``next_chunk_timeout``. A dead or unresponsive averager process is restarted (see ``supervisor``). A slow or
    overloaded groupmate costs the others little, and a peer starved of CPU leaves averaging until it recovers
    (``slow_peer_fixes``; see ``hivemind_slow_peer_fixes`` and ``starvation``).
    ``shutdown()`` returns within ``SHUTDOWN_DEADLINE_S`` (17 s), even if the averager process is stopped.

    Diverged peers and outsiders (``vetting``): each group's members compare weight summaries; a member
    far from the group's median is left out of the AllReduce (every member reaches the same verdict), and heals by
    taking the swarm's state. With ``swarm_secret``, only peers holding it meet, group and write DHT records
    (``secret``); one whose secret matches nobody's logs so after ``no_group_patience`` seconds without a group.

    Outer optimizer (``outer_momentum`` b, ``outer_lr`` a, ``outer_nesterov``; off at b = 0, a = 1): each accepted
    round's average moves this peer's anchor by an outer step on the progress the group made from it (SlowMo,
    DiLoCo's Nesterov; see ``outer``), with the delta rule kept. It costs two fp32 host copies of the parameters;
    ``outer_state_dict`` / ``load_outer_state_dict`` carry them through checkpoints, a state download resets them.
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
        min_group_size: int = 2,
        min_matchmaking_time: float = 5.0,
        request_timeout: float = 3.0,
        allreduce_timeout: float = 60.0,
        next_chunk_timeout: float = 10.0,
        max_staleness: int | None = None,
        staleness_timeout: float = 60.0,
        average_buffers: bool = True,
        average_optimizer_state: bool = False,
        weight_by_samples: bool = False,
        compression: str = "none",
        delta_rule: bool = True,
        refresh_before_allreduce: bool = True,
        pipeline: bool = True,
        fill_when_formed: bool = True,
        boundary_wait_share: float = 0.05,
        slow_peer_fixes: bool = True,
        averager_timeout: float = 30.0,
        records_path: str | None = None,
        client_mode: bool | None = None,
        get_extra_state: Callable[[], dict] | None = None,
        before_allreduce: Callable[[], None] | None = None,
        verbose: bool = False,
        swarm_secret: SwarmSecret | None = None,
        no_group_patience: float = 60.0,
        outer_momentum: float = 0.0,
        outer_lr: float = 1.0,
        outer_nesterov: bool = False,
        start: bool = True,
    ):
        assert "." not in prefix, "prefix may not contain '.'"
        outer_settings = OuterSettings(outer_momentum, outer_lr, outer_nesterov)
        if outer_settings.enabled and not delta_rule:
            raise ValueError(
                "outer_momentum / outer_lr need delta_rule=True: the outer step is taken from the anchor the delta "
                "rule keeps (set outer_momentum=0 and outer_lr=1 to overwrite with the plain average)"
            )
        self.optimizer, self.dht, self.model = optimizer, dht, model
        self.settings = RoundSettings(
            min_matchmaking_time=min_matchmaking_time,
            next_chunk_timeout=next_chunk_timeout,
            allreduce_timeout=allreduce_timeout,
            averager_timeout=averager_timeout,
            boundary_wait_share=boundary_wait_share,
            weight_by_samples=weight_by_samples,
            delta_rule=delta_rule,
            refresh_before_allreduce=refresh_before_allreduce,
            pipeline=pipeline,
            fill_when_formed=fill_when_formed,
        )
        self.max_staleness, self.staleness_timeout = max_staleness, staleness_timeout
        self.slow_peer_fixes = slow_peer_fixes  # False: hivemind's behaviour with a slow groupmate (an ablation)
        self.trainer = TrainerState()
        self.lock = self.trainer.lock  # the contract: change the parameters only while holding it
        # SSP waits on it: Condition.wait releases self.lock entirely, also the holds of a caller that calls
        # on_step_end inside ``with dsgd.lock:`` (the README's contract), so the scheduler can fill meanwhile
        self._round_applied = threading.Condition(self.lock)
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)  # every part adds to these
        self.peer = str(dht.peer_id)
        self._closed = False

        # what is averaged, and the host copies of it (one flat buffer per device, pinned for a GPU: see staging)
        self.averaged_tensors = AveragedTensors(
            optimizer, model, average_buffers=average_buffers, average_optimizer_state=average_optimizer_state
        )
        self.outer = OuterOptimizer(outer_settings, self.averaged_tensors.params) if outer_settings.enabled else None
        run = f"{prefix}_{schema_fingerprint(self.averaged_tensors.local())}"
        self.prefix = keyed_prefix(run, swarm_secret)  # with a secret, its keyed hash: see secret
        if swarm_secret is not None:  # (merged with the one swarm.start_dht added, if any)
            dht.add_validators([SwarmSecretValidator(swarm_secret, exempt_keys=[members_key(run)])])
        self.boundary_marks = StepBoundaryMarks([*self.averaged_tensors.local(), *(model.buffers() if model else ())])
        slots = ResultSlots(lambda: FlatStaging(self.averaged_tensors.local(), self.boundary_marks, torch.float32))
        self.round_book = RoundBook(self.counters, slots, records_path, verbose, self.peer)
        self.records: list[dict] = self.round_book.records
        self.state_transfer = StateTransfer(
            optimizer,
            model,
            self.averaged_tensors,
            self.trainer,
            StagingCache(self.boundary_marks),
            self.boundary_marks,
            self.round_book,
            get_extra_state,
            self.outer,
        )

        # the averager process, and the parts that drive it
        self.slow_peer_counts = SharedCounts(SLOW_PEER_COUNTS)  # added to by the averager and DHT processes
        guard = GroupGuard.for_tensors(self.averaged_tensors.local(), seed=self.prefix, secret=swarm_secret)
        averager_kwargs = dict(
            prefix=self.prefix,
            target_group_size=target_group_size,
            min_group_size=min_group_size,
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            compression=make_compression(compression),
            client_mode=client_mode,
            state_fn=self.state_transfer.serve,
            trigger_grace=next_chunk_timeout,
            handler_address=handler_address_slot(),
            shutdown_timeout=AVERAGER_SHUTDOWN_S,
            slow_peer_fixes=slow_peer_fixes,
            slow_peer_counts=self.slow_peer_counts,
            guard=guard,
        )
        self._supervisor = AveragerSupervisor(
            lambda: Averager(self.averaged_tensors.zeros(), dht, **averager_kwargs), self.counters, averager_timeout
        )
        self.vetting = RoundVetting(
            guard,
            self.trainer,
            self.averaged_tensors,
            self.round_book,
            self._supervisor,
            self.state_transfer,
            self.counters,
            dht.peer_id,
            MembershipCheck(dht, run, swarm_secret, patience=no_group_patience),
            heal_timeout=allreduce_timeout,
        )
        self.exchange = RoundExchange(
            self.settings,
            self.trainer,
            self.averaged_tensors,
            self.round_book,
            self._supervisor,
            self.vetting,
            self.counters,
            before_allreduce,
            self.outer,
        )
        # the starvation monitor samples from start() on; the scheduler asks it before it starts a round
        self.starvation = StarvationMonitor(start=False) if slow_peer_fixes else None
        counts = [
            lambda: {"dht_rejoins": rejoin_count(dht)},
            self.slow_peer_counts.as_dict,
            *([self.starvation.counts] if self.starvation is not None else []),
        ]
        self._scheduler = RoundScheduler(
            self.settings,
            self.trainer,
            self.round_book,
            self._supervisor,
            self.exchange,
            self.vetting,
            self.counters,
            starvation=self.starvation,
            counts=counts,
            on_group=lambda group: note_groupmates(dht, group),
        )
        if start:
            self.start()

    @property
    def local_step(self) -> int:
        return self.trainer.local_step

    @property
    def samples(self) -> int:
        return self.trainer.samples

    @property
    def step_clock(self) -> StepClock:
        return self.trainer.clock

    @property
    def peer_id(self) -> PeerID:
        return self.dht.peer_id

    @property
    def averager(self) -> Averager:
        """The current averager process (a new one after a restart)."""
        return self._supervisor.averager

    def start(self) -> None:
        """Start the averager process and the scheduler (only needed if created with start=False)."""
        self._start_slow_peer_fixes()
        self._supervisor.start()
        self._scheduler.start()

    def _start_slow_peer_fixes(self) -> None:
        """The parts of the slow-peer fixes outside the averager process: the slow-reply blacklist in our DHT (once
        per DHT), and the starvation monitor that the scheduler asks before it starts a round."""
        if self.starvation is not None:
            install_slow_reply_blacklist(self.dht, self.slow_peer_counts, self.settings.averager_timeout)
            self.starvation.start()

    # --- the trainer's side ---
    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:
        with self.lock:  # one hold: the step and its count are seen together by the scheduler and by late joiners
            loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
            applied = self._step_boundary(batch_size)
        applied += self._enforce_staleness_bound()
        self.vetting.heal_if_asked()
        return loss

    def on_step_end(self, batch_size: int | None = None) -> int:
        """Call once per local step, after the optimizer step (VISSL hooks call this when they don't use .step()).
        Applies the updates of finished rounds (cheap when nothing finished: no tensor copies), or takes the swarm's
        state when a group found our weights diverged (``vetting``). Returns how many of those changed the
        parameters (rounds applied, plus 1 for a heal): a box with several GPUs then broadcasts them to its replicas.
        """
        with self.lock:
            applied = self._step_boundary(batch_size)
        applied += self._enforce_staleness_bound()
        healed = self.vetting.heal_if_asked()  # a group found our weights diverged: take the swarm's state (vetting)
        return applied + int(healed)

    def _step_boundary(self, batch_size: int | None) -> int:
        """Trainer thread, holding self.lock: count the step and apply finished rounds; returns how many applied."""
        t0 = time.perf_counter()
        self.trainer.count_step(batch_size)
        applied = self._apply_finished_rounds()
        self.boundary_marks.record()  # a fill copies this boundary's values (see staging)
        self._scheduler.wake()
        self.counters["trainer_s"] += time.perf_counter() - t0  # what averaging costs the training loop
        return applied

    def _apply_finished_rounds(self) -> int:
        """Trainer thread, holding self.lock, at a step boundary: add the updates of finished rounds (``exchange``).
        Returns how many it applied."""
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
        """SSP: block until a round is applied, at most staleness_timeout seconds. Waiting is a step boundary: rounds
        may start and fill, results are applied. ``dsgd.lock`` is released while asleep, even if the caller holds it.
        Returns how many rounds were applied meanwhile."""
        t0, applied = time.monotonic(), 0
        self.counters["ssp_waits"] += 1
        with self._round_applied:
            while self.trainer.steps_since_sync > self.max_staleness and not self._closed:
                if time.monotonic() - t0 > self.staleness_timeout:
                    logger.warning(
                        f"SSP: no round applied for {self.trainer.steps_since_sync} steps and "
                        f"{self.staleness_timeout}s, continuing without averaging"
                    )
                    self.counters["ssp_timeouts"] += 1
                    self.trainer.synced()
                    break
                self._round_applied.wait(0.01)
                self.trainer.count_wait()
                applied += self._apply_finished_rounds()
                self.boundary_marks.record()
                self._scheduler.wake()
        self.counters["ssp_wait_s"] += time.monotonic() - t0
        return applied

    # --- records ---
    def last_record(self) -> dict | None:
        return self.records[-1] if self.records else None

    def last_applied_record(self) -> dict | None:
        return next((record for record in reversed(self.records) if record["applied"]), None)

    def in_flight_rounds(self) -> list[dict]:
        """Records (``applied=False``, ``state``: where the round is) of the rounds not resolved yet, oldest first."""
        return self.round_book.in_flight()

    # --- state transfer ---

    def load_state_from_peers(
        self, timeout: float | None = None, accept: Callable[[dict], bool] | None = None
    ) -> dict | None:
        """Download params/buffers/optimizer state/progress from a peer.

        Returns the donor's extra-state dict (its training progress, see get_extra_state) or None if nobody answered
        or ``accept(extra_state)`` said no (e.g. the donor is not ahead of our checkpoint): then nothing changes.
        The optimizer's hyperparameters (lr, momentum...) and local_step are taken over from the donor too.
        """
        return self.state_transfer.load(
            self.averager, self.settings.allreduce_timeout if timeout is None else timeout, accept
        )

    # --- checkpoints ---
    def outer_state_dict(self) -> dict | None:
        """The outer optimizer's anchor and momentum buffer, for a checkpoint (None: it is off)."""
        if self.outer is None:
            return None
        with self.lock:
            return self.outer.state_dict()

    def load_outer_state_dict(self, state: dict | None) -> None:
        """A checkpoint's outer state, after its weights were loaded. None (a checkpoint from a run without it, or
        saved before it was turned on): the current weights are the anchor, the buffer starts at zero."""
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
        if self.starvation is not None:
            self.starvation.stop()

    def __enter__(self) -> DecentralizedSGD:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
