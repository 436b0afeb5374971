"""Weighted kNN vote over a feature bank too large for one similarity matrix.

The exact vote (``exact_knn_predictions``) builds the full val x train similarity matrix: on ImageNet 50,000 x
1,281,167 float32, ~239 GiB. ``knn_predictions`` gives the same predictions with bounded memory: the train features
are read in chunks (from a memory-mapped .npy on disk, an array or a tensor), queries go in blocks, and per query a
running top-k of (similarity, train index) is merged with each chunk's top-k. The top-k of a union is the top-k of
the per-part top-ks, so the neighbours, their order and hence the vote exp(similarity / T) are the exact ones (ties
of exactly equal similarity aside, which torch.topk does not order either).

Chunks of a memory-mapped bank are read with plain file reads (np.fromfile), not through the mapping: pages touched
through a mapping count in the process's resident memory until the kernel drops them, so reading a 10 GB bank
through it would show ~10 GB of RSS although nothing holds on to it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

Bank = torch.Tensor | np.ndarray | Path | str

DEFAULT_MEMORY_GB = 2.0
MAX_QUERY_BLOCK = 4096
MIN_TRAIN_CHUNK = 256


def exact_knn_predictions(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    val_features: torch.Tensor,
    k: int,
    temperature: float,
    num_classes: int,
) -> torch.Tensor:
    """The reference: the whole similarity matrix at once (run_eval.py's kNN before it streamed)."""
    k = min(k, len(train_labels))
    similarity, neighbours = (val_features @ train_features.T).topk(k, dim=1)
    votes = torch.zeros(len(val_features), num_classes, device=similarity.device)
    votes.scatter_add_(1, train_labels.to(similarity.device)[neighbours], (similarity / temperature).exp())
    return votes.argmax(dim=1)


def open_bank(bank: Bank) -> torch.Tensor | np.ndarray:
    """A path becomes a read-only memory map (read in chunks later); arrays and tensors are used as they are."""
    if isinstance(bank, (str, Path)):
        return np.load(bank, mmap_mode="r")
    return bank


def block_sizes(num_val: int, dim: int, memory_gb: float) -> tuple[int, int]:
    """(query block, train chunk) whose working set fits ``memory_gb``: a chunk of train features (chunk x dim) plus
    the block's similarities and topk's scratch (2 x block x chunk), float32. Large query blocks first: each block
    reads the whole bank once, so fewer blocks mean fewer passes over the disk."""
    budget = max(int(memory_gb * 2**30), 1)
    query_block = max(1, min(num_val, MAX_QUERY_BLOCK))
    while True:
        train_chunk = budget // (4 * (dim + 2 * query_block))
        if train_chunk >= MIN_TRAIN_CHUNK or query_block == 1:
            return query_block, max(1, train_chunk)
        query_block = max(1, query_block // 2)


def read_chunk(bank: torch.Tensor | np.ndarray, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """Rows [start, stop) of the bank as float32 on ``device``; a memory-mapped bank through file reads."""
    if isinstance(bank, torch.Tensor):
        return bank[start:stop].to(device=device, dtype=torch.float32)
    if isinstance(bank, np.memmap) and bank.filename is not None and bank.flags.c_contiguous:
        row = int(np.prod(bank.shape[1:]))
        rows = np.fromfile(
            bank.filename,
            dtype=bank.dtype,
            count=(stop - start) * row,
            offset=bank.offset + start * row * bank.dtype.itemsize,
        ).reshape(stop - start, -1)
    else:
        rows = np.ascontiguousarray(bank[start:stop])
    return torch.from_numpy(rows).to(device=device, dtype=torch.float32)


def streaming_topk(
    train_features: Bank,
    val_features: torch.Tensor,
    k: int,
    memory_gb: float = DEFAULT_MEMORY_GB,
    query_block: int | None = None,
    train_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the k largest similarities to the bank and their train indices, sorted descending; the bank read
    chunk by chunk. ``query_block``/``train_chunk`` override the sizes derived from ``memory_gb`` (tests force many
    chunks with them)."""
    bank = open_bank(train_features)
    num_train, dim = int(bank.shape[0]), int(bank.shape[1])
    k = min(k, num_train)
    derived_block, derived_chunk = block_sizes(len(val_features), dim, memory_gb)
    query_block, train_chunk = query_block or derived_block, train_chunk or derived_chunk
    device = val_features.device
    similarities, indices = [], []
    for q_start in range(0, len(val_features), query_block):
        queries = val_features[q_start : q_start + query_block].float()
        best_sim = torch.empty(len(queries), 0, device=device)
        best_idx = torch.empty(len(queries), 0, dtype=torch.long, device=device)
        for t_start in range(0, num_train, train_chunk):
            chunk = read_chunk(bank, t_start, min(t_start + train_chunk, num_train), device)
            sim, idx = (queries @ chunk.T).topk(min(k, len(chunk)), dim=1)
            del chunk
            best_sim, pick = torch.cat([best_sim, sim], dim=1).topk(min(k, best_sim.shape[1] + sim.shape[1]), dim=1)
            best_idx = torch.cat([best_idx, idx + t_start], dim=1).gather(1, pick)
        similarities.append(best_sim)
        indices.append(best_idx)
    return torch.cat(similarities), torch.cat(indices)


def knn_predictions(
    train_features: Bank,
    train_labels: torch.Tensor | np.ndarray,
    val_features: torch.Tensor,
    k: int,
    temperature: float,
    num_classes: int,
    memory_gb: float = DEFAULT_MEMORY_GB,
    query_block: int | None = None,
    train_chunk: int | None = None,
) -> torch.Tensor:
    """Each query's class by the vote of its k nearest train features, weighted exp(similarity / T), computed with
    working memory bounded by ``memory_gb`` (see the module docstring)."""
    similarity, neighbours = streaming_topk(train_features, val_features, k, memory_gb, query_block, train_chunk)
    labels = torch.as_tensor(np.asarray(train_labels) if not isinstance(train_labels, torch.Tensor) else train_labels)
    votes = torch.zeros(len(val_features), num_classes, device=similarity.device)
    votes.scatter_add_(1, labels.to(similarity.device)[neighbours], (similarity / temperature).exp())
    return votes.argmax(dim=1)
