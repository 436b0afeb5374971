#!/usr/bin/env python
"""What one averaging round's compression costs the weights, through hivemind's real AllReduce.

Why: 8-bit quantizes the *parameters themselves* (256 levels over +-3 standard deviations of each part), so its error
scales with the weights, not with how far the peers are apart: peers that averaging keeps close may get more noise
from one 8-bit round than the round removes. ``--peers`` peers hold ResNet-50's tensors (or ``--checkpoint``'s
trunk), each perturbed by ``level`` x each tensor's RMS, run one real AllReduce (hivemind.DecentralizedAverager on
127.0.0.1), and each result is compared with the exact float64 mean: error ||result - mean||, correction
||w - mean|| (what averaging moves a peer), both relative to ||mean||. Schemes: none, fp16, uint8 (what
``uint8_compression`` sends), quantile8, uint8_delta_ideal (uint8 of ``w - w_ref`` with a reference every peer
shares exactly: the best a quantized delta could do), uint8_all (8 bits for every tensor of 1024 values or more).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import sys
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.common import git_state, parse_with_quick, write_json, write_text
from benchmarks.uint8_compression import compression, fixed_8bit_decoding

SCHEMES = ("none", "fp16", "uint8", "quantile8", "uint8_delta_ideal", "uint8_all")


def compression_for(scheme: str):
    """hivemind compression of a scheme; quantile8 has uint8's size rule (tensors under 2**16 values as fp16)."""
    from hivemind.compression import (
        Float16Compression,
        Quantile8BitQuantization,
        SizeAdaptiveCompression,
        Uniform8BitQuantization,
    )

    if scheme == "quantile8":
        return SizeAdaptiveCompression(2**16, less=Float16Compression(), greater_equal=Quantile8BitQuantization())
    if scheme == "uint8_all":
        return SizeAdaptiveCompression(2**10, less=Float16Compression(), greater_equal=Uniform8BitQuantization())
    return compression("uint8" if scheme == "uint8_delta_ideal" else scheme)


def model_tensors(checkpoint: Path | None) -> list[torch.Tensor]:
    """Parameters and float buffers of torchvision's ResNet-50 (25.6M values, initial weights from seed 0), in
    DecentralizedSGD's order; or, with a checkpoint, the float tensors of a VISSL checkpoint's trained trunk."""
    if checkpoint is not None:
        from run_eval import load_trunk_state, resolve_checkpoint

        state = load_trunk_state(resolve_checkpoint(checkpoint))
        return [t.detach().float().clone() for t in state.values() if torch.is_tensor(t) and t.is_floating_point()]
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    params = [p.detach().clone() for p in model.parameters()]
    return params + [b.detach().clone() for b in model.buffers() if b.is_floating_point()]


def perturbed_copies(base: Sequence[torch.Tensor], peers: int, level: float) -> list[list[torch.Tensor]]:
    """Each peer: every tensor plus level x its RMS x N(0, 1) (RMS, not std, so constant tensors move too)."""
    gen = torch.Generator().manual_seed(1)
    copies = []
    for _ in range(peers):
        copies.append(
            [t + level * t.pow(2).mean().sqrt().clamp_min(1e-8) * torch.randn(t.shape, generator=gen) for t in base]
        )
    return copies


def allreduce(tensors: list[list[torch.Tensor]], scheme: str, round_index: int) -> list[list[torch.Tensor]]:
    """One real hivemind AllReduce of every peer's tensors (all peers in one group); each peer's result. Fresh DHTs
    for every round: a DHT that outlives an averager can fail to read what the averager's process left in its pipe,
    and the next round may hang."""
    import hivemind

    dhts = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    dhts += [
        hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dhts[0].get_visible_maddrs())
        for _ in range(len(tensors) - 1)
    ]
    averagers = []
    try:
        for peer_tensors, dht in zip(tensors, dhts, strict=True):
            averagers.append(
                hivemind.DecentralizedAverager(
                    [t.clone() for t in peer_tensors],
                    dht,
                    prefix=f"compression_{scheme}_{round_index}",
                    target_group_size=len(dhts),
                    min_group_size=len(dhts),
                    min_matchmaking_time=2.0,
                    request_timeout=1.0,
                    allreduce_timeout=300.0,
                    next_chunk_timeout=120.0,
                    compression=compression_for(scheme),
                    start=True,
                )
            )
        with ThreadPoolExecutor(len(averagers)) as pool:
            groups = list(pool.map(lambda a: a.step(timeout=600.0), averagers))
        if any(group is None or len(group) != len(dhts) for group in groups):
            raise RuntimeError(f"{scheme}: not every peer averaged with all others: {groups}")
        results = []
        for averager in averagers:
            with averager.get_tensors() as averaged:
                results.append([t.clone() for t in averaged])
        return results
    finally:
        for owner in [*averagers, *dhts]:
            owner.shutdown()


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def _distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b, strict=True)))


