"""The swarm monitor: signed progress records in a real hivemind DHT on 127.0.0.1, and run_monitor.py watching
real VISSL trainers.

The trainers are plain run_trainer.py processes: they publish once PublishProgressOnStepHook is in
``hooks.swarm_hook_generator`` (test_trainers_publish_through_the_swarm_hooks checks that it is). They run the old
design (``--averager old``, the benchmarks' baseline) with the default ``--load_state_timeout``: the hooks are
written against ``averaging_protocol.Averaging``, so the baseline must train and publish like the default averager.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from tests.conftest import REPO, trainer_env
from tests.paced_trainer import paced_peer
from vissl_swarm.local_swarm import stop_all, wait_until
from vissl_swarm.swarm_metrics import fetch_metrics, make_record, metrics_key, metrics_validators, owner_subkey

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
FORGED_STEP = 10**6

# the trainers run until the test stops them; publish (LOG_FREQUENCY) every 2 steps; no checkpoints on the way
LOG_FREQUENCY = 2
TRAINER_OVERRIDES = [
    "config.DATA.TRAIN.DATA_LIMIT=160",
    "config.OPTIMIZER.num_epochs=300",
    f"config.LOG_FREQUENCY={LOG_FREQUENCY}",
    "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=100000",
]
TRAINER_FLAGS = [
    "--run_id",
    "montest",
    "--averager",
    "old",
    "--target_group_size",
    "2",
    "--min_matchmaking_time",
    "2",
    "--averaging_timeout",
    "20",
    "--next_chunk_timeout",
    "4",
    "--compression",
    "none",
]


def record(step: int, peer_id: str = "QmHonest") -> dict:
    return make_record(
        step=step,
        samples_per_s=12.5,
        loss=3.2,
        group_size=2,
        staleness_steps=1,
        rounds_ok=4,
        rounds_failed=0,
        averager_failures=1,
        time=get_dht_time(),
        peer_id=peer_id,
    )


def dht(initial_peers: list[str], validators: list | None) -> hivemind.DHT:
    node = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=initial_peers)
    if validators is not None:
        node.add_validators(validators)
    return node


async def _stored_step(_dht: hivemind.DHT, node, key: str, subkey: bytes) -> int | None:
    """Runs inside a DHT's process: the step of the record that this very node keeps (no search, no validation)."""
    found = node.protocol.storage.get(DHTID.generate(source=key))
    if found is None or not isinstance(found.value, DictionaryDHTValue):
        return None
    entry = found.value.get(subkey)
    if entry is None:
        return None
    unsigned = RSASignatureValidator().strip_value(DHTRecord(b"", b"", entry.value, entry.expiration_time))
    return MSGPackSerializer.loads(unsigned)["step"]


def stored_step(node: hivemind.DHT, key: str, subkey: bytes) -> int | None:
    return node.run_coroutine(partial(_stored_step, key=key, subkey=subkey))


