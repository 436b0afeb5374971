"""The weight summary, the outlier rule and the update check of decentralized_sgd.outliers (pure functions)."""

from __future__ import annotations

import itertools
import math
import os

import numpy as np
import pytest
import torch
from hivemind.p2p import PeerID

from decentralized_sgd.outliers import (
    OutlierRule,
    Summary,
    UpdateCheck,
    WeightSketch,
    expected_update_norm,
)
from decentralized_sgd.secret import SwarmSecret
from decentralized_sgd.vetting import judge

SHAPES = [(64, 32), (64,), (128, 64), (128,), (10, 128)]


def weights(seed: int | None = None, value: float | None = None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed or 0)
    tensors = [torch.randn(shape, generator=generator) for shape in SHAPES]
    return [torch.full_like(t, value) for t in tensors] if value is not None else tensors


def sketch() -> WeightSketch:
    return WeightSketch([math.prod(shape) for shape in SHAPES], seed="test_run", dims=32, samples=2048)


def summaries(
    points: dict[str, list[torch.Tensor]],
    references: dict[str, list[torch.Tensor]] | None = None,
    steps: dict[str, int] | None = None,
) -> dict[str, Summary]:
    """At step 7 (or `steps`), with references (if any) from step 6."""
    sk, references, steps = sketch(), references or {}, steps or {}
    return {
        name: Summary(
            np.array(sk(tensors)),
            step=steps.get(name, 7),
            reference=np.array(sk(references[name])) if name in references else None,
            reference_step=6 if name in references else None,
        )
        for name, tensors in points.items()
    }


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


@pytest.mark.timeout(60)
def test_sketch_is_seeded_estimates_distances_and_has_the_exact_norm():
    a, b = weights(1), weights(2)
    sk = sketch()
    assert sk(a) == sketch()(a)  # every peer of a run draws the same samples and projection
    other = WeightSketch(sk.numels, seed="another_run", dims=32, samples=2048)
    assert other(a) != sk(a)
    point_a, point_b = np.array(sk(a)), np.array(sk(b))
    assert len(point_a) == sk.size == 33
    assert point_a[-1] == pytest.approx(float(flat(a).norm()), rel=1e-6)
    true_distance = float((flat(a) - flat(b)).norm())
    assert np.linalg.norm(point_a[:-1] - point_b[:-1]) == pytest.approx(true_distance, rel=0.35)
    assert np.linalg.norm(point_a[:-1]) == pytest.approx(float(flat(a).norm()), rel=0.35)
    scaled = np.array(sk([t * 1.05 for t in a]))  # linear: a drift of 5% is a distance of 5% of |w|
    assert np.linalg.norm(scaled[:-1] - point_a[:-1]) == pytest.approx(0.05 * np.linalg.norm(point_a[:-1]), rel=1e-6)
    a[2][3, 4] = math.nan
    assert not np.isfinite(sk(a)).all()
    with pytest.raises(ValueError, match="differ"):
        sk(a[:-1])
    tiny = WeightSketch([12, 3], seed="test_run")  # the tests' models: their own point, distances exact
    x, y = [torch.randn(12), torch.randn(3)], [torch.randn(12), torch.randn(3)]
    assert np.linalg.norm(np.array(tiny(x))[:-1] - np.array(tiny(y))[:-1]) == pytest.approx(
        float((flat(x) - flat(y)).norm()), rel=1e-6
    )


@pytest.mark.timeout(60)
def test_a_diverged_peer_is_the_outlier_and_healthy_groups_have_none():
    rule = OutlierRule()
    verdict = rule.judge(summaries({"h0": weights(value=0.0), "h1": weights(value=1.0), "bad": weights(value=1e4)}))
    assert set(verdict.outliers) == {"bad"} and verdict.inliers == ("h0", "h1")
    assert "distance" in verdict.outliers["bad"] and "refused 1 of 3" in verdict.describe()
    # the healthy cases: three spread peers, identical peers, and peers from different random inits
    for group in (
        {"a": weights(value=0.0), "b": weights(value=3.0), "c": weights(value=6.0)},
        {"a": weights(value=1.0), "b": weights(value=1.0), "c": weights(value=1.0)},
        {"a": weights(1), "b": weights(2), "c": weights(3), "d": weights(4)},
        {"a": weights(1), "b": weights(2), "c": weights(3)},
    ):
        verdict = rule.judge(summaries(group))
        assert not verdict.outliers, verdict.describe()


@pytest.mark.timeout(60)
def test_the_floor_separates_a_drift_from_noise():
    rule = OutlierRule()
    base = weights(5)
    synced = {"a": base, "b": base, "drift": base}  # they averaged together a step ago: base is their reference
    drifted = summaries({"a": base, "b": base, "drift": [t * 1.05 for t in base]}, references=synced)
    assert set(rule.judge(drifted).outliers) == {"drift"} and "per step" in rule.judge(drifted).outliers["drift"]
    pair = summaries({"a": base, "drift": [t * 1.05 for t in base]}, references=synced)  # two: still decided
    assert set(rule.judge(pair).outliers) == {"drift"}
    noisy = summaries(
        {"a": base, "b": [t * 1.001 for t in base], "drift": [t * 0.999 for t in base]}, references=synced
    )
    assert not rule.judge(noisy).outliers  # 0.1%: fp16 rounding and a few local steps are not a divergence