def measure(base: list[torch.Tensor], peers: int, level: float, scheme: str, index: int) -> dict:
    local = perturbed_copies(base, peers, level)
    exact = [torch.stack([peer[i].double() for peer in local]).mean(0) for i in range(len(base))]
    started = time.time()
    if scheme == "uint8_delta_ideal":  # quantize w - w_ref with w_ref shared exactly, then add it back
        deltas = allreduce([[w - r for w, r in zip(peer, base, strict=True)] for peer in local], scheme, index)
        results = [[d + r for d, r in zip(peer, base, strict=True)] for peer in deltas]
    else:
        results = allreduce(local, scheme, index)
    seconds = time.time() - started
    scale = _norm(exact)
    errors = [_distance(result, exact) / scale for result in results]
    corrections = [_distance(peer, exact) / scale for peer in local]
    spread_before = [_distance(a, b) / scale for a, b in itertools.combinations(local, 2)]
    spread_after = [_distance(a, b) / scale for a, b in itertools.combinations(results, 2)]
    mean = sum(errors) / len(errors)
    return {
        "scheme": scheme,
        "level": level,
        "peers": peers,
        "error_mean": mean,
        "error_max": max(errors),
        "correction_mean": sum(corrections) / len(corrections),
        "error_vs_correction": mean / (sum(corrections) / len(corrections)),
        "spread_before": sum(spread_before) / len(spread_before),
        "spread_after": sum(spread_after) / len(spread_after),
        "spread_after_vs_before": sum(spread_after) / sum(spread_before),
        "round_s": seconds,
        "all_finite": all(bool(torch.isfinite(t).all()) for result in results for t in result),
    }


COLUMNS = [
    ("scheme", "scheme", "{}"),
    ("level", "level", "{:g}"),
    ("error", "error_mean", "{:.2e}"),
    ("error max", "error_max", "{:.2e}"),
    ("correction", "correction_mean", "{:.2e}"),
    ("error / correction", "error_vs_correction", "{:.3f}"),
    ("spread before", "spread_before", "{:.2e}"),
    ("spread after", "spread_after", "{:.2e}"),
    ("after / before", "spread_after_vs_before", "{:.3f}"),
]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt.format(row[key]) for _, key, fmt in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--levels", type=float, nargs="+", default=[1e-2, 1e-3, 1e-4], help="relative to the RMS")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--checkpoint", type=Path, default=None, help="a VISSL checkpoint's trunk, not ResNet-50's")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    return parse_with_quick(parser, argv, levels=[1e-3], schemes=["uint8"])


def main(argv: Sequence[str] | None = None) -> list[dict]:
    warnings.filterwarnings("ignore")
    args = parse_args(argv)
    import hivemind  # noqa: F401  (sets up its loggers, quieted here)

    logging.getLogger("hivemind").setLevel(logging.ERROR)  # "target_group_size should be a power of 2" etc.

    base = model_tensors(args.checkpoint)
    print(f"[compression] {sum(t.numel() for t in base) / 1e6:.1f}M values in {len(base)} tensors", file=sys.stderr)
    rows = []
    with fixed_8bit_decoding():  # the averagers fork from here and decode 8-bit parts: with the NumPy 2 fix
        for index, (level, scheme) in enumerate(itertools.product(args.levels, args.schemes)):
            rows.append(row := measure(base, args.peers, level, scheme, index))
            shown = f"error {row['error_mean']:.2e}, correction {row['correction_mean']:.2e}, {row['round_s']:.1f}s"
            print(f"[compression] {scheme:>17} level {level:g}: {shown}", file=sys.stderr)
    table = markdown(rows)
    print(table)
    write_text(args.markdown, table)
    write_json(args.json, {"rows": rows, "argv": sys.argv[1:], "git": git_state()})
    return rows


if __name__ == "__main__":
    main()