def test_forged_and_malformed_records_are_rejected() -> None:
    run_id = "valtest"
    key, expiration = metrics_key(run_id), get_dht_time() + 60
    monitor = dht([], metrics_validators(run_id))  # the monitor: this process's key
    addresses = [str(address) for address in monitor.get_visible_maddrs()]
    honest_key, forger_key = RSAPrivateKey(), RSAPrivateKey()
    honest = dht(addresses, metrics_validators(run_id, honest_key))
    forger = dht(addresses, metrics_validators(run_id, forger_key))  # follows the rules, with a key of its own
    nodes = [monitor, honest, forger]
    try:
        victim = owner_subkey(honest_key)
        assert honest.store(key, record(step=7), expiration, subkey=victim)

        # (while every peer validates, a store's result says whether any peer took the record)
        # another peer's subkey: the forger's DHT cannot sign for that key, and every peer refuses the record
        assert not forger.store(key, record(FORGED_STEP), expiration + 1, subkey=victim)
        # correctly signed but against the schema: a float step, a missing field, a field too many, a negative count
        bad_values = [
            {**record(8), "step": 8.0},
            {k: v for k, v in record(8).items() if k != "loss"},
            {**record(8), "admin": True},
            {**record(8), "averager_failures": -1},
        ]
        for bad_value in bad_values:
            assert not honest.store(key, bad_value, expiration + 2, subkey=victim), bad_value
        # a subkey without the owner's public key in it
        assert not honest.store(key, record(9), expiration + 2, subkey=b"not-a-public-key")

        # a peer that added no validators keeps a forged record itself and serves it; readers reject its answers
        rogue = dht(addresses, None)
        nodes.append(rogue)
        rogue.store(key, record(FORGED_STEP), expiration + 1, subkey=victim)
        assert stored_step(rogue, key, victim) == FORGED_STEP  # the forgery is out there
        assert stored_step(monitor, key, victim) == 7

        records = fetch_metrics(monitor, run_id)
        assert list(records) == [victim]
        assert records[victim]["step"] == 7 and records[victim]["peer_id"] == "QmHonest"
        assert records[victim]["averager_failures"] == 1
        assert fetch_metrics(forger, run_id)[victim]["step"] == 7  # any validating peer sees the same

        # a peer of an older version publishes no averager_failures: its record is valid, read as 0 failures
        older = {k: v for k, v in record(11).items() if k != "averager_failures"}
        assert honest.store(key, older, expiration + 3, subkey=victim)
        assert fetch_metrics(monitor, run_id)[victim] == {**older, "averager_failures": 0}
    finally:
        for node in nodes:
            node.shutdown()


def stub_task(node: hivemind.DHT, iteration: int) -> SimpleNamespace:
    """The parts of a DecentralizedSelfSupervisionTask that the hook reads, around a real DHT."""
    applied = {"applied": True, "group_size": 3, "staleness_steps": 2}  # then a failed round
    averager = SimpleNamespace(
        last_applied_record=lambda: applied, counters={"rounds_applied": 5, "rounds_failed": 1, "averager_failures": 2}
    )
    return SimpleNamespace(
        dht=node,
        decentralized_sgd=averager,
        swarm_settings=SimpleNamespace(run_id="hooktest"),
        train=True,
        iteration=iteration,
        get_global_batchsize=lambda: 16,
        last_batch=SimpleNamespace(loss=torch.tensor(float("nan"))),
    )


def test_hook_publishes_and_survives_a_dead_dht(caplog: pytest.LogCaptureFixture) -> None:
    from hooks.publish_progress_on_step_hook import PublishProgressOnStepHook

    monitor = dht([], metrics_validators("hooktest"))
    trainer = dht([str(address) for address in monitor.get_visible_maddrs()], None)  # the hook adds validators
    try:
        hook = PublishProgressOnStepHook(publish_every=5)
        task = stub_task(trainer, iteration=0)
        hook.on_start(task)
        for last in (5, 10):  # the record of step 10 replaces that of step 5 (the same owner subkey)
            # the hook skips a step while its previous store is in flight: let that one finish first
            wait_until(lambda: hook._pending is None or hook._pending.done(), 30, "the hook's previous store")
            for iteration in range(last - 4, last + 1):
                task.iteration = iteration
                hook.on_step(task)
            published = wait_until(
                lambda last=last: [r for r in fetch_metrics(monitor, "hooktest").values() if r["step"] == last],
                30,
                f"the hook's record of step {last}",
            )
        assert published == [
            {
                **published[0],
                "group_size": 3,
                "staleness_steps": 2,
                "rounds_ok": 5,
                "rounds_failed": 1,
                "averager_failures": 2,
                "loss": None,
                "peer_id": str(trainer.peer_id),
            }
        ]
        # the hook skips a step while its previous store is in flight: let that one finish before the DHT dies
        wait_until(lambda: hook._pending is None or hook._pending.done(), 30, "the hook's last store")
    finally:
        trainer.shutdown()
    try:
        task.iteration = 15
        hook.on_step(task)  # the DHT is gone: a warning, never an exception in the trainer
        hook.on_step(task)
        # one warning per run of failures: the first one may be about the last store before the DHT went away
        warnings = [line for line in caplog.text.splitlines() if "publish_progress_on_step_hook" in line]
        assert warnings and all(line.startswith("WARNING") for line in warnings), caplog.text
    finally:
        monitor.shutdown()


