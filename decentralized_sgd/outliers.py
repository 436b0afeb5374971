"""Diverged peers: a cheap summary of a peer's weights, the rule that finds a group's outliers (a pure function of
the gathered payloads hivemind hands every member: the same verdict everywhere, no extra exchange), and a local check
of the update itself (the summaries predate the values averaged). Plain torch + numpy, for both processes.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch

K = TypeVar("K", bound=Hashable)
SUMMARY_VERSION = 1


class WeightSketch:
    """A fixed random linear map of all averaged tensors to ``dims`` numbers, then their exact L2 norm: ``samples``
    coordinates drawn once (seeded by ``seed``: the same in every peer of a run), projected so that distances estimate
    the full vectors' (Johnson-Lindenstrauss); the norm catches a few blown-up values the sample misses. Small models
    are read whole; one with at most ``dims`` values is its own point."""

    def __init__(self, numels: Sequence[int], seed: str, dims: int = 32, samples: int = 4096):
        if dims < 1 or samples < 1:
            raise ValueError(f"WeightSketch needs dims >= 1 and samples >= 1, got dims={dims}, samples={samples}")
        self.dims, self.numels = dims, list(numels)
        total = sum(self.numels)
        generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little"))
        if total <= samples:  # a small model: every coordinate, no sampling error
            flat = torch.arange(total)
        else:
            flat = torch.randint(total, (samples,), generator=generator).sort().values
        count = len(flat)
        starts = np.cumsum([0, *self.numels])
        self._picks: list[tuple[int, torch.Tensor]] = []  # (tensor index, flat indices into that tensor)
        for i, numel in enumerate(self.numels):
            lo, hi = np.searchsorted(flat.numpy(), [starts[i], starts[i] + numel])
            if hi > lo:
                self._picks.append((i, (flat[lo:hi] - int(starts[i])).long()))
        if total <= dims:  # a tiny model: the values themselves, zero-padded (exact distances)
            self._projection = torch.eye(count, dims, dtype=torch.float64)
        else:
            scale = math.sqrt(total / count / dims) if count else 0.0
            self._projection = torch.randn(count, dims, generator=generator, dtype=torch.float64) * scale
        self._on_device: dict[torch.device, list[torch.Tensor]] = {}

    @property
    def size(self) -> int:
        return self.dims + 1

    def _picked(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
        """The sampled values of each tensor, and whether the tensors share one device (then they stay on it)."""
        if [t.numel() for t in tensors] != self.numels:
            raise ValueError("WeightSketch: the tensors differ from the ones it was built for")
        device = tensors[0].device if tensors else torch.device("cpu")
        if any(t.device != device for t in tensors):  # unusual
            return [tensors[i].detach().reshape(-1)[idx].cpu() for i, idx in self._picks], False
        if device not in self._on_device:
            self._on_device[device] = [idx.to(device) for _, idx in self._picks]
        indices = self._on_device[device]
        return [tensors[i].detach().reshape(-1)[idx] for (i, _), idx in zip(self._picks, indices, strict=True)], True

    @torch.no_grad()
    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[float]:
        """The point of these tensors; non-finite if any value is. On a GPU: one sync."""
        picked, one_device = self._picked(tensors)
        if one_device:
            norms = list(torch._foreach_norm([t.detach() for t in tensors if t.numel()]))
        else:
            norms = [torch.linalg.vector_norm(t.detach()).cpu() for t in tensors if t.numel()]
        values = torch.cat([p.double() for p in picked]) if picked else torch.zeros(0, dtype=torch.float64)
        norm = torch.stack([n.double() for n in norms]).norm() if norms else torch.zeros((), dtype=torch.float64)
        both = torch.cat([values, norm.reshape(1)]).cpu()  # the only synchronization
        projected = both[:-1] @ self._projection
        return [*projected.tolist(), float(both[-1])]

    @torch.no_grad()
    def project(self, tensors: Sequence[torch.Tensor]) -> np.ndarray:
        """The projection part of the point, without the norm: linear, so an update's is the difference of its ends'."""
        picked, _ = self._picked(tensors)
        values = torch.cat([p.double() for p in picked]).cpu() if picked else torch.zeros(0, dtype=torch.float64)
        return (values @ self._projection).numpy()


@dataclass(frozen=True)
class Summary:
    """What one peer tells its group: its point at local step ``step``, and the point of the average it last applied
    (its reference, from ``reference_step``)."""

    point: np.ndarray
    step: int
    reference: np.ndarray | None = None
    reference_step: int | None = None

    @property
    def norm(self) -> float:
        return float(self.point[-1])

    def rate(self) -> float | None:
        """How far it moved per local step since its reference; None without one."""
        if self.reference is None or self.reference_step is None:
            return None
        return float(np.linalg.norm(self.point - self.reference)) / max(1, self.step - self.reference_step)

    def to_wire(self) -> dict[str, Any]:
        """msgpack-friendly (exact Python types)."""
        ref = None if self.reference is None else [float(x) for x in self.reference]
        ref_step = None if self.reference_step is None else int(self.reference_step)
        point = [float(x) for x in self.point]
        return dict(v=SUMMARY_VERSION, point=point, step=int(self.step), ref=ref, ref_step=ref_step)

    @classmethod
    def from_wire(cls, obj: Any, size: int) -> Summary | None:
        """None for anything malformed: such a member is refused."""
        try:
            if not isinstance(obj, dict) or obj.get("v") != SUMMARY_VERSION or not isinstance(obj.get("step"), int):
                return None
            point = np.asarray(obj["point"], dtype=np.float64)
            ref, ref_step = obj.get("ref"), obj.get("ref_step")
            reference = None if ref is None else np.asarray(ref, dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            return None
        if point.shape != (size,) or (reference is not None and reference.shape != (size,)):
            return None
        if reference is not None and (not np.isfinite(reference).all() or not isinstance(ref_step, int)):
            reference = None  # a non-finite reference, or one from no step, says nothing about the swarm
        return cls(point, obj["step"], reference, None if reference is None else ref_step)


@dataclass(frozen=True)
class Verdict(Generic[K]):
    """:meth:`OutlierRule.judge` on one group; ``outliers``: each refused member and why, with the numbers."""

    members: tuple[K, ...]
    outliers: dict[K, str] = field(default_factory=dict)
    distances: dict[K, float] = field(default_factory=dict)
    rates: dict[K, float] = field(default_factory=dict)
    threshold: float = math.inf
    median_distance: float = 0.0
    center: np.ndarray | None = None

    @property
    def inliers(self) -> tuple[K, ...]:
        return tuple(member for member in self.members if member not in self.outliers)

    def explain(self, member: K) -> str:
        """Why ``member`` was refused, against the group."""
        center = "n/a" if self.center is None else f"{self.center[-1]:.4g}"
        why = self.outliers.get(member, "not refused")
        rates = ", ".join(f"{rate:.4g}" for rate in self.rates.values()) or "none"
        return (
            f"{why}; the group's median |w| {center}, median distance {self.median_distance:.4g}, movements per "
            f"step {rates}"
        )

    def describe(self) -> str:
        """One line with the numbers, for the log."""
        center_norm = "n/a" if self.center is None else f"{self.center[-1]:.4g}"
        refused = "; ".join(f"{member}: {why}" for member, why in self.outliers.items()) or "none"
        return (
            f"refused {len(self.outliers)} of {len(self.members)} ({refused}); distance threshold "
            f"{self.threshold:.4g}, median distance {self.median_distance:.4g}, median |w| {center_norm}"
        )


@dataclass(frozen=True)
class OutlierRule:
    """Two tests; a member that fails either (or has no valid, finite summary) is an outlier::

        far from the group (a blow-up):
          center = coordinate-wise median of the members' points and their references (a group of two is decidable)
          refused if  distance to center > max(multiple * median distance, blowup_floor * |center|, abs_floor)
        moving too fast (a drift), for a member with a reference:
          rate = |point - reference| / (step - reference step)
          refused if  rate > max(multiple * median of the others' rates, rate_floor * |reference|, abs_floor)

    The multiples scale with the group's own spread; the floors (10x the weights; 3% of them per step) let in a peer
    merely elsewhere, noise and a young swarm's large steps, and refuse a blow-up or a diverging peer.
    """

    multiple: float = 6.0
    blowup_floor: float = 10.0
    rate_floor: float = 0.03
    abs_floor: float = 1e-8

    def __post_init__(self) -> None:
        if not (self.multiple >= 2 and self.blowup_floor >= 0 and self.rate_floor >= 0 and self.abs_floor > 0):
            raise ValueError(
                f"OutlierRule needs multiple >= 2, blowup_floor >= 0, rate_floor >= 0 and abs_floor > 0, got {self}"
            )

    def judge(self, summaries: Mapping[K, Summary | None]) -> Verdict[K]:
        members = tuple(summaries)
        outliers: dict[K, str] = {}
        for member, summary in summaries.items():
            if summary is None:
                outliers[member] = "no valid weight summary"
            elif not np.isfinite(summary.point).all():
                outliers[member] = f"weights not finite (|w| {summary.norm:.4g})"
        valid = {member: s for member, s in summaries.items() if member not in outliers}
        references = [s.reference for s in valid.values() if s.reference is not None]
        points = [s.point for s in valid.values()] + references
        if not points:
            return Verdict(members, outliers)
        stacked = np.stack(points)
        center = np.median(stacked, axis=0)
        all_distances = np.linalg.norm(stacked - center, axis=1)
        median_distance = float(np.median(all_distances))
        threshold = max(
            self.multiple * median_distance, self.blowup_floor * float(np.linalg.norm(center)), self.abs_floor
        )
        distances = {member: float(d) for member, d in zip(valid, all_distances, strict=False)}
        for member, distance in distances.items():
            if distance > threshold:
                summary = valid[member]
                outliers[member] = (
                    f"distance {distance:.4g} to the group's median > {threshold:.4g}; "
                    f"|w| {summary.norm:.4g}, step {summary.step}"
                )
        rates = {
            member: rate for member, s in valid.items() if member not in outliers and (rate := s.rate()) is not None
        }
        for member, rate in rates.items():
            others = [other_rate for other, other_rate in rates.items() if other != member]
            limit = max(
                self.multiple * float(np.median(others)) if others else 0.0,
                self.rate_floor * float(np.linalg.norm(valid[member].reference)),
                self.abs_floor,
            )
            if rate > limit:
                summary = valid[member]
                outliers[member] = (
                    f"moved {rate:.4g} per step since step {summary.reference_step} > {limit:.4g}; "
                    f"|w| {summary.norm:.4g}, step {summary.step}"
                )
        return Verdict(members, outliers, distances, rates, threshold, median_distance, center)


def expected_update_norm(summaries: Mapping[K, Summary | None], verdict: Verdict[K], own: K) -> float | None:
    """|mean of the inliers' projections - ours|: the update this round should bring us; None if not an inlier."""
    if own not in verdict.inliers or summaries.get(own) is None:
        return None
    projections = np.stack([summaries[member].point[:-1] for member in verdict.inliers])
    return float(np.linalg.norm(projections.mean(axis=0) - summaries[own].point[:-1]))


class UpdateCheck:
    """Refuse an update ``averaged - snapshot`` far larger than expected (a groupmate that diverged after the
    summaries passes the rule, but its update outgrows their prediction and our recent rounds)::

        limit  = multiple * (expected + median of the last ``history`` applied updates) + rel_floor * |snapshot|
        excess = expected + multiple * median + rel_floor * |snapshot|, for |sketched update| (``project``)

    Only once a round was applied since the start or a heal, so a joiner can catch up."""

    def __init__(self, multiple: float = 4.0, rel_floor: float = 0.01, history: int = 8):
        self.multiple, self.rel_floor = multiple, rel_floor
        self._recent: deque[float] = deque(maxlen=history)

    def check(
        self, update_norm: float, expected: float | None, snapshot_norm: float, sketched: float | None = None
    ) -> tuple[bool, str]:
        """(accept?, a log line with the numbers). ``sketched``: |the update's projection| (see the class). With no
        update applied yet the median is inf, and so are both limits."""
        median, floor = float(np.median(self._recent)) if self._recent else math.inf, self.rel_floor * snapshot_norm
        limit = self.multiple * ((expected or 0.0) + median) + floor
        ok = math.isfinite(update_norm) and update_norm <= limit
        line = f"|averaged - snapshot| {update_norm:.4g} {'<=' if ok else '>'} limit {limit:.4g}"
        if ok and sketched is not None and expected is not None:
            excess = expected + self.multiple * median + floor
            ok = sketched <= excess
            line += (
                f", sketched {sketched:.4g} {'<=' if ok else '>'} expected + {self.multiple:g} x recent + floor "
                f"{excess:.4g}"
            )
        expected_text = "n/a" if expected is None else f"{expected:.4g}"
        return (
            ok,
            f"{line} (expected {expected_text}, median of recent updates {median:.4g}, |snapshot| {snapshot_norm:.4g})",
        )

    def applied(self, update_norm: float) -> None:
        self._recent.append(float(update_norm))

    def reset(self) -> None:
        self._recent.clear()
