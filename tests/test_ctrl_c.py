"""Ctrl-C during training stops at the next step boundary; before training, or pressed twice, at once (ctrl_c.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.conftest import REPO

SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from ctrl_c import ctrl_c
ctrl_c.install()
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.1)
except KeyboardInterrupt:
    print("before training: at once", flush=True)
ctrl_c.training = True
print("training", flush=True)
steps = 0
try:
    while True:  # a training loop: the step boundary is where it may stop
        time.sleep(0.05)  # the step (the signal arrives in here)
        steps += 1
        ctrl_c.stop_if_requested()
except KeyboardInterrupt:
    print(f"stopped at a step boundary after step {steps}", flush=True)
ctrl_c.requested = False
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C
    time.sleep(5)
except KeyboardInterrupt:
    print("twice: at once", flush=True)
"""


def test_ctrl_c_waits_for_the_step_boundary_once_training_runs() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(REPO)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "before training: at once"
        assert proc.stdout.readline().strip() == "training"
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = out.splitlines()
    assert proc.returncode == 0, err
    assert lines[0].startswith("stopped at a step boundary after step"), out
    assert lines[1] == "twice: at once", out
    assert "stops after the current step" in err and "Traceback" not in err, err
