"""Every N steps, one line per peer with what users look at: progress, speed and the last averaging round (also
reported to the box's swarm record, which the monitor shows)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from decentralized_task import torch_optimizer
from hooks.quiet_hook import QuietHook
from hooks.samples_per_second import SamplesPerSecond
from vissl_swarm.averaging_protocol import Averaging
from vissl_swarm.local_replicas import replica_checksums

PROGRESS_FILE = "progress.jsonl"


def world_rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def prototypes_norm_error(task) -> float | None:
    """max |‖row‖ − 1| over the prototypes of a SwAV head that normalises them; None for other models. Logged so that
    a run shows averaging never leaves them off the unit sphere (see AverageOnUpdateHook)."""
    if task.config["LOSS"]["name"] != "swav_loss" or not task.config.LOSS["swav_loss"].normalize_last_layer:
        return None
    head = task.base_model.heads[0]
    with torch.no_grad():
        errors = [
            getattr(head, f"prototypes{j}").weight.float().norm(dim=1).sub(1).abs().max() for j in range(head.nmb_heads)
        ]
    return float(max(errors)) if errors else None


class LogProgressOnStepHook(QuietHook):
    """Logs step, loss, samples/s, LR, the last round (group size, staleness, seconds), rounds ok / failed (a group
    formed, the AllReduce did not finish) / without a group, and how often the averager was found dead or
    unresponsive, and appends the same as a JSON line to CHECKPOINT.DIR/progress.jsonl (flushed: the demo reads it
    live).

    On a box with several GPUs, every local rank also records checksums of its parameters, buffers and optimizer
    state (``progress_rank<r>.jsonl`` for ranks > 0), which show that the replicas stay identical.
    """

    def __init__(self, log_every: int = 10) -> None:
        super().__init__()
        self.log_every = max(1, log_every)
        self._rate = SamplesPerSecond()
        self._file = None
        self._last_logged: int | None = None  # the iteration of the last line written
        self._join_line_shown = False
        self._started = time.time()  # no_group_s counts from here until the first applied round
        self._last_loss: Any = None  # the last step's loss tensor: VISSL resets task.last_batch before the step that
        # ends the data; kept as a tensor (no .item(), which would wait for the GPU at every step)

    def on_start(self, task) -> None:
        self._rate.start(task.iteration)
        self._started = time.time()
        rank, _ = world_rank_and_size()
        if task.checkpoint_folder:
            name = PROGRESS_FILE if rank == 0 else f"progress_rank{rank}.jsonl"
            self._file = open(Path(task.checkpoint_folder) / name, "a")  # noqa: SIM115 (open for the whole run)

    def on_step(self, task) -> None:
        if getattr(task, "join_line", "") and not self._join_line_shown:  # again, below VISSL's start-up output
            print(task.join_line, flush=True)
            self._join_line_shown = True
        if task.train and getattr(task.last_batch, "loss", None) is not None:
            self._last_loss = task.last_batch.loss.detach()
        if task.train and task.iteration % self.log_every == 0:
            self._log(task)

    def _log(self, task) -> None:
        rank, world_size = world_rank_and_size()
        entry = {"time": time.time(), "step": task.iteration}
        if world_size > 1:
            entry.update(replica_checksums(task.base_model, torch_optimizer(task)))
        if rank == 0:
            entry.update(self._progress_fields(task))
            logging.info(self._line(entry))
        if self._file is not None:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()
        self._last_logged = task.iteration

    def _progress_fields(self, task) -> dict:
        samples_per_s, _ = self._rate.update(task.iteration, task.get_global_batchsize())
        loss = getattr(task.last_batch, "loss", None)
        loss = loss if loss is not None else self._last_loss
        fields = {
            "loss": float(loss.item()) if loss is not None else float("nan"),
            "samples_per_s": round(samples_per_s, 2),
            "lr": float(task.optimizer.options_view.lr),
        }
        if getattr(task, "schedule", None) is not None:  # the swarm-wide schedule: where the swarm is
            fields["swarm_samples"] = int(task.schedule_position)
            fields["where"] = round(float(task.where), 6)
            fields["lr_factor"] = round(float(task.lr_factor), 4)
            progress = getattr(task, "swarm_progress", None)
            if progress is not None:
                fields.update(
                    own_samples=progress.own_samples, swarm_batch=progress.swarm_batch(), boxes=progress.live_boxes()
                )
        norm_error = prototypes_norm_error(task)
        if norm_error is not None:  # SwAV: how far the prototypes are from the unit sphere the loss assumes
            fields["prototypes_norm_error"] = norm_error
        optimizer: Averaging | None = getattr(task, "decentralized_sgd", None)  # None: not averaging
        if optimizer is not None:
            last = optimizer.last_applied_record() or {}
            fields.update(
                {
                    "peer_id": str(optimizer.peer_id),
                    "rounds_ok": int(optimizer.counters["rounds_applied"]),
                    "rounds_failed": int(optimizer.counters["rounds_failed"]),
                    "rounds_no_group": int(optimizer.counters.get("rounds_no_group", 0)),
                    "averager_failures": int(optimizer.counters.get("averager_failures", 0)),
                    "group_size": last.get("group_size"),
                    "staleness_steps": last.get("staleness_steps"),
                    "round_s": round(last["t_end"] - last["t_start"], 2) if last else None,
                }
            )
            if (progress := getattr(task, "swarm_progress", None)) is not None:  # for the monitor
                progress.report(
                    step=task.iteration,
                    loss=fields["loss"],
                    no_group_s=time.time() - (last.get("t_end") or self._started),
                    **{key: fields[key] for key in ("group_size", "staleness_steps", "rounds_ok", "rounds_failed")},
                    averager_failures=fields["averager_failures"],
                )
        return fields

    @staticmethod
    def _line(entry: dict) -> str:
        line = (
            f"step {entry['step']} | loss {entry['loss']:.4f} | {entry['samples_per_s']:.1f} samples/s | "
            f"lr {entry['lr']:.5f}"
        )
        if "swarm_samples" in entry:
            line += f" | swarm at {entry['swarm_samples']} samples (where {entry['where']:.4f}"
            line += f", {entry['boxes']} boxes, batch {entry['swarm_batch']})" if "boxes" in entry else ")"
        if "rounds_ok" in entry:
            line += (
                f" | last round: group {entry['group_size']}, staleness {entry['staleness_steps']}, "
                f"{entry['round_s']} s | rounds ok {entry['rounds_ok']} failed {entry['rounds_failed']} "
                f"no group {entry.get('rounds_no_group', 0)} | "
                f"averager failures {entry['averager_failures']}"
            )
        return line

    def on_end(self, task) -> None:
        """One last line for the final step, whatever LOG_FREQUENCY: a box whose swarm finished after a few of its
        steps (or between two lines) still reports where it ended and what it averaged."""
        trained = task.iteration > 0 and getattr(task, "last_batch", None) is not None
        if trained and task.iteration != self._last_logged:
            self._log(task)
        self.on_exception(task)

    def on_exception(self, task) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
