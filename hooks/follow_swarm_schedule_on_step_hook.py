"""After each optimizer step: count this box's samples and take the swarm's position; after each step: stop when
the swarm's budget is done."""

from __future__ import annotations

import logging

from hooks.quiet_hook import QuietHook
from vissl_swarm import local_replicas


def sync_position(task) -> int:
    """The swarm's position and batch on every local rank of this box: local rank 0 (the one in the swarm) reads
    them, the others take rank 0's (one small collective per step), so the LR, the freezing and the stop are the
    same on all of them in the same step."""
    progress = getattr(task, "swarm_progress", None)
    position, batch = task.schedule_position, task.swarm_batch
    if progress is not None:
        position, batch = progress.position(), progress.swarm_batch()
    if local_replicas.is_box():
        position, batch = local_replicas.broadcast_ints([position, batch])
    task.schedule_position, task.swarm_batch = position, batch
    return position


def follow_queue_and_assignment(task) -> None:
    """SwAV's loss starts its queue (``queue.start_iter``) and ends hard assignments by its own iteration counter:
    set it to the swarm's position in this box's iterations before the next forward."""
    criterion = getattr(getattr(task, "base_loss", None), "swav_criterion", None)
    if criterion is not None:
        criterion.num_iteration.fill_(task.schedule_iteration())


def end_training_now(task) -> None:
    """Make the current phase the last one: VISSL's trainer then ends after it, and its checkpoint hook writes the
    final checkpoint (``model_final_checkpoint_phase<N>.torch``) at this phase's end."""
    task.phases = task.phases[: task.phase_idx + 1]
    task.num_train_phases = task.train_phase_idx + 1


class FollowSwarmScheduleOnStepHook(QuietHook):
    """With the swarm-wide schedule (``task.schedule``): after every optimizer step, count this box's samples into
    the swarm's count and move the schedule's position (the next step's LR, freezing and queue follow it, and the
    step's log line shows it); after every step, end training when the swarm has trained on the recipe's budget
    (the swarm's count, not this box's iterations: see ``swarm_progress``).

    It ends the step with ``StopIteration``, which VISSL's trainer takes as the end of the phase; so it comes last
    among the on_step hooks (only StopOnStepHook after it), after those that log and checkpoint the step.
    """

    def __init__(self) -> None:
        super().__init__()
        self._stopping = False

    def on_start(self, task) -> None:
        schedule = getattr(task, "schedule", None)
        if schedule is None:
            return
        position = sync_position(task)
        follow_queue_and_assignment(task)
        logging.info(
            f"Swarm schedule: the swarm's budget is {schedule.budget} samples ({task.num_train_phases} "
            f"epochs x {schedule.budget // max(task.num_train_phases, 1)}); the swarm is at {position} "
            f"(where {task.where:.4f}); this box's batch {schedule.box_batch}"
        )
        if schedule.done(position):
            logging.info(
                f"Swarm schedule: the swarm's budget was done already ({position} of {schedule.budget} "
                "samples): nothing left to train"
            )
            end_training_now(task)

    def on_update(self, task) -> None:
        if not task.train:
            return
        progress = getattr(task, "swarm_progress", None)
        if progress is not None:  # the count is published with either schedule (the monitor shows the speed)
            progress.add(int(task.get_global_batchsize()))
        if getattr(task, "schedule", None) is None:
            return
        sync_position(task)
        follow_queue_and_assignment(task)

    def on_step(self, task) -> None:
        schedule = getattr(task, "schedule", None)
        if schedule is None or not task.train or self._stopping:
            return
        position = task.schedule_position
        progress = getattr(task, "swarm_progress", None)
        if schedule.done(position):
            self._stopping = True
            own = progress.own_samples if progress is not None else None
            logging.info(
                f"Swarm schedule: the swarm's budget is done ({position} of {schedule.budget} samples); "
                f"this box trained {task.iteration} iterations"
                + (f" ({own} samples)" if own is not None else "")
                + f", last lr {float(task.optimizer.options_view.lr):.6g} (x{task.lr_factor:.4g} for the "
                f"swarm's batch {task.swarm_batch}). Ending with a final checkpoint"
            )
            end_training_now(task)
            raise StopIteration
