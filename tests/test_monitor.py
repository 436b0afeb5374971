"""The swarm monitor: signed progress records in a real hivemind DHT on 127.0.0.1, and run_monitor.py watching
real VISSL trainers.

The trainers are plain run_trainer.py processes, each publishing its one record (``swarm_progress``). They run the
old design (``--averager old``, the benchmarks' baseline) with the default ``--load_state_timeout``: the task and
hooks are written against ``averaging_protocol.Averaging``, so the baseline must train and publish like the default
averager.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from tests.conftest import REPO, trainer_env
from tests.paced_trainer import paced_peer
from vissl_swarm.local_swarm import stop_all, wait_until
from vissl_swarm.swarm_progress import (
    PeerRecord,
    SignedCount,
    SwarmProgress,
    fetch_records,
    record_validators,
    records_key,
    status_fields,
)

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


def record(step: int, peer_id: str = "QmHonest", key: RSAPrivateKey | None = None, **fields) -> dict:
    """A record as a box signs it (``key``: its process key; a throwaway one by default)."""
    count = SignedCount.sign("valtest_swav_tiny", key or RSAPrivateKey(), 16 * step, 16)
    status = status_fields(step=step, loss=3.2, group_size=2, staleness_steps=1, rounds_ok=4, averager_failures=1)
    return PeerRecord(
        **{"owner": count.owner, "samples": count.samples, "batch": count.batch, "signature": count.signature},
        **{"run": "valtest_swav_tiny", "config": "swav_tiny", "recipe": {"--schedule": "swarm"}, "peer_id": peer_id},
        **{"time": get_dht_time(), "left": False, "samples_per_s": 12.5, **status, **fields},
    ).dict()


def owner_subkey(key: RSAPrivateKey) -> bytes:
    return RSASignatureValidator(key).local_public_key


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
    key, expiration = records_key(run_id), get_dht_time() + 60
    honest_key, forger_key = RSAPrivateKey(), RSAPrivateKey()
    monitor = dht([], record_validators(run_id))  # the monitor: this process's key
    addresses = [str(address) for address in monitor.get_visible_maddrs()]
    honest = dht(addresses, record_validators(run_id, honest_key))
    forger = dht(addresses, record_validators(run_id, forger_key))  # follows the rules, with a key of its own
    nodes = [monitor, honest, forger]
    try:
        victim = owner_subkey(honest_key)
        assert honest.store(key, record(7, key=honest_key), expiration, subkey=victim)

        # (while every peer validates, a store's result says whether any peer took the record)
        # another peer's subkey: the forger's DHT cannot sign for that key, and every peer refuses the record
        assert not forger.store(key, record(FORGED_STEP, key=honest_key), expiration + 1, subkey=victim)
        # correctly signed but against the schema: a float step, a missing field, a field too many, a negative count
        good = record(8, key=honest_key)
        bad_values = [
            {**good, "step": 8.0},
            {k: v for k, v in good.items() if k != "loss"},
            {**good, "admin": True},
            {**good, "averager_failures": -1},
        ]
        for bad_value in bad_values:
            assert not honest.store(key, bad_value, expiration + 2, subkey=victim), bad_value
        # a subkey without the owner's public key in it
        assert not honest.store(key, record(9, key=honest_key), expiration + 2, subkey=b"not-a-public-key")

        # a peer that added no validators keeps a forged record itself and serves it; readers reject its answers
        rogue = dht(addresses, None)
        nodes.append(rogue)
        rogue.store(key, record(FORGED_STEP, key=honest_key), expiration + 1, subkey=victim)
        assert stored_step(rogue, key, victim) == FORGED_STEP  # the forgery is out there
        assert stored_step(monitor, key, victim) == 7

        records = fetch_records(monitor, run_id)
        assert list(records) == [victim]
        assert records[victim]["step"] == 7 and records[victim]["peer_id"] == "QmHonest"
        assert records[victim]["averager_failures"] == 1
        assert fetch_records(forger, run_id)[victim]["step"] == 7  # any validating peer sees the same
        # a record signed by one key but published under another owner's subkey is not that owner's
        assert honest.store(key, record(10, key=forger_key), expiration + 3, subkey=victim)
        assert fetch_records(monitor, run_id) == {}
    finally:
        for node in nodes:
            node.shutdown()


def test_a_box_publishes_its_status_and_leaves_the_count_at_once() -> None:
    """The box's record carries what the trainer reported (a NaN loss as None); its last record, at shutdown, says it
    left: the monitor counts it out at once (no wait for the record to expire)."""
    from run_monitor import peer_rows, swarm_totals

    monitor = dht([], record_validators("hooktest"))
    trainer = dht([str(address) for address in monitor.get_visible_maddrs()], None)  # the box adds validators
    box = SwarmProgress(trainer, "hooktest_swav_tiny", 16, run_id="hooktest", config="swav_tiny", period=0.5)
    try:
        box.add(160)
        box.report(
            step=10,
            loss=float("nan"),
            group_size=3,
            staleness_steps=2,
            rounds_ok=5,
            rounds_failed=1,
            averager_failures=2,
            no_group_s=4.0,
        )
        published = wait_until(
            lambda: [r for r in fetch_records(monitor, "hooktest").values() if r["step"] == 10],
            30,
            "the box's record of step 10",
        )
        assert published[0] | {"loss": None, "group_size": 3, "rounds_ok": 5, "averager_failures": 2} == published[0]
        assert published[0]["samples"] == 160
        assert published[0]["peer_id"] == str(trainer.peer_id)
        assert swarm_totals(peer_rows(fetch_records(monitor, "hooktest"), get_dht_time()))["peers_alive"] == 1
        assert box.shutdown() is True and box.shutdown() is None  # its last record went out; once
        rows = peer_rows(fetch_records(monitor, "hooktest"), get_dht_time())
        assert [row["alive"] for row in rows] == [False] and swarm_totals(rows)["peers_alive"] == 0
    finally:
        box.shutdown()
        trainer.shutdown()
        monitor.shutdown()


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
        reader = dht(addresses, record_validators("montest"))  # (only a validating DHT can read signed records)
        victim, victim_record = next(iter(fetch_records(reader, "montest").items()))
        victim_id = victim_record["peer_id"]
        assert victim_id in trainer_ids
        rogue = dht(addresses, None)
        forged = {**record(FORGED_STEP, peer_id=victim_id), "time": get_dht_time() + 30}
        rogue.store(records_key("montest"), forged, get_dht_time() + 600, subkey=victim, return_future=True).result(
            timeout=60
        )
        assert stored_step(rogue, records_key("montest"), victim) == FORGED_STEP  # it validates nothing
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


def test_the_table_counts_boxes_as_the_trainers_do() -> None:
    """One row per box: a restarted box's earlier life (the same peer id, an older record of another process key) is
    not listed, a box whose last record says it left is not alive, and a live box without an applied round for over a
    minute (its no_group_s) is named under the table."""
    from run_monitor import format_table, peer_rows, swarm_totals

    now = get_dht_time()
    records = {
        b"a": record(10, "QmLonelyPeer01", no_group_s=95.0),
        b"b": record(10, "QmBusyPeer0002", no_group_s=3.0),
        b"c": {**record(10, "QmGonePeer0003", no_group_s=500.0), "left": True},
        b"d": {**record(3, "QmRestarted004"), "time": now - 30},  # its earlier life
        b"e": record(1, "QmRestarted004"),
    }
    rows = peer_rows(records, now)
    assert [(row["peer"], row["step"], row["alive"]) for row in rows] == [
        ("Peer0002", 10, True),
        ("Peer0003", 10, False),
        ("lyPeer01", 10, True),
        ("arted004", 1, True),
    ]
    totals = swarm_totals(rows)
    assert totals["peers_alive"] == 3 and totals["peers_listed"] == 4
    table = format_table(rows, totals)
    assert "(left)" in table and "swarm: 3 peers alive" in table
    alone = [line for line in table.splitlines() if line.startswith("alone")]
    assert alone == [
        "alone (no averaging round for over a minute; its log's warning says what to check): lyPeer01 (95 s)"
    ]
