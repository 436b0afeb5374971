"""The benchmarks' baselines as VISSL tasks: this example's task with another averager where DecentralizedSGD was.
``run_trainer.py --averager old`` / ``--averager hivemind_optimizer`` loads them (``TASKS``); the product's task has
no branch for them. Everything else (the swarm-wide schedule, the hooks, checkpoints) is the product's."""

from __future__ import annotations

import logging
from pathlib import Path

from classy_vision.tasks import register_task

from baselines.hivemind_averagers import keep_ctrl_c
from baselines.hivemind_optimizer import HivemindOptimizerAverager
from baselines.old_design import OldDesignAverager
from decentralized_task import DecentralizedSelfSupervisionTask, torch_optimizer
from vissl_swarm import swarm
from vissl_swarm.averaging_protocol import Averaging

TASKS = {"old": "decentralized_old_design_task", "hivemind_optimizer": "decentralized_hivemind_optimizer_task"}


@register_task(TASKS["old"])
class OldDesignTask(DecentralizedSelfSupervisionTask):
    """hivemind's TrainingAverager driven as the old DecentralizedSGD drove it (``baselines/old_design.py``); it
    has no swarm secret (run_trainer.py refuses the combination) and shares no training progress."""

    def _wrap_optimizer(self, settings: swarm.SwarmSettings, records_path: Path) -> Averaging:
        with keep_ctrl_c():  # hivemind's TrainingAverager starts its process in its constructor
            return OldDesignAverager(torch_optimizer(self), self.dht, **self._averager_options(settings, records_path))

    def prepare(self, pin_memory: bool = False) -> OldDesignTask:
        super().prepare(pin_memory=pin_memory)
        if self.decentralized_sgd is not None and self.swarm_settings.load_state_timeout > 0:
            start = "from its checkpoint" if self.checkpoint is not None else "from iteration 0"
            logging.info(f"--averager old shares no training progress: this peer runs its own LR schedule {start}")
        return self


@register_task(TASKS["hivemind_optimizer"])
class HivemindOptimizerTask(DecentralizedSelfSupervisionTask):
    """hivemind.Optimizer(use_local_updates=True) put inside VISSL's LARC (``baselines/hivemind_optimizer.py``)."""

    def _wrap_optimizer(self, settings: swarm.SwarmSettings, records_path: Path) -> Averaging:
        with keep_ctrl_c():  # hivemind.Optimizer starts its averagers' processes in its constructor
            return HivemindOptimizerAverager.install(self, settings, self._averager_options(settings, records_path))
