"""bench_averaging's arms: how a peer's training loop drives each design, and what it records of each round."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.averaging_setup import ABLATIONS, RunConfig
from benchmarks.common import decentralized_sgd


class StepTimer:
    """Times and counts the inner optimizer's steps: averaging holds the trainer for what a step takes beyond them."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.updates, self.inner_s, self._started = 0, 0.0, 0.0
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.inner_s += time.perf_counter() - self._started
        self.updates += 1

    def hold(self, call: Callable[[], Any]) -> float:
        """Run call(); return the seconds it took beyond the inner optimizer steps that ran meanwhile."""
        inner_before, started = self.inner_s, time.perf_counter()
        call()
        return time.perf_counter() - started - (self.inner_s - inner_before)


class StageWatch(threading.Thread):
    """Stamps the stage times of the baselines' rounds in flight (they do not record them), polling their controls."""

    POLL_S = 0.02

    def __init__(self, in_flight: Callable[[], list[tuple[dict, Any]]]):
        super().__init__(name="stage-watch", daemon=True)
        self.in_flight, self.stopped = in_flight, threading.Event()
        self._bound: dict[int, Any] = {}

    def run(self) -> None:
        from hivemind.averaging.control import AveragingStage

        while not self.stopped.wait(self.POLL_S):
            for record, control in self.in_flight():
                bound = self._bound.get(id(record))
                if bound is None:  # a record is bound to the first control seen running with it, not the last one's
                    if control is None or control.done():
                        continue
                    self._bound[id(record)] = bound = control
                if "t_done" in record:
                    continue
                now, stage = time.time(), bound.stage.value
                record.setdefault("t_matchmaking_start", now)
                if stage >= AveragingStage.AWAITING_TRIGGER.value:
                    record.setdefault("t_group_formed", now)
                if stage >= AveragingStage.RUNNING_ALLREDUCE.value:
                    record.setdefault("t_allreduce_start", now)
                if bound.done():
                    record["t_done"] = now

    @staticmethod
    def view(record: dict) -> dict:
        """The record with the stage durations the metrics read; an AllReduce shorter than a poll formed at its end."""
        out = dict(record)
        t_done = out.get("t_done") or out.get("t_end")
        if t_done is not None and out.get("group_size", 0) >= 2:
            out.setdefault("t_group_formed", t_done)
            out.setdefault("t_allreduce_start", t_done)
        t_start = out.setdefault("t_matchmaking_start", out["t_start"])
        t_group, t_allreduce = out.get("t_group_formed"), out.get("t_allreduce_start")
        if t_group is not None:
            out["matchmaking_s"] = t_group - t_start
            if t_allreduce is not None:
                out["awaiting_trigger_s"] = t_allreduce - t_group
                if t_done is not None:
                    out["allreduce_s"] = t_done - t_allreduce
        return out

    @staticmethod
    def open_view(record: dict) -> dict:
        keys = ("round", "t_start", "t_group_formed", "t_allreduce_start")
        return {**{key: record.get(key) for key in keys}, "in_flight": True}


class NoAveraging:
    """Baseline: every peer trains alone."""

    def __init__(self, trainer: Any):
        self.trainer, self.local_step = trainer, 0
        self.timer, self.holds = StepTimer(trainer.opt), []

    def begin(self) -> None:
        pass

    def train_step(self) -> None:
        self.trainer.compute()
        self.holds.append(self.timer.hold(self.trainer.opt.step))
        self.local_step += 1

    def records(self) -> list[dict]:
        return []

    def in_flight(self) -> list[dict]:
        return []

    def counters(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


class BaselineArm:
    """What the baselines' arms share: an ``averager`` whose rounds in flight a ``StageWatch`` (``watch``) stamps."""

    averager: Any
    watch: StageWatch

    @property
    def local_step(self) -> int:
        return self.averager.local_step

    def begin(self) -> None:
        self.watch.start()

    def records(self) -> list[dict]:
        return [StageWatch.view(record) for record in list(self.averager.records)]

    def in_flight(self) -> list[dict]:
        return [StageWatch.open_view(record) for record, _ in self.watch.in_flight()]

    def shutdown(self) -> None:
        self.watch.stopped.set()
        self.averager.shutdown()


class OldDesign(BaselineArm):
    """``baselines.old_design``: a thread runs ``TrainingAverager.step(data_lock=lock)``; the trainer steps under it."""

    def __init__(self, trainer: Any, dht: Any, cfg: RunConfig, prefix: str):
        from baselines.old_design import OldDesignAverager

        self.trainer, self.holds = trainer, []  # per step: the wait for the data lock (the averager's snapshot/apply)
        self.averager = OldDesignAverager(
            trainer.opt, dht, prefix=prefix, model=trainer.model, **cfg.averager_options()
        )
        self.watch = StageWatch(self._open)

    def _open(self) -> list[tuple[dict, Any]]:
        current = self.averager.current
        return [] if current is None else [(current, self.averager.averager.control)]

    def train_step(self) -> None:
        self.trainer.compute()
        asked = time.perf_counter()
        with self.averager.lock:
            self.holds.append(time.perf_counter() - asked)
            self.trainer.opt.step()
            self.averager.on_step_end(self.trainer.batch_size)
        time.sleep(0)  # let a waiting averager thread take the lock (a real loop would fetch data here)

    def records(self) -> list[dict]:
        records = super().records()
        for record in records:  # the averager copies inside the trainer's next step (0-based index: steps done)
            record["copy_step_indices"] = [record[k] for k in ("step_at_snapshot", "step_at_apply") if k in record]
        return records

    def counters(self) -> dict:
        return {"rounds": len(self.averager.records)}


class ImprovedDesign:
    """DecentralizedSGD with one set of ablation switches (the mode)."""

    def __init__(self, trainer: Any, dht: Any, cfg: RunConfig, prefix: str):
        self.trainer, self.timer, self.holds = trainer, StepTimer(trainer.opt), []
        self.opt = decentralized_sgd(
            trainer.opt,
            dht,
            ablations=ABLATIONS[cfg.mode],
            prefix=prefix,
            model=trainer.model,
            min_group_size=2,
            verbose=cfg.verbose,
            **cfg.averager_options(),
        )

    @property
    def local_step(self) -> int:
        return int(self.opt.local_step)

    def begin(self) -> None:
        pass

    def train_step(self) -> None:
        self.trainer.compute()
        self.holds.append(self.timer.hold(lambda: self.opt.step(batch_size=self.trainer.batch_size)))

    def records(self) -> list[dict]:
        return [dict(record) for record in list(self.opt.records)]

    def in_flight(self) -> list[dict]:
        """Rounds not resolved yet (their spans count towards the duty cycle up to the end of the window)."""
        return [dict(record, in_flight=True) for record in self.opt.in_flight_rounds()]

    def counters(self) -> dict:
        return dict(getattr(self.opt, "counters", {}) or {})

    def shutdown(self) -> None:
        self.opt.shutdown()


def make_driver(cfg: RunConfig, trainer: Any, dht: Any) -> Any:
    prefix = f"bench_{cfg.regime}_{cfg.mode}"
    if cfg.mode == "none":
        return NoAveraging(trainer)
    if cfg.mode == "old":
        return OldDesign(trainer, dht, cfg, prefix)
    return ImprovedDesign(trainer, dht, cfg, prefix)
