"""A swarm of 16 reaches consensus with the slow-peer fixes on.

Why: 16 peers on one small machine answer slowly *everywhere* (every DHT node, every leader). The slow-peer fixes
(``decentralized_sgd.hivemind_slow_peer_fixes``) were built against one slow peer among healthy ones, and once took
such a swarm apart: they banned every DHT node and no group formed within 120 s. Real hivemind peers on 127.0.0.1
(the ``swarm`` fixture, ``tests/dsgd_swarm.py``); the outcome is asserted, never a timing: the deadline is generous
because this machine is loaded during CI.

The peers run with the timeouts a box runs with (run_trainer.py's defaults: ``SwarmSettings``), not the fast ones of
the small swarms' tests (``dsgd_swarm.FAST``: a 0.5 s request timeout, 1 s matchmaking). Measured on this 2-core
machine with two ``yes`` beside it: with the fast ones 16 peers never reached consensus in 300 s (spread stuck at
0.14, 85% of the rounds "could not find a group": join requests left unanswered for 0.5 s); with a box's, in 50 s,
no round failed.
"""

from __future__ import annotations

import pytest
import torch
from dsgd_swarm import averaged_tensors, make_model, wait_until

from vissl_swarm.swarm import SwarmSettings

PEERS, TOLERANCE = 16, 0.01
BOX_TIMEOUTS = SwarmSettings().averager_timeouts()
DEADLINE_S = 300.0  # only bounds a broken swarm: this machine is loaded during CI (2 CPUs, other suites)


def spread(peers: list) -> float:
    stacked = torch.stack([torch.cat([t.detach().flatten() for t in averaged_tensors(p)]) for p in peers])
    return float((stacked - stacked.mean(dim=0)).abs().max())


@pytest.mark.long
@pytest.mark.xdist_group("swarm_scenarios")
@pytest.mark.timeout(480)
def test_sixteen_peers_reach_consensus_with_the_slow_peer_fixes_on(swarm) -> None:
    peers = [swarm.peer(make_model(float(i)), target_group_size=4, **BOX_TIMEOUTS) for i in range(PEERS)]
    assert all(peer.settings.slow_peer_fixes for peer in peers)
    for peer in peers:
        swarm.train(peer)
    wait_until(
        lambda: spread(peers) <= TOLERANCE, DEADLINE_S, lambda: (spread(peers), [dict(p.counters) for p in peers[:2]])
    )
    swarm.stop_training()
    assert all(p.counters["rounds_applied"] > 0 for p in peers), [p.counters["rounds_applied"] for p in peers]
