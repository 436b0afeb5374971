"""Issue 13 with real DecentralizedSGD peers on 127.0.0.1: a diverged peer, a slowly drifting one, and peers without
the swarm's secret. Every wait has a deadline; no timing is asserted (the 60 s of the heal is the wait's deadline)."""

from __future__ import annotations

import logging
import threading

import pytest
from dsgd_swarm import WHOLE_ROUNDS, Swarm, all_equal_to, averaged_tensors, make_model, wait_until
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

import decentralized_sgd.optimizer as optimizer_module
from decentralized_sgd import DecentralizedSGD
from decentralized_sgd.secret import TAG_BYTES, SwarmSecret, SwarmSecretValidator
from decentralized_sgd.vetting import ALONE, REFUSED


def largest_deviation(peers: list[DecentralizedSGD], value: float) -> float:
    """max |w - value| over the averaged tensors of these peers (read without their lock: a poll, not a proof)."""
    return max(float((t - value).abs().max()) for p in peers for t in averaged_tensors(p))


def wait_watching(condition, timeout: float, peers: list[DecentralizedSGD], value: float, describe) -> float:
    """wait_until, polling how far these peers' weights ever got from `value` meanwhile; returns that."""
    worst = [largest_deviation(peers, value)]

    def watched() -> bool:
        worst.append(largest_deviation(peers, value))
        return condition()

    wait_until(watched, timeout, describe)
    return max(worst)


def sync(swarm: Swarm, peers: list[DecentralizedSGD], rounds: int = 1) -> None:
    """Train these peers until each applied `rounds` rounds: now each holds a reference (a point shared with them)."""
    for peer in peers:
        swarm.train(peer)
    wait_until(
        lambda: all(p.counters["rounds_applied"] >= rounds for p in peers), 60, lambda: [p.counters for p in peers]
    )


@pytest.mark.timeout(150)
def test_a_diverged_peer_is_left_out_and_heals(swarm, caplog):
    healthy = [swarm.peer(make_model(0.0), **WHOLE_ROUNDS), swarm.peer(make_model(1.0), **WHOLE_ROUNDS)]
    sync(swarm, healthy)  # both at 0.5 now
    with caplog.at_level(logging.WARNING, logger="decentralized_sgd"):
        diverged = swarm.peer(make_model(1e4), **WHOLE_ROUNDS)  # finite, as after a loss blow-up
        swarm.train(diverged)

        def healed() -> bool:
            return diverged.counters["outlier_heals"] >= 1 and all_equal_to([diverged], 0.5)

        worst = wait_watching(healed, 60, healthy, 0.5, lambda: (diverged.counters, [p.records[-2:] for p in healthy]))
    steps_at_heal = diverged.local_step
    assert worst + 0.5 < 10  # healthy peers stayed |w| < 10 all along (in fact at 0.5)
    assert all_equal_to(healthy, 0.5)
    assert diverged.counters["rounds_refused_as_outlier"] >= 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("diverged from the swarm" in line and "median |w|" in line for line in errors), errors
    excluded = [r for p in healthy for r in p.records if str(diverged.peer_id) in (r.get("outliers") or [])]
    assert excluded and sum(p.counters["rounds_outliers_excluded"] for p in healthy) >= 1
    # what the healthy peers applied without it moved them by a healthy amount (its 1e4 would have moved them ~1e4)
    assert all(r["update_norm"] < 1.0 for r in excluded if r["applied"]), [r for r in excluded if r["applied"]]
    # a group refused runs no AllReduce: its rounds report none (an AllReduce time would feed the pipelining delay)
    refused = [r for p in [diverged, *healthy] for r in p.records if r["error"] in (REFUSED, ALONE)]
    assert refused and all(r["allreduce_s"] is None for r in refused), refused
    assert any(
        "averaged without 1 member" in r.getMessage() or "no groupmate left" in r.getMessage() for r in caplog.records
    )
    wait_until(lambda: diverged.local_step > steps_at_heal, 30)  # and it trains on
    swarm.stop_training()


@pytest.mark.timeout(150)
def test_a_slowly_drifting_peer_is_caught_before_it_moves_the_others(swarm):
    healthy = [swarm.peer(make_model(1.0)), swarm.peer(make_model(1.0))]
    drifter = swarm.peer(make_model(1.0))
    drifting = threading.Event()

    def drift() -> None:
        if drifting.is_set():
            for tensor in averaged_tensors(drifter):
                tensor.mul_(1.05)

    for peer in healthy:
        swarm.train(peer)
    swarm.train(drifter, update=drift, period=0.1)  # x1.05 per step, 10 steps a second
    wait_until(
        lambda: all(p.counters["rounds_applied"] >= 1 for p in [*healthy, drifter]),
        60,
        lambda: [p.counters for p in [*healthy, drifter]],
    )
    drifting.set()

    def caught_twice_and_averaged() -> bool:  # the others kept averaging with each other (on a loaded machine
        # the drifter can be caught twice before they apply their second round)
        caught = drifter.counters["rounds_refused_as_outlier"] >= 2 and drifter.counters["outlier_heals"] >= 1
        return caught and all(p.counters["rounds_applied"] >= 2 for p in healthy)

    worst = wait_watching(
        caught_twice_and_averaged, 90, healthy, 1.0, lambda: (drifter.counters, [p.counters for p in healthy])
    )
    swarm.stop_training()
    assert worst <= 0.01, worst  # the others moved by at most 1%
    assert sum(p.counters["rounds_outliers_excluded"] for p in healthy) >= 1


