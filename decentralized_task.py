"""VISSL task whose optimizer averages with a hivemind swarm: select it with
``config.TRAINER.TASK_NAME=decentralized_self_supervision_task``.

VISSL builds the model, the optimizer (LARC, param schedulers), the loss and the data exactly as for
``self_supervision_task``; this task then wraps the optimizer in :class:`DecentralizedSGD` and, for a peer that
joins a running swarm without a checkpoint of its own (or whose checkpoint is behind the swarm), takes over the
swarm's parameters. The hooks in ``hooks/`` drive the averager during training.

The schedule (``SWARM.schedule``):

- ``swarm`` (the default): the recipe is a budget for the whole swarm, as a DDP run's epochs count the global
  batch. The position of the LR and weight-decay schedules (``where``), of prototype freezing, of the queue's
  start and of the end of training is the swarm's sample count (``swarm_progress``), not this box's iterations:
  three equal boxes each train about a third of the recipe, and every box stops by itself when the swarm's count
  reaches it. VISSL's own counters (iteration, phases, data sampler, checkpoint names) stay this box's.
- ``local``: each box runs the whole recipe on its own (more boxes: more samples in the same time); a joiner takes
  over its donor's VISSL counters as if it resumed the donor's checkpoint.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from classy_vision.optim.param_scheduler import ClassyParamScheduler
from classy_vision.tasks import register_task
from vissl.trainer.train_task import SelfSupervisionTask
from vissl.utils.env import get_machine_local_and_dist_rank
from vissl.utils.misc import set_torch_seed

from decentralized_sgd import DecentralizedSGD
from decentralized_sgd.scheduler import RoundSettings
from vissl_swarm import local_replicas, swarm
from vissl_swarm.averaging_protocol import Averaging
from vissl_swarm.dht_rejoin import groupmates_listener
from vissl_swarm.initial_model import initial_model_seed, weights_fingerprint
from vissl_swarm.swarm_progress import SwarmProgress, SwarmSchedule, swarm_lr_factor

TASK_NAME = "decentralized_self_supervision_task"
ROUNDS_FILE = "averaging_rounds.jsonl"
DATA_WORKER_NICENESS = 10  # added to the data-loader workers' niceness: they yield the CPU to averager and p2pd

_averaging_tasks: list[DecentralizedSelfSupervisionTask] = []  # tasks of this process that are in the swarm


def leave_swarm() -> None:
    """Shut down every averager of this process. run_trainer.py calls it before it shuts its DHT down: VISSL runs
    no hook on Ctrl-C (its trainer catches only Exception), and an averager must stop before the DHT it talks to."""
    for task in list(_averaging_tasks):
        task.shutdown_averaging()


def nice_worker_init(vissl_init: Callable[[int], None] | None, worker_id: int) -> None:
    """A data-loader worker's start: VISSL's own (its seeding), then a lower CPU priority. SwAV's multi-crop workers
    can keep every core busy; the averager and p2pd, at normal priority, then still run when they need to, and a
    slow box slows its groupmates less."""
    if vissl_init is not None:
        vissl_init(worker_id)
    os.nice(DATA_WORKER_NICENESS)


def torch_optimizer(task: SelfSupervisionTask) -> torch.optim.Optimizer:
    """The torch optimizer inside any VISSL task's ClassyOptimizer (possibly inside LARC): what is averaged, and
    what the local ranks of a box keep identical. Works for VISSL's stock task too (the hooks serve both)."""
    optimizer = task.optimizer.optimizer
    return getattr(optimizer, "optim", optimizer)


class SwarmScaledParam(ClassyParamScheduler):
    """A VISSL param scheduler times a factor read at each step (the swarm's LR factor)."""

    def __init__(self, scheduler: ClassyParamScheduler, factor: Callable[[], float]) -> None:
        super().__init__(scheduler.update_interval)
        self.scheduler, self.factor = scheduler, factor

    def __call__(self, where: float) -> float:
        return self.scheduler(where) * self.factor()


