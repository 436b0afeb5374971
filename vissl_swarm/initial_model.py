"""One initial model per run: every peer of a run builds the same weights, without any network exchange.

Averaging only helps peers that train the same network: hidden units come out of a random initialisation in an
arbitrary order, so the average of two independently initialised networks is not a network either of them
learned. The model's initialisation is therefore seeded from what all peers of a run share (its run id and
config name), while everything else random (data order, augmentations) keeps coming from the peer's own
``SEED_VALUE``. VISSL seeds each head with ``MODEL._MODEL_INIT_SEED`` (which it sets to ``SEED_VALUE``) and the
trunk draws from torch's generator, so the task sets both to the run's seed while it builds the model. A peer
that joins a running swarm still takes over the swarm's current weights afterwards (``load_state_from_peers``).
"""

from __future__ import annotations

import hashlib

import torch

SEED_BYTES = 4  # a seed below 2**32, as numpy's


def initial_model_seed(run_id: str, config_name: str) -> int:
    """The same number on every peer of a run (a hash, not Python's salted ``hash``), another for another run."""
    digest = hashlib.sha256(f"{run_id}/{config_name}".encode()).digest()
    return int.from_bytes(digest[:SEED_BYTES], "little")


def weights_fingerprint(module: torch.nn.Module) -> str:
    """A short hash of a module's parameters and buffers (names, dtypes, values): equal fingerprints mean equal
    weights, which two peers' logs can show without exchanging them."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
