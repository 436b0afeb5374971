"""``run_trainer.py`` whose steps take at least ``MIN_STEP_ENV`` seconds, for the scenario tests.

A scenario waits for what takes time, not steps: a group forms every few seconds (``--min_matchmaking_time``), a
restarted box takes its seconds to start. A trainer on a CPU steps as fast as the cores let it (~0.1-0.3 s a
step of ``swav_tiny``), so four of them keep two cores busy all along, and the rest of the suite (other tests, the
swarm's own daemons) waits for the cores. Paced, a step takes its compute and then sleeps the rest of the floor, as
on a box whose step takes that long: the trainer is the same (``run_trainer.main``, VISSL's hooks and ours), one
hook is added. The pause runs first at the end of a step, before any other hook's ``on_step``: outside the
averager's lock window, before the step is logged, checkpointed or stopped.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

from vissl_swarm import vissl_compat

vissl_compat.apply()  # before classy_vision is imported (as hooks/__init__.py does)

from classy_vision.hooks import ClassyHook  # noqa: E402

from hooks.quiet_hook import QuietHook  # noqa: E402
from vissl_swarm.local_swarm import LocalPeer  # noqa: E402

MIN_STEP_ENV = "PACED_TRAINER_MIN_STEP_S"
SCRIPT = Path(__file__)
# measured on this 2-core machine, the test of the four boxes' story alone: unpaced 229 s and 362 CPU-s; paced to
# 0.3 s 158 s and 235 CPU-s; to 0.6 s 170 s and 240 CPU-s (what is left is the processes' starts and hivemind's own)
# In the whole suite that test still took 382-457 CPU-s paced (364-400 unpaced): its peers live longer there, and a
# living peer's hivemind side costs 12-22% of a core (tests/conftest.py)
MIN_STEP_S = 0.3


class PaceOnStepHook(QuietHook):
    """Sleeps at the end of a step until ``min_step_s`` have passed since the previous step ended."""

    def __init__(self, min_step_s: float) -> None:
        super().__init__()
        self.min_step_s = min_step_s
        self._last_end = time.monotonic()

    def on_step(self, task) -> None:
        time.sleep(max(0.0, self._last_end + self.min_step_s - time.monotonic()))
        self._last_end = time.monotonic()


def paced_hook_generator(cfg, min_step_s: float) -> list[ClassyHook]:
    from hooks import swarm_hook_generator

    return [PaceOnStepHook(min_step_s), *swarm_hook_generator(cfg)]


def paced_peer(name: str, out_dir: Path, min_step_s: float = MIN_STEP_S, **fields) -> LocalPeer:
    """A ``LocalPeer`` that runs this script: its steps take at least ``min_step_s``."""
    return LocalPeer(name, out_dir, script=SCRIPT, env={MIN_STEP_ENV: str(min_step_s)}, **fields)


if __name__ == "__main__":
    import run_trainer

    min_step_s = float(os.environ.get(MIN_STEP_ENV, "0"))
    sys.exit(run_trainer.main(hook_generator=functools.partial(paced_hook_generator, min_step_s=min_step_s)))
