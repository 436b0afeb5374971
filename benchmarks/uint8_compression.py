"""The 8-bit wire format the benchmarks compare (bench_averaging's wan regimes, ideal_swarm). Not a
product choice: 8-bit keeps peers about 0.5% of the weights' norm apart (README, ``--compression``).

``uint8_compression()``: hivemind's 8-bit quantization for tensors of 2**16 values or more (it needs many values
for its statistics), fp16 below. ``compression(name)``: that for "uint8", the product's ``make_compression`` else.

hivemind 1.1.12 cannot decode it with NumPy 2: compression/quantization.py, ``Quantization.extract`` calls ``int()``
on a 1-element array, so every 8-bit part fails to decode and silently stays un-averaged. Fixed on hivemind's master
by hivemind#670 (``.item()``), in no release yet: ``fixed_8bit_decoding()`` (a block) and ``compression("uint8")``
(for good, in this process and the averager processes it forks) decode with that fix while hivemind needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import hivemind
import numpy as np
import torch
from hivemind.compression import CompressionBase, Float16Compression, SizeAdaptiveCompression, Uniform8BitQuantization
from hivemind.compression.quantization import Quantization
from hivemind.proto import runtime_pb2
from packaging.version import Version

from decentralized_sgd.compression import make_compression

FIXED_IN = "1.1.13"  # the first release that can hold hivemind#670 (none does yet)
NEEDS_FIX = Version(hivemind.__version__) < Version(FIXED_IN)
STOCK_EXTRACT = Quantization.extract


def _extract_8bit(self: Quantization, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
    """hivemind 1.1.12's ``Quantization.extract`` with ``.item()`` for ``int()`` (hivemind#670)."""
    codebook_size = int(np.frombuffer(serialized_tensor.buffer, count=1, dtype=np.int64)[0])
    codebook = np.frombuffer(serialized_tensor.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
    quantized = np.frombuffer(serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
    quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
    codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
    return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


@contextlib.contextmanager
def fixed_8bit_decoding() -> Iterator[None]:
    """Decode 8-bit parts with the fix while the block runs (hivemind decodes through a process-wide registry)."""
    original = Quantization.extract
    if NEEDS_FIX:
        Quantization.extract = _extract_8bit
    try:
        yield
    finally:
        Quantization.extract = original


def uint8_compression() -> CompressionBase:
    return SizeAdaptiveCompression(2**16, less=Float16Compression(), greater_equal=Uniform8BitQuantization())


def compression(name: str) -> CompressionBase:
    """The compression of a benchmark's ``--compressions`` name; "uint8" also fixes the decoding for good here."""
    if name != "uint8":
        return make_compression(name)
    if NEEDS_FIX:
        Quantization.extract = _extract_8bit
    return uint8_compression()