@register_task(TASK_NAME)
class DecentralizedSelfSupervisionTask(SelfSupervisionTask):
    """SelfSupervisionTask + DecentralizedSGD on local rank 0 (the box's one peer in the swarm)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.swarm_settings = swarm.SwarmSettings.from_config(config.get("SWARM", {}))
        self.dht = None
        self.decentralized_sgd: Averaging | None = None  # DecentralizedSGD, or the old design (--averager old)
        self.joined_from_swarm = False
        # the swarm-wide schedule: set in prepare() on every local rank; the count only on local rank 0 (the others
        # get the position from it in every step, see hooks/follow_swarm_schedule_on_step_hook.py)
        self.schedule: SwarmSchedule | None = None
        self.schedule_position = 0  # the swarm's samples as of the last step boundary
        self.swarm_batch = 0  # the summed batch of the boxes training now (0 until the first step)
        self.swarm_progress: SwarmProgress | None = None  # this box's record in the swarm (count and status)
        self.join_line = ""  # what another box runs to join (also in CHECKPOINT.DIR/join.txt)
        self._checkpoint_progress: dict | None = None  # the counts a resumed checkpoint held
        self._checkpoint_outer: dict | None = None  # the outer optimizer's anchor and buffer a checkpoint held

    @property
    def run_prefix(self) -> str:
        """The run's name in the swarm (``SwarmSettings.run_prefix``): averaging, state downloads and counts."""
        return self.swarm_settings.run_prefix

    @property
    def where(self) -> float:
        """The share of the run done: the swarm's (the swarm-wide schedule), else VISSL's own from this box's
        updates."""
        if self.schedule is not None:
            return self.schedule.where(self.schedule_position)
        return super().where

    def schedule_iteration(self) -> int:
        """Where the swarm is, in this box's iterations (VISSL's iteration with the local schedule)."""
        return self.schedule.iteration(self.schedule_position) if self.schedule is not None else self.iteration

    @property
    def lr_factor(self) -> float:
        """How much the recipe's LR (given for this box's batch) is raised for the swarm's batch (``--swarm_lr``)."""
        if self.schedule is None or self.swarm_batch <= 0:
            return 1.0
        return swarm_lr_factor(self.swarm_settings.swarm_lr, self.swarm_batch, self.schedule.box_batch)

    def _scale_lr_with_swarm(self) -> None:
        """Every param group's LR scheduler, times ``lr_factor`` at each step: VISSL's schedule keeps its shape,
        the swarm's batch sets its scale (and moves it when boxes come and go)."""
        for group in self.optimizer._param_group_schedulers:  # classy_vision keeps them here (no public setter)
            if "lr" in group and not isinstance(group["lr"], SwarmScaledParam):
                group["lr"] = SwarmScaledParam(group["lr"], lambda: self.lr_factor)

    def get_classy_state(self, deep_copy: bool = False) -> dict:
        """VISSL's state, plus the swarm's counts: a restarted box resumes the swarm's position from its checkpoint
        (and a final checkpoint says whether the swarm's budget was done)."""
        state = super().get_classy_state(deep_copy=deep_copy)
        if self.swarm_progress is not None and self.schedule is not None:
            state["swarm_progress"] = {
                **self.swarm_progress.state_dict(),
                "position": self.schedule_position,
                "budget": self.schedule.budget,
                "done": self.schedule.done(self.schedule_position),
            }
        outer_state = getattr(self.decentralized_sgd, "outer_state_dict", None)  # the old design has none
        if outer_state is not None and (outer := outer_state()) is not None:
            state["outer_optimizer"] = outer
        return state

    def _set_classy_state(self, state: dict) -> None:
        super()._set_classy_state(state)
        self._checkpoint_progress = state.get("swarm_progress")
        self._checkpoint_outer = state.get("outer_optimizer")

    @property
    def joins_swarm(self) -> bool:
        """Only local rank 0 of a box talks to the swarm; its other GPUs follow through VISSL's DDP."""
        local_rank, _ = get_machine_local_and_dist_rank()
        return local_rank == 0

    def _build_model(self):
        """VISSL's model, initialised from the run's seed (initial_model): every peer of the run starts from
        the same weights; the peer's own seed still drives data order and augmentations."""
        settings = self.swarm_settings
        seed = initial_model_seed(settings.run_id, settings.config_name)
        self.config["MODEL"]["_MODEL_INIT_SEED"] = seed  # VISSL seeds each head with it (else with SEED_VALUE)
        with set_torch_seed(seed):  # the trunk draws from torch's generator; the peer's state is restored after
            model = super()._build_model()
        logging.info(
            f"Initial model of run {settings.run_id!r} ({settings.config_name}): seed {seed}, "
            f"trunk fingerprint {weights_fingerprint(model.trunk)}"
        )
        return model

    def build_dataloaders(self, pin_memory: bool, current_train_phase_idx: int = 0) -> dict:
        """VISSL's data loaders, with workers at a lower CPU priority (nice_worker_init)."""
        loaders = super().build_dataloaders(pin_memory=pin_memory, current_train_phase_idx=current_train_phase_idx)
        for loader in loaders.values():  # VISSL's GPU-copy wrappers pass the attribute on to the DataLoader
            loader.worker_init_fn = functools.partial(nice_worker_init, loader.worker_init_fn)
        return loaders

    def prepare(self, pin_memory: bool = False) -> SelfSupervisionTask:
        super().prepare(pin_memory=pin_memory)
        if self.swarm_settings.schedule == "swarm":
            box_batch = int(self.datasets["train"].get_global_batchsize())
            iterations = self.num_train_phases * len(self.dataloaders["train"])
            self.schedule = SwarmSchedule(budget=iterations * box_batch, box_batch=box_batch)
            if self.swarm_settings.swarm_lr != "box":
                self._scale_lr_with_swarm()
        if self.joins_swarm:
            self._start_averaging()
        progress = None
        timeout = self.swarm_settings.load_state_timeout
        if self.decentralized_sgd is not None and timeout > 0:
            # a late joiner takes the swarm's state; a restarted peer too, if the swarm got ahead of its checkpoint
            # (else it would pull the swarm back toward its old weights)
            progress = self.decentralized_sgd.load_state_from_peers(timeout=timeout, accept=self._donor_is_ahead())
        if local_replicas.is_box():
            # VISSL builds DDP after this, which copies rank 0's parameters and buffers but not its optimizer state
            # (the momentum rank 0 downloaded, or created to average it): the other local ranks take it here
            progress = local_replicas.broadcast_object(progress)
            local_replicas.broadcast_optimizer_state(torch_optimizer(self))
        if progress:
            self._continue_from(progress)
        return self

    def _donor_is_ahead(self) -> Callable[[dict], bool] | None:
        """Which donor's state a box with a checkpoint takes: one that is ahead of it (None: any, no checkpoint)."""
        if self.checkpoint is None:
            return None
        if self.schedule is not None:
            resumed = SwarmProgress.total_of(self._checkpoint_progress, self.run_prefix)
            return lambda extra: SwarmProgress.total_of(extra.get("swarm_progress"), self.run_prefix) > resumed
        resumed_at = int(self.checkpoint["iteration"])
        return lambda extra: int(extra.get("iteration", 0)) > resumed_at

    def _start_averaging(self) -> None:
        settings = self.swarm_settings
        self.dht = swarm.take_shared_dht() or swarm.start_dht(settings)
        records_path = Path(self.checkpoint_folder or ".") / ROUNDS_FILE
        self.decentralized_sgd = self._wrap_optimizer(settings, records_path)
        _averaging_tasks.append(self)
        if hasattr(self.decentralized_sgd, "load_outer_state_dict"):  # the checkpoint's weights are loaded by now
            self.decentralized_sgd.load_outer_state_dict(self._checkpoint_outer)
        box_batch = int(self.datasets["train"].get_global_batchsize())
        self.swarm_progress = SwarmProgress(
            self.dht,
            self.run_prefix,
            box_batch,
            run_id=settings.run_id,
            config=settings.config_name,
            recipe=settings.recipe,
            secret=settings.secret(),
        )
        if self.schedule is not None:
            restored = self.swarm_progress.load_state_dict(self._checkpoint_progress)
            if restored:
                logging.info(
                    f"Swarm schedule: resumed {self.swarm_progress.known_samples()} samples of the swarm "
                    f"from the checkpoint ({restored} boxes' counts)"
                )
        logging.info(f"Averaging with the swarm as {self.dht.peer_id}; rounds are logged to {records_path}")
        self.join_line = f"To join this swarm, run on another box:\n  {swarm.join_command(self.dht, settings)}"
        print(self.join_line, flush=True)
        if self.checkpoint_folder:
            (Path(self.checkpoint_folder) / swarm.JOIN_FILE).write_text(self.join_line.split("\n", 1)[1].strip() + "\n")
        if note := swarm.reachability_note(swarm.visible_maddrs(self.dht)):
            logging.warning(note)

    def _wrap_optimizer(self, settings: swarm.SwarmSettings, records_path: Path) -> Averaging:
        """DecentralizedSGD around VISSL's torch optimizer. The benchmarks' baselines are tasks that put another
        averager here (``baselines/tasks.py``)."""
        return DecentralizedSGD(
            torch_optimizer(self),
            self.dht,
            swarm_secret=settings.secret(),
            weight_by_samples=settings.weight_by_samples,
            **settings.outer_options(),
            **self._averager_options(settings, records_path),
            # the alone warning names a secret that matches nobody's (membership_problem): told once, not twice
            settings=RoundSettings(no_group_patience=math.inf),
            on_group=groupmates_listener(self.dht),  # the address book keeps the peers our rounds met
        )

    def _averager_options(self, settings: swarm.SwarmSettings, records_path: Path) -> dict[str, Any]:
        """What an averager of this task is built with, from the command line's swarm settings."""
        return dict(
            prefix=self.run_prefix,
            model=self.base_model,
            target_group_size=settings.target_group_size,
            **settings.averager_timeouts(),
            max_staleness=settings.max_staleness if settings.max_staleness >= 0 else None,
            average_optimizer_state=settings.average_optimizer_state,
            compression=settings.compression,
            records_path=str(records_path),
            client_mode=settings.client_mode,
            get_extra_state=self.training_progress,
        )

    def training_progress(self) -> dict:
        """Where this peer is (served to late joiners): the swarm's counts, and VISSL's counters in the shape of a
        mid-phase checkpoint (what a joiner with the local schedule takes over)."""
        in_train_phase = bool(self.train)
        progress = {
            "phase_idx": int(self.phase_idx) - 1,
            "train_phase_idx": int(self.train_phase_idx) - (1 if in_train_phase else 0),
            "iteration": int(self.iteration),
            "iteration_num": int(self.local_iteration_num),
            "num_updates": int(self.num_updates),
        }
        if self.swarm_progress is not None:
            progress["swarm_progress"] = self.swarm_progress.state_dict()
        return progress

    def _continue_from(self, progress: dict) -> None:
        """Take over the swarm's progress. Swarm schedule: merge the donor's counts (this box's own VISSL counters
        stay its own: another box's iterations are at another batch). Local schedule: VISSL's trainer resumes as
        from the donor's iteration checkpoint, so the LR schedule, prototype freezing and the data sampler continue
        where the donor is, not from warm-up."""
        if self.schedule is not None:
            if self.swarm_progress is not None:
                self.swarm_progress.load_state_dict(progress.get("swarm_progress"))
                self.joined_from_swarm = True
                if self.checkpoint_path is not None:
                    logging.info(f"{self.checkpoint_path} is behind the swarm: continuing from the swarm's weights")
                known = self.swarm_progress.known_samples()
                logging.info(
                    f"Joined the swarm at its position: {known} samples of {self.schedule.budget} "
                    f"(where {self.schedule.where(known):.4f})"
                )
            return
        if progress.get("iteration", 0) <= 0:
            return
        self.checkpoint = {key: progress[key] for key in ("phase_idx", "train_phase_idx", "iteration", "iteration_num")}
        self.iteration = progress["iteration"]
        self.local_iteration_num = progress["iteration_num"]
        self.phase_idx = progress["phase_idx"]
        self.train_phase_idx = progress["train_phase_idx"]
        self.num_updates = progress["num_updates"]
        if self.checkpoint_path is not None:
            logging.info(f"{self.checkpoint_path} is behind the swarm: continuing from the swarm's state instead")
        self.joined_from_swarm = True
        logging.info(f"Joined the swarm at iteration {self.iteration} (phase {self.phase_idx + 1})")

    def shutdown_averaging(self) -> None:
        """Stop averaging, then our own DHT (the averager talks to it until it is down); idempotent (called on end,
        on exception, and by :func:`leave_swarm`)."""
        if self.decentralized_sgd is not None:
            self.decentralized_sgd.shutdown()
        told = self.swarm_progress.shutdown() if self.swarm_progress is not None else None
        if told is not None:  # our last record went out: the others keep our count, and count us out
            print(  # not logged: after a Ctrl-C, VISSL has shut its logging down by now
                f"Left the swarm: this box's {self.swarm_progress.own_samples} samples stay in the swarm's count; "
                + ("the other boxes count it out now" if told else "the others count it out once its record expires"),
                file=sys.stderr,
                flush=True,
            )
        if self.dht is not None and self.dht is not swarm.take_shared_dht():
            self.dht.shutdown()
        self.decentralized_sgd = None
        if self in _averaging_tasks:
            _averaging_tasks.remove(self)
