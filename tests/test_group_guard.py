"""GroupGuard with real hivemind averagers on 127.0.0.1: a diverged member and an outsider are left out of the
AllReduce after the group formed, and leaders refuse outsiders and recent outliers."""

from __future__ import annotations

import threading

import hivemind
import numpy as np
import pytest
import torch
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from decentralized_sgd_guard import GroupGuard
from decentralized_sgd_outliers import Summary, WeightSketch
from decentralized_sgd_secret import SwarmSecret

SECRET = SwarmSecret(b"swarm")


@pytest.mark.timeout(180)
def test_outlier_and_outsider_are_left_out_of_the_allreduce():
    sketch = WeightSketch([8], seed="guard")
    # the outsider knows the averaging prefix but not the secret, and accepts anyone: it will lead the group
    peers = [("h0", 0.0, SECRET), ("h1", 1.0, SECRET), ("diverged", 1e4, SECRET), ("outsider", 1.0, None)]
    dhts, guards = [], {}
    try:
        for name, value, secret in peers:
            dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                     initial_peers=dhts[0].get_visible_maddrs() if dhts else None))  # fmt: skip
            guards[name] = GroupGuard([torch.full((8,), value)], dhts[-1], start=True, prefix="guard",
                                      summary_size=sketch.size, secret=secret, target_group_size=4,
                                      min_matchmaking_time=3.0, request_timeout=1.0, next_chunk_timeout=2.0,
                                      allreduce_timeout=20.0)  # fmt: skip
        results: dict[str, object] = {}

        def step(name: str) -> None:
            guard = guards[name]
            with guard.get_tensors() as tensors:
                summary = Summary(np.array(sketch(tensors)), step=0)
            lead = 3.0 if name == "outsider" else 6.0  # the earliest scheduled peer is the one the others ask first
            try:
                results[name] = guard.step(gather=guard.payload(summary), scheduled_time=get_dht_time() + lead,
                                           timeout=30, allow_retries=False)  # fmt: skip
            except Exception as error:  # noqa: BLE001 (reported by the assertion below)
                results[name] = error

        threads = [threading.Thread(target=step, args=(name,)) for name in guards]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        values = {}
        for name, guard in guards.items():
            with guard.get_tensors() as tensors:
                values[name] = tensors[0].tolist()
        assert values["h0"] == values["h1"] == [0.5] * 8, (values, results)  # averaged without the other two
        assert values["diverged"] == [1e4] * 8 and values["outsider"] == [1.0] * 8
        gathered = results["h0"]
        assert isinstance(gathered, dict) and len(gathered) == 4, results
        verdict = guards["h0"].verdict(gathered)  # the trainer's process reaches the verdict of the averager
        names = {guards[name].peer_id: name for name in guards}
        assert {names[peer] for peer in verdict.outliers} == {"diverged", "outsider"}
        assert "token" in verdict.outliers[guards["outsider"].peer_id]
        assert guards["diverged"].peer_id in guards["diverged"].verdict(results["diverged"]).outliers  # it knows

        # a leader refuses an outsider's join request, and one from a peer refused in a recent group
        h0 = guards["h0"]

        def request(payload: dict) -> averaging_pb2.JoinRequest:
            gather = MSGPackSerializer.dumps([None, 0, MSGPackSerializer.dumps(payload)])
            return averaging_pb2.JoinRequest(gather=gather)

        h1_payload = guards["h1"].payload(Summary(np.zeros(sketch.size), step=0))
        assert h0._join_refusal(request(h1_payload), guards["h1"].peer_id) is None
        refusal = h0._join_refusal(request(h1_payload), guards["outsider"].peer_id)  # h1's token, not the sender's
        assert refusal.code == averaging_pb2.PROTOCOL_VIOLATION
        assert h0._join_refusal(averaging_pb2.JoinRequest(gather=b"junk"), guards["h1"].peer_id) is not None
        h0._banned_until[guards["h1"].peer_id] = get_dht_time() + 60
        assert h0._join_refusal(request(h1_payload), guards["h1"].peer_id).code == averaging_pb2.NOT_LOOKING_FOR_GROUP
        assert h0.joins_refused_banned.value == 1 and h0.joins_refused_token.value == 2
    finally:
        for guard in guards.values():
            guard.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()
