#!/usr/bin/env python3
"""Memory and time of the streaming kNN (vissl_swarm/knn.py) on an ImageNet-sized feature bank: 1.3M x 2048 float32.
(tests/test_eval.py checks that the streaming vote equals the exact one.)

    nice -n 19 python -m benchmarks.bench_knn --bank /tmp/knn_bank.npy --json benchmarks/results/knn.json \
        --markdown benchmarks/results/knn.md

The bank (random unit vectors, ~10.6 GB) is written once in chunks as a .npy and memory-mapped; each
``--memory_gb`` value is measured in a fresh process, so its peak resident memory (VmHWM) is its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import commit_label, machine, parse_with_quick, write_json, write_text


def write_bank(path: Path, rows: int, dim: int, num_classes: int, chunk: int = 65536) -> None:
    """Unit-norm random features as a .npy written chunk by chunk (never the whole bank in memory); the labels file,
    written last, marks it complete."""
    if path.with_suffix(".labels.npy").exists() and np.load(path, mmap_mode="r").shape == (rows, dim):
        return
    bank = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, dim))
    rng = np.random.default_rng(0)
    for start in range(0, rows, chunk):
        block = rng.standard_normal((min(chunk, rows - start), dim), dtype=np.float32)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        bank[start : start + len(block)] = block
        bank.flush()
    del bank
    np.save(path.with_suffix(".labels.npy"), rng.integers(0, num_classes, rows))


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(bank_path: Path, queries: int, memory_gb: float, num_classes: int) -> dict:
    """One streaming kNN over the bank (this process only): peak RSS and seconds per 1,000 queries."""
    import torch

    from vissl_swarm.knn import block_sizes, knn_predictions

    bank = np.load(bank_path, mmap_mode="r")
    labels = np.load(bank_path.with_suffix(".labels.npy"))
    val = torch.nn.functional.normalize(torch.randn(queries, bank.shape[1], generator=torch.Generator().manual_seed(1)))
    rss_before = peak_rss_mb()
    start = time.perf_counter()
    predictions = knn_predictions(
        bank_path, labels, val, k=20, temperature=0.1, num_classes=num_classes, memory_gb=memory_gb
    )
    seconds = time.perf_counter() - start
    block, chunk = block_sizes(queries, bank.shape[1], memory_gb)
    return {
        "memory_gb": memory_gb,
        "query_block": block,
        "train_chunk": chunk,
        "seconds": round(seconds, 1),
        "seconds_per_1000_queries": round(seconds * 1000 / queries, 1),
        "peak_rss_mb": round(peak_rss_mb(), 0),
        "rss_before_knn_mb": round(rss_before, 0),
        "predictions": len(predictions),
        "torch_threads": torch.get_num_threads(),
    }


def markdown(report: dict) -> str:
    lines = [
        f"# Streaming kNN: {report['rows']:,} x {report['dim']} float32 bank ({report['bank_gb']} GB, "
        f"memory-mapped .npy), {report['queries']:,} queries, k=20",
        "",
        f"commit {report['commit']}; {report['cpus']} CPU cores, run under `nice -n 19` next to other jobs "
        "(times are upper bounds)",
        "",
        "| --knn_memory_gb | query block | train chunk | peak RSS | s per 1,000 queries |",
        "|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        lines.append(
            f"| {run['memory_gb']} | {run['query_block']} | {run['train_chunk']:,} | "
            f"{run['peak_rss_mb']:,.0f} MB | {run['seconds_per_1000_queries']} |"
        )
    baseline = report["runs"][0]["rss_before_knn_mb"]
    lines += [
        "",
        f"Peak RSS is the whole process's (VmHWM), {baseline:,.0f} MB of it Python, torch,"
        " the queries and the labels before the vote started; the bank is read with file reads, so the "
        "page cache holding it is not counted.",
        "",
        "The exact vote would need the whole similarity matrix: "
        f"{report['queries']:,} x {report['rows']:,} float32 = {report['exact_matrix_gb']} GB here, "
        "~239 GiB for ImageNet's 50,000 val images, plus the bank itself in memory.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bank", type=Path, default=Path("/tmp/knn_bank.npy"))
    parser.add_argument("--rows", type=int, default=1_300_000)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--num_classes", type=int, default=1000)
    parser.add_argument("--memory_gb", type=float, nargs="+", default=[2.0, 0.25])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--measure_one", type=float, default=None, help=argparse.SUPPRESS)
    args = parse_with_quick(parser, rows=20_000, dim=256, queries=200, num_classes=10, memory_gb=[0.005])
    if args.measure_one is not None:
        print(json.dumps(measure(args.bank, args.queries, args.measure_one, args.num_classes)))
        return 0
    started = time.perf_counter()
    write_bank(args.bank, args.rows, args.dim, args.num_classes)
    print(f"bank ready in {time.perf_counter() - started:.0f} s", flush=True)
    runs = []
    for memory_gb in args.memory_gb:
        one = f"--queries {args.queries} --num_classes {args.num_classes} --measure_one {memory_gb}".split()
        command = [sys.executable, "-m", "benchmarks.bench_knn", "--bank", str(args.bank), *one]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(runs[-1], flush=True)
    report = {
        "commit": commit_label(),
        "rows": args.rows,
        "dim": args.dim,
        "queries": args.queries,
        "bank_gb": round(args.rows * args.dim * 4 / 1e9, 1),
        "cpus": machine()["cpus"],
        "exact_matrix_gb": round(args.queries * args.rows * 4 / 1e9, 1),
        "runs": runs,
    }
    write_json(args.json, report)
    write_text(args.markdown, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
