"""The GPU check's trainer: ``run_trainer.py`` with one more VISSL hook, which times a window of training steps.

    python -m scripts.measured_trainer --result R --schema S --warmup_steps W --window_steps N --min_rounds K \
        -- <run_trainer.py arguments>

``measured_hook_generator`` is the swarm's hooks plus ``MeasureWindowHook``; VISSL pickles it into each local
process of a box (spawned: they re-import this module first, hence vissl_compat at import, as in run_trainer.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vissl_swarm import vissl_compat

vissl_compat.apply()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from classy_vision.hooks import ClassyHook  # noqa: E402

from hooks import swarm_hook_generator  # noqa: E402
from hooks.quiet_hook import QuietHook  # noqa: E402


@dataclass
class WindowSettings:
    result_path: str
    schema_path: str  # the averager's prefix and tensor shapes, for the simulated peer
    warmup_steps: int
    window_steps: int
    min_rounds: int  # the window starts once this many rounds were applied (0: no averaging)


# DecentralizedSGD's own counts of its data path (see its counters): (count, seconds) per reported mean
TIMED = {"fill": ("fills", "fill_s"), "fill_locked": ("fills", "fill_locked_s"), "apply": ("applies", "apply_s")}
COUNTED = ("rounds_applied", "trainer_s", *{key for pair in TIMED.values() for key in pair})


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _host_timer_total(task: Any, name: str) -> float:
    """VISSL's PerfStats sums host timers (seconds) per name (``read_sample``: waiting for the data loader)."""
    stats = getattr(getattr(task, "perf_stats", None), "_host_stats", None) or {}
    metric = stats.get(name)
    return float(metric.sum_values) if metric is not None else 0.0


class MeasureWindowHook(QuietHook):
    """On local rank 0: after a warm-up (and, with averaging, once rounds are applied), time a window of steps
    and write what it measured to ``settings.result_path`` (the check then stops the trainer)."""

    def __init__(self, settings: WindowSettings) -> None:
        super().__init__()
        self.settings = settings
        self.steps, self.start, self.done, self.averaging = 0, None, False, None

    def on_start(self, task) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            self.done = True
            return
        self.averaging = getattr(task, "decentralized_sgd", None)
        if self.averaging is not None:
            with self.averaging.averager.get_tensors() as tensors:
                shapes = [list(t.shape) for t in tensors]
            schema = {"prefix": self.averaging.prefix, "shapes": shapes}
            Path(self.settings.schema_path).write_text(json.dumps(schema))

    def on_update(self, task) -> None:
        if self.done:
            return
        self.steps += 1
        if self.start is None:
            if self.steps >= self.settings.warmup_steps and self._rounds() >= self.settings.min_rounds:
                _synchronize()
                self.start = {"step": self.steps, **self._snapshot(task)}
            return
        if self.steps - self.start["step"] < self.settings.window_steps:
            return
        _synchronize()
        self.done = True
        Path(self.settings.result_path).write_text(json.dumps(self._result(task, self._snapshot(task))))

    def _rounds(self) -> int:
        return int(self.averaging.counters["rounds_applied"]) if self.averaging is not None else 0

    def _snapshot(self, task) -> dict:
        counters = self.averaging.counters if self.averaging is not None else {}
        return {
            "time": time.perf_counter(),
            "counters": {key: counters.get(key, 0.0) for key in COUNTED},
            "read_sample": _host_timer_total(task, "read_sample"),
            "records": len(self.averaging.records) if self.averaging is not None else 0,
        }

    def _result(self, task, end: dict) -> dict:
        start, steps = self.start, self.settings.window_steps
        elapsed = end["time"] - start["time"]
        result = {
            "steps": steps,
            "step_s": elapsed / steps,
            "samples_per_s": task.get_global_batchsize() * steps / elapsed,
            "data_wait_ms_per_step": 1000 * (end["read_sample"] - start["read_sample"]) / steps,
            "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        }
        if self.averaging is None:
            return result
        records = self.averaging.records[start["records"] : end["records"]]
        allreduce = [r["allreduce_s"] for r in records if r["applied"] and r["allreduce_s"] is not None]
        delta = {key: end["counters"][key] - start["counters"][key] for key in COUNTED}
        result.update(
            rounds_applied=int(delta["rounds_applied"]),
            trainer_ms_per_step=1000 * delta["trainer_s"] / steps,
            allreduce_s=statistics.fmean(allreduce) if allreduce else None,
        )
        for name, (count, seconds) in TIMED.items():
            result[f"{name}_ms"] = 1000 * delta[seconds] / delta[count] if delta[count] else None
        for name in ("fill", "apply"):  # per round, from the records of the rounds resolved in the window
            values = [r[f"{name}_ms"] for r in records if r.get(f"{name}_ms") is not None]
            result[f"{name}_ms_max"] = max(values) if values else None
        return result


def measured_hook_generator(settings: WindowSettings, cfg) -> list[ClassyHook]:
    return [*swarm_hook_generator(cfg), MeasureWindowHook(settings)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--result", required=True, help="where the measured window goes (JSON)")
    parser.add_argument("--schema", required=True, help="where the averager's prefix and shapes go (JSON)")
    parser.add_argument("--warmup_steps", type=int, required=True)
    parser.add_argument("--window_steps", type=int, required=True)
    parser.add_argument("--min_rounds", type=int, required=True, help="rounds applied before the window starts")
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then run_trainer.py's arguments")
    args = parser.parse_args(argv)
    import run_trainer

    settings = WindowSettings(args.result, args.schema, args.warmup_steps, args.window_steps, args.min_rounds)
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    return run_trainer.main(trainer_args, hook_generator=functools.partial(measured_hook_generator, settings))


if __name__ == "__main__":
    sys.exit(main())
