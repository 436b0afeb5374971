"""DecentralizedSGD: wrap any torch optimizer and keep averaging its parameters with peers in the background.

Built on ``hivemind.DecentralizedAverager`` (hivemind 1.1.12 no longer ships DecentralizedSGD). Compared with the old
design, each round (1) fills the averager with the *latest* local parameters as soon as its group has formed,
(2) applies the result as a delta (``w += averaged - snapshot``) at the trainer's next step boundary, so local steps
made during the round are kept, and (3) looks for the next group while the current AllReduce is still running.
Plain PyTorch + hivemind, no VISSL. The module docstrings, read in this order, are the design:

- ``optimizer``: ``DecentralizedSGD``, what the training loop calls (the lock contract, the step boundary, SSP); it
  builds the parts below and hands each what it needs (none of them imports it);
- ``settings`` and ``trainer_state``: the round settings, and the trainer's lock and counts, that the parts share;
- ``rounds``: one round's states and transitions (which thread, which lock), and the book of rounds and records;
- ``scheduler``: the background thread that moves rounds through their states, fills when the group forms;
- ``exchange``: a round's tensor work (fill, trigger, the update from the average, the apply), apart from when;
- ``tensors``: what is averaged, and the result slots where finished updates wait for the trainer; ``tensor_ops``:
  the fused copies and adds that the fill, the update and the apply share;
- ``staging``: the host copies that fills, applies and state transfer go through (flat; on a GPU pinned, copied on
  a side stream without stalling the trainer), and what "a step boundary's values" means for BatchNorm;
- ``state_transfer``: serving our state to late joiners, and taking over a donor's;
- ``averager`` and ``supervisor``: the averager process, and what happens when it dies or stops answering;
- ``starvation``: a peer that its own box starves of CPU leaves averaging until it recovers;
- ``vetting``, ``outliers`` and ``secret``: diverged peers and outsiders: the weight summaries a group compares,
  whom it leaves out of its AllReduce, the update check, the heal, and the swarm secret;
- ``hivemind_fixes``: work-arounds for hivemind bugs, each naming what it covers (``FixedDHT``: a DHT that survives
  an averager restart; docs/upstream.md lists them); ``hivemind_slow_peer_fixes``: those that keep a slow groupmate
  from slowing the others; ``end_with_parent``: the
  DHT and averager processes (and the p2p daemon) end when a killed trainer leaves them; ``dht_rejoin``: the DHT
  re-bootstrap after an outage, dialing the initial peers and those of ``address_book`` (the peers a box met, in its
  checkpoint folder: a restarted first box finds the swarm again); both are for whoever owns the DHT
  (``swarm.start_dht`` uses them); ``compression``: what goes on the wire.
"""

from .compression import make_compression, schema_fingerprint
from .dht_rejoin import keep_dht_connected
from .hivemind_fixes import FixedDHT
from .optimizer import DecentralizedSGD

__all__ = [
    "DecentralizedSGD",
    "FixedDHT",
    "keep_dht_connected",
    "make_compression",
    "schema_fingerprint",
]
