"""Both averagers implement ``averaging_protocol.Averaging`` (what the VISSL task and hooks call), and leave the
swarm without a traceback (``hivemind_fixes``): real hivemind DHTs and averagers on 127.0.0.1.

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
import pytest
import torch
from hivemind.averaging.control import AveragingStage

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baselines.old_design import OldDesignAverager  # noqa: E402
from decentralized_sgd import DecentralizedSGD  # noqa: E402
from decentralized_sgd.averager import Averager  # noqa: E402
from tests.dsgd_swarm import LOCAL, make_model, wait_until  # noqa: E402
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


def _averagers(dhts: list[hivemind.DHT], values: list[float], prefix: str, **kwargs) -> list[Averager]:
    """One ``Averager`` per DHT, built with hivemind's arguments only, averaging two tensors set to each value."""
    return [
        Averager(
            [torch.full((3,), value), torch.full((2, 2), -value)],
            dht,
            prefix=prefix,
            target_group_size=2,
            min_matchmaking_time=2.0,
            request_timeout=1.0,
            start=True,
            **kwargs,
        )
        for dht, value in zip(dhts, values, strict=False)
    ]


def _values(averager: Averager) -> list[float]:
    """Each tensor's value (they are constant: averaging keeps them so)."""
    with averager.get_tensors() as tensors:
        assert all(bool((t == t.flatten()[0]).all()) for t in tensors), tensors
        return [float(t.flatten()[0]) for t in tensors]


def _shut_down(averagers: list[Averager]) -> None:
    for averager in averagers:
        averager.shutdown()


@pytest.mark.timeout(300)
def test_our_averager_built_as_hiveminds_keeps_its_contract() -> None:
    """``Averager`` with hivemind's arguments only is hivemind's DecentralizedAverager (nobody vets its groups):
    an exact mean once, a weighted one, a grid of groups of two, a trigger, a cancel, a state download."""
    dhts = [hivemind.DHT(start=True, host_maddrs=LOCAL)]
    dhts += [hivemind.DHT(start=True, host_maddrs=LOCAL, initial_peers=dhts[0].get_visible_maddrs()) for _ in range(3)]
    try:
        pair = _averagers(dhts, [0.0, 4.0], "contract_once")  # once, then weighted 1:3
        try:
            controls = [averager.step(wait=False, timeout=60) for averager in pair]
            assert all(isinstance(control.result(timeout=90), dict) for control in controls)
            assert [_values(a) for a in pair] == [[2.0, -2.0]] * 2
            with pair[1].get_tensors() as tensors:
                for tensor in tensors:
                    tensor.mul_(3)  # 2 and 6 now (and their negatives)
            controls = [
                averager.step(wait=False, weight=w, timeout=60) for averager, w in zip(pair, (1.0, 3.0), strict=True)
            ]
            for control in controls:
                control.result(timeout=90)
            assert [_values(a) for a in pair] == [[5.0, -5.0]] * 2  # (1 * 2 + 3 * 6) / 4
        finally:
            _shut_down(pair)

        bits = ["0", "0", "1", "1"]  # a grid: two groups of two, then the groups cross (hivemind's group bits)
        grid = [
            averager
            for averager_bits, dht, value in zip(bits, dhts, [0.0, 1.0, 2.0, 3.0], strict=True)
            for averager in _averagers([dht], [value], "contract_grid", initial_group_bits=averager_bits)
        ]
        try:
            for _ in range(2):
                controls = [averager.step(wait=False, timeout=60) for averager in grid]
                for control in controls:
                    control.result(timeout=90)
            assert [_values(a) for a in grid] == [[1.5, -1.5]] * 4
        finally:
            _shut_down(grid)

        pair = _averagers(dhts, [1.0, 3.0], "contract_trigger")
        try:
            controls = [averager.step(wait=False, require_trigger=True, timeout=60) for averager in pair]
            wait_until(lambda: all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls), 60)
            assert [_values(a) for a in pair] == [[1.0, -1.0], [3.0, -3.0]]  # nothing averaged before the trigger
            for control in controls:
                control.allow_allreduce()
            for control in controls:
                control.result(timeout=90)
            assert [_values(a) for a in pair] == [[2.0, -2.0]] * 2

            alone = pair[0].step(wait=False, require_trigger=True, timeout=60)
            alone.cancel()
            assert alone.cancelled()
            wait_until(lambda: alone.stage == AveragingStage.FINISHED, 30)
            assert _values(pair[0]) == [2.0, -2.0]
        finally:
            _shut_down(pair)

        donor, joiner = _averagers(dhts, [7.0, 0.0], "contract_state")
        try:
            downloaded = []
            wait_until(lambda: downloaded.append(joiner.load_state_from_peers(timeout=10)) or downloaded[-1], 60)
            metadata, tensors = downloaded[-1]
            assert [float(t.flatten()[0]) for t in tensors] == [7.0, -7.0] and "group_key" in metadata
        finally:
            _shut_down([donor, joiner])
    finally:
        for dht in dhts:
            dht.shutdown()


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
