#!/usr/bin/env python
"""Robust aggregation, weighed for vetting: what one round gives the healthy peers of a group with a diverged one.

Why: hivemind 1.1.12 averages with plain weighted means. The literature's robust aggregators would have to replace its
part reducer (CenteredClip, Karimireddy et al. 2021, as in BTARD-SGD; a coordinate-wise median or trimmed mean);
this example instead leaves outliers out before the AllReduce (``decentralized_sgd.outliers.OutlierRule``, the same
verdict at every member) and checks each update on its own side. This script puts numbers on that choice: for each
group (members' weights as constant vectors, 16 values each), the value the healthy members end the round with.

Usage:
    python -m benchmarks.robust_aggregation    # prints a Markdown table (numpy and torch only; a second)
"""

from __future__ import annotations

import numpy as np
import torch

from decentralized_sgd.outliers import OutlierRule, Summary, WeightSketch

SIZE = 16
CASES = {  # name: (members' values, the values of their references or None, the healthy members)
    "healthy, spread (0, 3, 6)": ([0.0, 3.0, 6.0], [None, None, None], [0, 1, 2]),
    "diverged third (0, 1, 1e4)": ([0.0, 1.0, 1e4], [None, None, None], [0, 1]),
    "diverged pair (0.5, 1e4), no history": ([0.5, 1e4], [None, None], [0]),
    "diverged pair (0.5, 1e4), the healthy one averaged before": ([0.5, 1e4], [0.5, None], [0]),
}


def centered_clip(points: np.ndarray, iterations: int = 3, multiple: float = 4.0) -> np.ndarray:
    """CenteredClip from the coordinate-wise median, tau = multiple x the median distance to it."""
    center = np.median(points, axis=0)
    tau = multiple * float(np.median(np.linalg.norm(points - center, axis=1)))
    for _ in range(iterations):
        offsets = points - center
        norms = np.linalg.norm(offsets, axis=1, keepdims=True)
        scale = np.minimum(1.0, tau / np.maximum(norms, 1e-12))
        center = center + (offsets * scale).mean(axis=0)
    return center


def ours(values: list[float], references: list[float | None], healthy: list[int]) -> float:
    """The verdict leaves the outliers out; a healthy member left alone keeps its own weights."""
    sketch = WeightSketch([SIZE], seed="robust_aggregation")
    summaries = {
        i: Summary(
            np.array(sketch([torch.full((SIZE,), v)])),
            step=0,
            reference=None if r is None else np.array(sketch([torch.full((SIZE,), r)])),
        )
        for i, (v, r) in enumerate(zip(values, references, strict=True))
    }
    inliers = OutlierRule().judge(summaries).inliers
    member = healthy[0]
    kept = inliers if member in inliers and len(inliers) >= 2 else (member,)
    return float(np.mean([values[i] for i in kept]))


def main() -> None:
    print("| group | plain mean | coordinate median | CenteredClip (3 iterations) | outliers left out (ours) |")
    print("|---|---|---|---|---|")
    for name, (values, references, healthy) in CASES.items():
        points = np.stack([np.full(SIZE, v) for v in values])
        mean, median, clipped = points.mean(axis=0)[0], np.median(points, axis=0)[0], centered_clip(points)[0]
        print(f"| {name} | {mean:.4g} | {median:.4g} | {clipped:.4g} | {ours(values, references, healthy):.4g} |")


if __name__ == "__main__":
    main()
