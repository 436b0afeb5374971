"""DecentralizedSGD: wrap any torch optimizer and keep averaging its parameters with peers in the background, on
``hivemind.DecentralizedAverager``: a round fills the averager once its group formed and adds ``averaged − snapshot``
at the trainer's next step boundary. Reading order (docs/design.md): ``optimizer``, ``rounds``, ``scheduler``,
``tensors``, ``state_transfer``, ``averager``, ``supervisor``; then the optional parts and ``hivemind_fixes``.
"""

from .compression import make_compression, schema_fingerprint
from .hivemind_fixes import FixedDHT
from .optimizer import DecentralizedSGD

__all__ = ["DecentralizedSGD", "FixedDHT", "make_compression", "schema_fingerprint"]
