"""What goes on the wire: hivemind compression by a CLI-friendly name, and the fingerprint that keeps peers whose
models differ out of each other's groups (it goes into the averaging prefix, so they never even meet)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from hivemind.compression import CompressionBase, Float16Compression, NoCompression

COMPRESSIONS = {"none": NoCompression, "fp16": Float16Compression}  # 8-bit is a benchmark's (uint8_compression.py)


def make_compression(name: str | CompressionBase) -> CompressionBase:
    """Map the CLI-friendly names onto hivemind compression classes; a hivemind compression is taken as it is."""
    if isinstance(name, CompressionBase):
        return name
    if name not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {', '.join(map(repr, COMPRESSIONS))}, got {name!r}")
    return COMPRESSIONS[name]()


def schema_fingerprint(tensors: Sequence[torch.Tensor]) -> str:
    """Short hash of shapes/dtypes; put into the prefix so that peers with different models never even meet."""
    schema = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
    return hashlib.sha256(schema.encode()).hexdigest()[:16]
