"""DecentralizedSGD: wrap any torch optimizer and keep averaging its parameters with peers in the background.

Built on ``hivemind.DecentralizedAverager`` (hivemind 1.1.12 no longer ships DecentralizedSGD). Compared with the old
design, each round (1) fills the averager with the *latest* local parameters as soon as its group has formed,
(2) applies the result as a delta (``w += averaged - snapshot``) at the trainer's next step boundary, so local steps
made during the round are kept, and (3) looks for the next group while the current AllReduce is still running.
Plain PyTorch + hivemind, no VISSL. The module docstrings, read in this order, are the design (docs/design.md):

- the core: ``optimizer`` (the API, the step boundary, SSP; it builds the parts in ``_make_*`` factories), ``rounds``
  (a round's states, the book, the trainer's counts, the lock order), ``scheduler`` (the thread that drives rounds,
  their tensor work, the settings), ``tensors`` (what is averaged, its host staging, the result slots),
  ``state_transfer``, ``averager`` and ``supervisor`` (the averager process, and what happens when it fails);
- optional parts: ``outer`` (the outer step), ``vetting`` with ``outliers`` (diverged peers), ``secret``
  (outsiders), ``starvation`` and ``hivemind_slow_peer_fixes`` (slow peers), ``dht_rejoin`` with ``address_book``
  (finding the swarm again, for whoever owns the DHT: ``swarm.start_dht``), ``compression`` (the wire);
- hivemind work-arounds: ``hivemind_fixes`` (``FixedDHT``: a DHT that survives an averager restart; the averager's
  end without tracebacks; docs/upstream.md lists each fix), ``end_with_parent``.
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
