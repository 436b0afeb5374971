"""Ctrl-C during training stops at the next step boundary; before training, or pressed twice, at once (ctrl_c)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.conftest import REPO

SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from vissl_swarm.ctrl_c import ctrl_c
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
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(REPO)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
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


def interrupted() -> None:
    raise KeyboardInterrupt


def test_leaving_shuts_the_dht_down_and_a_second_ctrl_c_cuts_it_short(capsys) -> None:
    """run_trainer's ``leave``: a DHT of ours is shut down; Ctrl-C while leaving ends with 130's False, said on
    stderr (an error of the training run is not swallowed by it: ``main`` calls it in a ``finally`` without return)."""
    import hivemind

    from run_trainer import leave

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    assert leave(lambda: None, dht) is True
    assert not dht.is_alive()
    assert leave(interrupted, None) is False
    assert "Ctrl-C again: stopping without waiting" in capsys.readouterr().err
