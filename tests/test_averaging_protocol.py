"""Both averagers implement ``averaging_protocol.Averaging`` (what the VISSL task and hooks call), and leave the
swarm without a traceback (``averager_shutdown``): real hivemind DHTs and averagers on 127.0.0.1.

Run as a script (``python tests/test_averaging_protocol.py improved old``), it plays the end of a run for each
design, as run_trainer.py does: train alone until shutdown (so a round is looking for a group), shut the
averager down, keep the DHT a second longer (it reads the averager's last requests), shut the DHT down.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import hivemind
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baselines.old_design import OldDesignAverager  # noqa: E402
from decentralized_sgd import DecentralizedSGD  # noqa: E402
from tests.dsgd_swarm import LOCAL, make_model  # noqa: E402
from vissl_swarm.averaging_protocol import Averaging  # noqa: E402

DESIGNS = {"improved": DecentralizedSGD, "old": OldDesignAverager}


def start(design: str, dht: hivemind.DHT, model: torch.nn.Module) -> Averaging:
    return DESIGNS[design](
        torch.optim.SGD(model.parameters(), lr=0.1),
        dht,
        prefix=f"protocol_{design}",
        model=model,
        min_matchmaking_time=1.0,
        request_timeout=0.5,
    )


def test_both_averagers_implement_the_protocol() -> None:
    dht = hivemind.DHT(start=True, host_maddrs=LOCAL)
    models = {design: make_model(value=0.5) for design in DESIGNS}
    averagers = {design: start(design, dht, models[design]) for design in DESIGNS}
    try:
        for design, averager in averagers.items():
            assert isinstance(averager, Averaging), design
            assert averager.needs_lock_for_forward is (design == "old")
            assert averager.last_applied_record() is None and averager.counters["rounds_applied"] == 0
            # alone in the swarm: nothing to download, our own weights stay; the task reads None as "keep your own
            # schedule" (the old design returns None always: it shares no training progress)
            assert averager.load_state_from_peers(timeout=2.0, accept=lambda progress: True) is None
            assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in models[design].parameters())
            averager.on_step_end(batch_size=4)
            assert averager.local_step == 1
    finally:
        for averager in averagers.values():
            averager.shutdown()
        dht.shutdown()


def test_averagers_leave_the_swarm_without_a_traceback() -> None:
    result = subprocess.run([sys.executable, __file__, *DESIGNS], capture_output=True, text=True, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert all(f"{design}: shut down in" in result.stdout for design in DESIGNS), output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def end_of_a_run(design: str) -> float:
    """Seconds the averager's shutdown took."""
    dht = hivemind.DHT(start=True, host_maddrs=LOCAL)
    averager = start(design, dht, make_model())
    until = time.monotonic() + 2.0
    while time.monotonic() < until:
        averager.on_step_end(batch_size=4)
        time.sleep(0.01)
    started = time.monotonic()
    averager.shutdown()
    shutdown_s = time.monotonic() - started
    time.sleep(1.0)
    dht.shutdown()
    return shutdown_s


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(f"{name}: shut down in {end_of_a_run(name):.1f} s", flush=True)