def publishing_hooks() -> list:
    """The publishing hooks that run_trainer.py hands to VISSL for the tiny config."""
    from hooks import swarm_hook_generator
    from hooks.publish_progress_on_step_hook import PublishProgressOnStepHook
    from vissl_swarm.config_loading import compose_config

    config, _ = compose_config("swav_tiny", ["config.LOG_FREQUENCY=2"], has_gpu=False)
    return [hook for hook in swarm_hook_generator(config) if isinstance(hook, PublishProgressOnStepHook)]


def test_trainers_publish_through_the_swarm_hooks() -> None:
    hooks = publishing_hooks()
    assert len(hooks) == 1, "wire PublishProgressOnStepHook into hooks.swarm_hook_generator"
    assert hooks[0].publish_every == 2  # as often as the progress log line (config.LOG_FREQUENCY)


def start_monitor(tmp_path: Path, table: Path) -> tuple[subprocess.Popen, Path]:
    log_path = tmp_path / "monitor.log"
    command = [
        sys.executable,
        str(REPO / "run_monitor.py"),
        "--run_id",
        "montest",
        "--config",
        "swav_tiny",
        "--host_maddrs",
        *LOOPBACK,
        "--refresh_period",
        "2",
        "--json",
        str(table),
        "--tensorboard_dir",
        str(tmp_path / "tensorboard"),
    ]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=trainer_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return process, log_path


def join_line(process: subprocess.Popen, log_path: Path) -> str:
    def line() -> str | None:
        assert process.poll() is None, f"the monitor exited: {log_path.read_text()[-2000:]}"
        return next((text for text in log_path.read_text().splitlines() if "run_trainer.py" in text), None)

    return wait_until(line, 120, "the monitor's join line")


