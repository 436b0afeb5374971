"""DecentralizedSGD: wrap any torch optimizer and keep averaging its parameters with peers in the background, on
``hivemind.DecentralizedAverager`` (hivemind 1.1.12 no longer ships DecentralizedSGD). Each round fills the averager
with the latest parameters once its group formed, applies the result as a delta (``w += averaged − snapshot``) at
the trainer's next step boundary, and looks for the next group while the AllReduce runs. The module docstrings, in
this order, are the design (docs/design.md):

- the core: ``optimizer``, ``rounds``, ``scheduler``, ``tensors``, ``state_transfer``, ``averager``, ``supervisor``;
- optional parts: ``outer``, ``vetting`` with ``outliers``, ``secret``, ``starvation`` and
  ``hivemind_slow_peer_fixes``, ``compression`` (the DHT's owner keeps it connected: ``vissl_swarm.dht_rejoin``);
- hivemind work-arounds: ``hivemind_fixes`` (docs/upstream.md lists each).
"""

from .compression import make_compression, schema_fingerprint
from .hivemind_fixes import FixedDHT
from .optimizer import DecentralizedSGD

__all__ = ["DecentralizedSGD", "FixedDHT", "make_compression", "schema_fingerprint"]
