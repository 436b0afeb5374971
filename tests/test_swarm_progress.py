"""The swarm's sample count (swarm_progress) on real hivemind DHTs on 127.0.0.1: every box ends up with the
same count, a box that left stays counted, counts travel in checkpoints and downloads, and a forged count is
refused."""

from __future__ import annotations

import hivemind
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from vissl_swarm.local_swarm import wait_until
from vissl_swarm.swarm_progress import SignedCount, SwarmProgress

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
RUN = "progresstest"


@pytest.fixture
def dhts():
    started: list[hivemind.DHT] = []

    def start(count: int) -> list[hivemind.DHT]:
        first = hivemind.DHT(start=True, host_maddrs=LOCAL)
        started.append(first)
        peers = [str(address) for address in first.get_visible_maddrs()]
        for _ in range(count - 1):
            started.append(hivemind.DHT(start=True, host_maddrs=LOCAL, initial_peers=peers))
        return started

    try:
        yield start
    finally:
        for dht in started:
            dht.shutdown()


@pytest.mark.timeout(120)
def test_boxes_agree_on_the_swarm_count_and_keep_a_departed_box(dhts) -> None:
    first, second, third = dhts(3)
    boxes = [
        SwarmProgress(dht, RUN, batch, period=0.5, private_key=RSAPrivateKey())
        for dht, batch in ((first, 16), (second, 16), (third, 32))
    ]
    try:
        for box, samples in zip(boxes, (160, 320, 640), strict=True):
            box.add(samples)
        # every box learns every other box's signed count (no estimate: the boxes stopped adding)
        for box in boxes:
            wait_until(lambda box=box: box.known_samples() == 1120, 60, "every box seeing 1120 samples")
            assert box.position() >= 1120
        wait_until(lambda: all(box.swarm_batch() == 64 for box in boxes), 60, "the swarm's batch 16 + 16 + 32")

        # the third box leaves: its samples still count, its batch no longer does once its record is gone
        boxes[2].shutdown()
        third.shutdown()
        boxes[0].add(16)
        wait_until(lambda: boxes[1].known_samples() == 1136, 60, "the second box seeing the first one's new step")
        assert boxes[1].position() >= 1136
    finally:
        for box in boxes:
            box.shutdown()


@pytest.mark.timeout(120)
def test_counts_travel_in_state_dicts_and_forged_ones_are_refused(dhts) -> None:
    (dht,) = dhts(1)
    key = RSAPrivateKey()
    box = SwarmProgress(dht, RUN, 16, private_key=key, start=False)
    box.add(48)
    state = box.state_dict()
    assert SwarmProgress.total_of(state, RUN) == 48
    assert SwarmProgress.total_of(state, "another_run") == 0, "a count signed for another run must not verify"

    # a restarted box (a new process key) restores the count of its earlier life from its checkpoint
    restarted = SwarmProgress(dht, RUN, 16, private_key=RSAPrivateKey(), start=False)
    assert restarted.load_state_dict(state) == 1
    restarted.add(16)
    assert restarted.known_samples() == 64

    # a donor that raises another box's count (keeping that box's signature) is refused, and so is a count
    # re-signed with the donor's own key under the other box's name
    victim = SignedCount.sign(RUN, key, 48, 16)
    raised = SignedCount(victim.owner, 10_000, 16, victim.signature)
    impostor = SignedCount(
        victim.owner, 10_000, 16, RSAPrivateKey().sign(SignedCount.payload(RUN, victim.owner, 10_000, 16))
    )
    joiner = SwarmProgress(dht, RUN, 16, private_key=RSAPrivateKey(), start=False)
    taken = joiner.load_state_dict({"counts": [raised.to_wire(), impostor.to_wire(), ["junk"], victim.to_wire()]})
    assert taken == 1 and joiner.known_samples() == 48 and joiner.rejected == 2
    assert joiner.position() == 48