def monitor_table(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.mark.xdist_group("swarm_scenarios")
@pytest.mark.timeout(600)
def test_monitor_shows_both_trainers_and_ignores_a_forgery(digits_dir: Path, tmp_path: Path) -> None:
    assert publishing_hooks(), "wire PublishProgressOnStepHook into hooks.swarm_hook_generator"
    table = tmp_path / "table.json"
    monitor, log_path = start_monitor(tmp_path, table)
    trainers = [paced_peer(f"peer{index}", tmp_path) for index in range(2)]
    reader = rogue = None
    try:
        line = join_line(monitor, log_path)
        assert "--config swav_tiny --run_id montest" in line
        addresses = line.split("--initial_peers", 1)[1].split()
        assert addresses and all("/p2p/" in address for address in addresses)

        for trainer in trainers:  # both join through the monitor, the swarm's bootstrap peer
            trainer.start(digits_dir, addresses, TRAINER_FLAGS, TRAINER_OVERRIDES)
        trainer_ids = {trainer.join_addresses()[0].rsplit("/p2p/", 1)[1] for trainer in trainers}

        def both_trainers_listed() -> dict | None:
            for trainer in trainers:
                assert trainer.is_running(), trainer.log_text()[-3000:]
            rows = monitor_table(table).get("peers", [])
            ids = {row["peer_id"] for row in rows if row["step"] > 0}
            return rows if ids == trainer_ids else None

        wait_until(both_trainers_listed, 400, "both trainers in the monitor's table")
        rows = wait_until(
            lambda: [row for row in both_trainers_listed() or [] if row["group_size"] == 2],
            300,
            "an averaging round of the two trainers in the monitor's table",
        )
        assert rows[0]["rounds_ok"] >= 1 and rows[0]["samples_per_s"] > 0 and rows[0]["averager_failures"] == 0

        # both trained past their first progress line, where the old design once crashed (last_applied_record)
        def both_past(step: int) -> list[dict] | None:
            rows = both_trainers_listed()
            return rows if rows and all(row["step"] >= step for row in rows) else None

        wait_until(lambda: both_past(2 * LOG_FREQUENCY), 120, "both trainers past their first progress line")

        # a peer without validators overwrites one trainer's record: the monitor keeps showing the real one
        reader = dht(addresses, metrics_validators("montest"))  # (only a validating DHT can read signed records)
        victim, victim_record = next(iter(fetch_metrics(reader, "montest").items()))
        victim_id = victim_record["peer_id"]
        assert victim_id in trainer_ids
        rogue = dht(addresses, None)
        forged = {**record(FORGED_STEP, peer_id=victim_id), "time": get_dht_time() + 30}
        rogue.store(metrics_key("montest"), forged, get_dht_time() + 600, subkey=victim, return_future=True).result(
            timeout=60
        )
        assert stored_step(rogue, metrics_key("montest"), victim) == FORGED_STEP  # it validates nothing
        seen = monitor_table(table)["refresh"]
        wait_until(lambda: monitor_table(table).get("refresh", 0) >= seen + 2, 60, "two more monitor refreshes")
        victim_row = next(row for row in monitor_table(table)["peers"] if row["peer_id"] == victim_id)
        assert 0 < victim_row["step"] < FORGED_STEP
        totals = monitor_table(table)["totals"]
        assert totals["peers_alive"] == 2 and totals["samples_per_s"] > 0
    finally:
        stop_all(trainers)
        for node in (reader, rogue):
            if node is not None:
                node.shutdown()
        if monitor.poll() is None:
            os.killpg(monitor.pid, signal.SIGINT)
            monitor.wait(timeout=60)
    assert monitor.returncode == 0, log_path.read_text()[-2000:]
    output = log_path.read_text()
    assert "swarm: 2 peers alive" in output and "averager failures" in output and "Traceback" not in output
    assert 2 in tensorboard_scalars(tmp_path / "tensorboard", "swarm/peers_alive")


def tensorboard_scalars(log_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [event.value for event in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--initial_peers", "/ip4/127.0.0.1/tcp/31337"], "has no /p2p/<peer id> part"),
        (["--refresh_period", "0"], "--refresh_period must be positive"),
    ],
)
def test_bad_monitor_flags_fail_with_a_clear_error(flags: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "run_monitor.py"), *flags],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_the_table_lists_peers_that_average_with_nobody() -> None:
    """A live peer without an applied round for over a minute (its no_group_s) is named under the table; a gone one,
    or a peer of an older version (no such field), is not."""
    from run_monitor import format_table, peer_rows, swarm_totals

    now = 1_000.0

    def published(peer_id: str, no_group_s: float | None, seen_at: float) -> dict:
        record = make_record(
            step=10,
            samples_per_s=1.0,
            loss=1.0,
            group_size=None,
            staleness_steps=None,
            rounds_ok=0,
            rounds_failed=4,
            time=seen_at,
            peer_id=peer_id,
            no_group_s=no_group_s or 0,
        )
        return record if no_group_s is not None else {k: v for k, v in record.items() if k != "no_group_s"}

    records = {
        b"a": published("QmLonelyPeer01", 95.0, now - 1),
        b"b": published("QmBusyPeer0002", 3.0, now - 1),
        b"c": published("QmGonePeer0003", 500.0, now - 600),
        b"d": published("QmOlderPeer004", None, now - 1),
    }
    rows = peer_rows(records, now, alive_window=60)
    table = format_table(rows, swarm_totals(rows))
    alone = [line for line in table.splitlines() if line.startswith("alone")]
    assert alone == [
        "alone (no averaging round for over a minute; its log's warning says what to check): lyPeer01 (95 s)"
    ]
