"""VISSL hooks that drive the averager, one job each, named after the event they act on.

``swarm_hook_generator`` adds them to VISSL's default hooks (it does not replace any); ``run_trainer.py``
hands it to VISSL's ``launch_distributed``.
"""

from __future__ import annotations

from vissl_swarm import vissl_compat

vissl_compat.apply()

from classy_vision.hooks import ClassyHook  # noqa: E402
from vissl.hooks import FreezeParametersHook, NormalizePrototypesHook, default_hook_generator  # noqa: E402

import decentralized_task  # noqa: E402,F401  (registers the task with classy_vision's registry)
from hooks.average_on_update_hook import AverageOnUpdateHook  # noqa: E402
from hooks.follow_swarm_schedule_on_step_hook import FollowSwarmScheduleOnStepHook  # noqa: E402
from hooks.freeze_parameters_on_swarm_schedule_hook import FreezeParametersOnSwarmScheduleHook  # noqa: E402
from hooks.leave_swarm_on_end_hook import LeaveSwarmOnEndHook  # noqa: E402
from hooks.log_progress_on_step_hook import LogProgressOnStepHook  # noqa: E402
from hooks.preflight_on_step_hook import PreflightOnStepHook  # noqa: E402
from hooks.stop_on_step_hook import StopOnStepHook  # noqa: E402
from hooks.warn_when_alone_on_step_hook import ALONE_AFTER_S, WarnWhenAloneOnStepHook  # noqa: E402

__all__ = [
    "AverageOnUpdateHook",
    "FollowSwarmScheduleOnStepHook",
    "FreezeParametersOnSwarmScheduleHook",
    "LeaveSwarmOnEndHook",
    "LogProgressOnStepHook",
    "PreflightOnStepHook",
    "StopOnStepHook",
    "WarnWhenAloneOnStepHook",
    "swarm_hook_generator",
]


def swarm_hook_generator(cfg) -> list[ClassyHook]:
    """VISSL's default hooks plus ours; the swarm hooks do nothing for a task that does not average.

    Hooks run in list order at each event. AverageOnUpdateHook owns the averager's lock window of each step (from
    backward through the optimizer step, the apply of finished rounds, the prototypes' normalisation and the
    broadcast to local replicas), so no other hook's place in the list matters for it: VISSL's normalisation hook
    is taken out of the list and run inside that window, after the apply (an averaged prototype matrix is off the
    unit sphere). The progress hooks come after it so that they log the step's final weights;
    FollowSwarmScheduleOnStepHook then moves the swarm-wide schedule and may end training (it ends the step, so it
    comes after every hook that logs or checkpoints it), and a Ctrl-C pressed during the step stops the run after
    all of that (StopOnStepHook, see ``ctrl_c``). A pre-flight (``SWARM.preflight_s``) ends training by time the
    same way, before the swarm leaves (its on_end still sees the averager). VISSL's prototype-freezing hook is
    replaced by one that counts the swarm's iterations.
    """
    log_every = int(cfg.get("SWARM", {}).get("log_every", 0) or cfg.LOG_FREQUENCY)
    alone_after = float(cfg.get("SWARM", {}).get("alone_warning_after", ALONE_AFTER_S))
    preflight_s = float(cfg.get("SWARM", {}).get("preflight_s", 0.0) or 0.0)
    vissl_hooks = default_hook_generator(cfg)
    normalizer = next((hook for hook in vissl_hooks if isinstance(hook, NormalizePrototypesHook)), None)
    vissl_hooks = [
        FreezeParametersOnSwarmScheduleHook() if type(hook) is FreezeParametersHook else hook
        for hook in vissl_hooks
        if not isinstance(hook, NormalizePrototypesHook)
    ]
    return [
        *vissl_hooks,
        AverageOnUpdateHook(normalizer),
        LogProgressOnStepHook(log_every=log_every),
        WarnWhenAloneOnStepHook(alone_after_s=alone_after),
        *([PreflightOnStepHook(preflight_s)] if preflight_s > 0 else []),
        LeaveSwarmOnEndHook(),
        FollowSwarmScheduleOnStepHook(),
        StopOnStepHook(),
    ]