@pytest.mark.timeout(60)
def test_peers_that_train_at_different_speeds_are_not_outliers():
    rule, base, step = OutlierRule(), weights(5), [torch.full_like(t, 1e-2) for t in weights(5)]
    synced = {"fast": base, "slow": base, "mid": base}  # each moved by its own steps since it last averaged
    moved = {
        name: [b + count * s for b, s in zip(base, step, strict=True)]
        for name, count in (("fast", 30), ("slow", 1), ("mid", 10))
    }
    group = summaries(moved, references=synced, steps={"fast": 36, "slow": 7, "mid": 16})
    verdict = rule.judge(group)
    assert not verdict.outliers, verdict.describe()
    assert max(verdict.rates.values()) == pytest.approx(min(verdict.rates.values()), rel=0.05)  # the same per step
    assert not rule.judge({"fast": group["fast"], "slow": group["slow"]}).outliers  # also as a pair


@pytest.mark.timeout(60)
def test_a_peer_that_never_averaged_is_refused_only_for_a_blow_up():
    rule = OutlierRule()
    synced = {"a": weights(value=1.5), "b": weights(value=1.5)}  # a pair that averaged, and a newcomer
    newcomer = summaries({**synced, "new": weights(value=6.0)}, references=synced)
    assert not rule.judge(newcomer).outliers  # it started elsewhere: averaging it in is how it catches up
    blown_up = summaries({**synced, "new": weights(value=1e4)}, references=synced)
    assert set(rule.judge(blown_up).outliers) == {"new"} and "distance" in rule.judge(blown_up).outliers["new"]
    with pytest.raises(ValueError, match="rate_floor >= 0"):
        OutlierRule(rate_floor=-0.1)


@pytest.mark.timeout(60)
def test_references_decide_a_group_of_two():
    rule = OutlierRule()
    healthy, diverged = weights(value=0.5), weights(value=1e4)
    assert not rule.judge(summaries({"h": healthy, "bad": diverged})).outliers  # no history: cannot tell who is right
    with_history = summaries({"h": healthy, "bad": diverged}, references={"h": weights(value=0.5)})
    assert set(rule.judge(with_history).outliers) == {"bad"}
    # a peer that diverged after it averaged with the swarm: its own reference speaks against it
    own_reference = summaries({"h": healthy, "bad": diverged}, references={"bad": weights(value=0.5)})
    assert set(rule.judge(own_reference).outliers) == {"bad"}


@pytest.mark.timeout(60)
def test_every_member_reaches_the_same_verdict_whatever_the_order():
    group = summaries(
        {"h0": weights(value=0.0), "h1": weights(value=1.0), "h2": weights(value=2.0), "bad": weights(value=50.0)}
    )
    verdicts = {frozenset(OutlierRule().judge(dict(order)).outliers) for order in itertools.permutations(group.items())}
    assert verdicts == {frozenset({"bad"})}


@pytest.mark.timeout(60)
def test_missing_or_malformed_summaries_and_non_finite_points_are_refused():
    sk = sketch()
    good = Summary(np.array(sk(weights(1))), step=3, reference=np.array(sk(weights(1))), reference_step=1)
    again = Summary.from_wire(good.to_wire(), sk.size)
    assert np.array_equal(again.point, good.point) and np.array_equal(again.reference, good.reference)
    assert (again.step, again.reference_step) == (good.step, good.reference_step)
    without_step = Summary.from_wire({**good.to_wire(), "ref_step": None}, sk.size)  # a reference from no step
    assert without_step is not None and without_step.reference is None
    for bad in (
        None,
        "x",
        {"v": 99, "point": good.to_wire()["point"], "step": 1},
        {**good.to_wire(), "point": [1.0, 2.0]},
        {**good.to_wire(), "step": "3"},
        {**good.to_wire(), "point": ["a"] * sk.size},
    ):
        assert Summary.from_wire(bad, sk.size) is None
    nan_weights = weights(2)
    nan_weights[0][0, 0] = math.inf
    group = {
        "a": good,
        "b": Summary(np.array(sk(weights(1))), step=3),
        "broken": None,
        "nan": Summary(np.array(sk(nan_weights)), step=3),
    }
    verdict = OutlierRule().judge(group)
    assert set(verdict.outliers) == {"broken", "nan"}
    assert "no valid" in verdict.outliers["broken"] and "not finite" in verdict.outliers["nan"]