class ReadsRawRecords(RecordValidatorBase):
    """The DHT validator of an outsider that patched its code: it reads the swarm's records by cutting off their tags
    (a tag is not encryption) and signs nothing (so nobody sees its own records)."""

    def validate(self, record: DHTRecord) -> bool:
        return True

    def strip_value(self, record: DHTRecord) -> bytes:
        suffix = len(SwarmSecretValidator._MAGIC) + TAG_BYTES
        tail = record.value[-suffix:]
        return record.value[:-suffix] if tail.startswith(SwarmSecretValidator._MAGIC) else record.value

    @property
    def priority(self) -> int:
        return 20


class KnowsThePrefix(SwarmSecret):
    """An outsider's secret: wrong, but it learned the swarm's keyed prefix (libp2p's identify shows the handler
    names), so it looks for groups where the swarm's peers do."""

    known: SwarmSecret

    def keyed_prefix(self, prefix: str) -> str:
        return self.known.keyed_prefix(prefix)


@pytest.mark.timeout(150)
def test_only_peers_with_the_swarm_secret_average_together(swarm, caplog, monkeypatch):
    secret = SwarmSecret(b"right")
    members = [swarm.peer(make_model(v), swarm_secret=secret, **WHOLE_ROUNDS) for v in (0.0, 2.0)]
    wrong = swarm.peer(make_model(5.0), swarm_secret=SwarmSecret(b"wrong"), no_group_patience=2.0)
    thief_secret = KnowsThePrefix(b"guess")
    thief_secret.known = secret
    with monkeypatch.context() as patch:  # the thief reads the swarm's records, and asks its leaders directly
        patch.setattr(optimizer_module, "SwarmSecretValidator", lambda *args, **kwargs: ReadsRawRecords())
        thief = swarm.peer(make_model(7.0), swarm_secret=thief_secret, no_group_patience=2.0)
    assert thief.prefix == members[0].prefix != wrong.prefix
    outsiders = {str(wrong.peer_id), str(thief.peer_id)}

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "no peer of this swarm accepts our secret" in r.getMessage()]

    def done() -> bool:
        return (
            all(p.counters["rounds_applied"] >= 2 for p in members)
            and len(lines()) >= 2
            and sum(p.counters["joins_refused_token"] for p in members) >= 1
        )

    with caplog.at_level(logging.ERROR, logger="decentralized_sgd"):
        for peer in [*members, wrong, thief]:
            swarm.train(peer)
        wait_until(done, 90, lambda: ([p.counters for p in members], lines()))
    swarm.stop_training()
    assert all_equal_to(members, 1.0) and all_equal_to([wrong], 5.0, atol=0) and all_equal_to([thief], 7.0, atol=0)
    assert wrong.counters["rounds_applied"] == thief.counters["rounds_applied"] == 0
    assert not any(set(r["group"] or []) & outsiders for p in members for r in p.records)
    assert all(
        r.levelno == logging.ERROR and "check --swarm_secret" in r.getMessage()
        for r in caplog.records
        if "accepts our secret" in r.getMessage()
    )

    # a leader's answer to join requests: a member's own token passes; a token copied from a member, junk, and a
    # peer refused in a recent group do not
    guard, mate = members[0].averager.guard, members[1]

    def refusal(request: averaging_pb2.JoinRequest, sender):
        return guard.refuse_join(MSGPackSerializer, request, sender)

    def request(payload: dict) -> averaging_pb2.JoinRequest:
        return averaging_pb2.JoinRequest(gather=MSGPackSerializer.dumps([None, 0, MSGPackSerializer.dumps(payload)]))

    payload = mate.vetting.payload()
    assert refusal(request(payload), mate.peer_id) is None
    before = guard.counts.as_dict()["joins_refused_token"]
    assert refusal(request(payload), thief.peer_id).code == averaging_pb2.PROTOCOL_VIOLATION
    assert refusal(averaging_pb2.JoinRequest(gather=b"junk"), mate.peer_id) is not None
    assert guard.counts.as_dict()["joins_refused_token"] == before + 2
    banned_before = guard.counts.as_dict()["joins_refused_banned"]
    guard._banned_until[mate.peer_id] = get_dht_time() + 60
    assert refusal(request(payload), mate.peer_id).code == averaging_pb2.NOT_LOOKING_FOR_GROUP
    assert guard.counts.as_dict()["joins_refused_banned"] == banned_before + 1