@pytest.mark.timeout(60)
def test_a_minority_never_decides():
    # two colluding diverged peers among four: no majority either way, nobody is refused
    members = {"a": weights(value=1.0), "b": weights(value=1.0), "c": weights(value=1e3), "d": weights(value=1e3)}
    assert not OutlierRule().judge(summaries(members)).outliers
    # ... but the healthy members' references (points they shared with the swarm) make them the majority
    history = summaries(members, references={"a": weights(value=1.0), "b": weights(value=1.0)})
    assert set(OutlierRule().judge(history).outliers) == {"c", "d"}
    with pytest.raises(ValueError, match="multiple >= 2"):
        OutlierRule(multiple=1.5)


@pytest.mark.timeout(60)
def test_update_check_refuses_an_update_far_larger_than_expected():
    group = summaries({"me": weights(value=1.0), "b": weights(value=1.0), "c": weights(value=1.01)})
    verdict = OutlierRule().judge(group)
    assert not verdict.outliers
    expected = expected_update_norm(group, verdict, "me")
    size = float(flat(weights(value=1.0)).norm())
    assert expected == pytest.approx(0.01 / 3 * size, rel=0.35)
    check = UpdateCheck()
    assert check.check(1e6, expected, size)[0]  # no round applied yet: a peer from elsewhere may catch up
    check.applied(expected)
    ok, line = check.check(0.5 * expected, expected, size)
    assert ok and "<=" in line
    ok, line = check.check(0.2 * size, expected, size)  # a groupmate drifted 60% between round start and fill
    assert not ok and "> limit" in line and "expected" in line
    assert not check.check(math.inf, expected, size)[0]
    for _ in range(8):  # a swarm whose rounds bring updates of 10% of |w| learns that they are normal
        check.applied(0.1 * size)
    assert check.check(0.2 * size, expected, size)[0]
    check.reset()  # healed: the old weights' updates say nothing about the new ones
    assert check.check(1e6, expected, size)[0]
    assert expected_update_norm(group, verdict, "absent") is None


@pytest.mark.timeout(60)
def test_update_check_refuses_an_update_that_outgrew_the_prediction():
    # a groupmate's summary the rule let in (34% away), whose values kept drifting until the fill (x1.05^11 more)
    group = summaries({"me": weights(value=1.0), "b": weights(value=1.0), "drifter": weights(value=1.05**6)})
    verdict = OutlierRule().judge(group)
    expected = expected_update_norm(group, verdict, "me")
    sk, snapshot = sketch(), weights(value=1.0)
    averaged = [(2 * s + 1.05**17 * s) / 3 for s in snapshot]
    update = [a - s for a, s in zip(averaged, snapshot, strict=True)]
    assert np.allclose(sk.project(update), np.subtract(sk(averaged), sk(snapshot))[:-1])  # linear: the two ends
    sketched, norm, size = float(np.linalg.norm(sk.project(update))), float(flat(update).norm()), sk(snapshot)[-1]
    assert sketched == pytest.approx(3.8 * expected, rel=0.01)  # the projection's error is the same on both sides
    check = UpdateCheck()
    check.applied(0.0)  # the rounds before brought nothing
    assert check.check(norm, expected, size)[0]  # its size alone is within 4 * expected: it moved the others 43%
    ok, line = check.check(norm, expected, size, sketched)
    assert not ok and "sketched" in line and "> expected + 4 x recent + floor" in line
    assert check.check(expected, expected, size, expected)[0]  # as predicted
    assert check.check(0.0, expected, size, 0.0)[0]  # smaller: the group came together meanwhile
    assert UpdateCheck().check(norm, expected, size, sketched)[0]  # no round applied yet: a newcomer catches up


@pytest.mark.timeout(60)
def test_judge_refuses_members_without_a_token_before_looking_at_their_weights():
    sk, secret = sketch(), SwarmSecret(b"ours")
    peers = {name: PeerID(os.urandom(34)) for name in ("h0", "h1", "bad", "intruder", "junk")}
    good = {
        peers[name]: {"summary": summary.to_wire(), "token": secret.member_token(peers[name].to_bytes())}
        for name, summary in summaries(
            {"h0": weights(value=0.0), "h1": weights(value=1.0), "bad": weights(value=1e4)}
        ).items()
    }
    stolen = {"summary": good[peers["h1"]]["summary"], "token": good[peers["h1"]]["token"]}  # another peer's token
    payloads = {**good, peers["intruder"]: stolen, peers["junk"]: 42}
    parsed, verdict = judge(payloads, sk.size, OutlierRule(), secret)
    assert set(verdict.outliers) == {peers["bad"], peers["intruder"], peers["junk"]}
    assert verdict.inliers == (peers["h0"], peers["h1"]) and verdict.members == tuple(payloads)
    assert "token" in verdict.outliers[peers["intruder"]] and peers["intruder"] not in parsed
    assert "distance" in verdict.explain(peers["bad"]) and "median |w|" in verdict.explain(peers["bad"])
    parsed, verdict = judge({**good, peers["junk"]: 42}, sk.size, OutlierRule(), None)  # no secret: no tokens
    assert set(verdict.outliers) == {peers["bad"], peers["junk"]} and parsed[peers["junk"]] is None
    assert not judge(payloads, sk.size, None, None)[1].outliers  # neither rule nor secret: nobody is refused
