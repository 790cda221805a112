"""Gradient noise scale: worked answers and a synthetic problem with a known answer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry import NoiseScaleTracker, gradient_noise_terms
from gradmon_ray.telemetry.noise_scale import noise_lane_count, noise_scale_inputs, noise_scale_metrics, noise_scales


def test_worked_answer():
    # |G_small|^2 = 5 at b=10, |G_big|^2 = 3 at B=40:
    # g2 = (40*3 - 10*5) / 30 = 7/3 ; tr = (5 - 3) / (1/10 - 1/40) = 2 / 0.075 = 80/3
    g2, trace = gradient_noise_terms(5.0, 3.0, 10, 40)
    assert g2 == pytest.approx(7 / 3) and trace == pytest.approx(80 / 3)


def test_exact_expectations_recover_g_and_trace():
    # E|G_b|^2 = |G|^2 + tr/b exactly -> the estimators return |G|^2 and tr exactly.
    g2_true, tr_true = 2.0, 50.0
    g2, trace = gradient_noise_terms(g2_true + tr_true / 8, g2_true + tr_true / 32, 8, 32)
    assert g2 == pytest.approx(g2_true) and trace == pytest.approx(tr_true)


def test_tensors_and_bad_sizes():
    g2, trace = gradient_noise_terms(torch.tensor([5.0, 1.0]), torch.tensor([3.0, 1.0]), 10, 40)
    torch.testing.assert_close(g2, torch.tensor([7 / 3, 1.0]))
    torch.testing.assert_close(trace, torch.tensor([80 / 3, 0.0]))
    with pytest.raises(ValueError, match="b_small < b_big"):
        gradient_noise_terms(1.0, 1.0, 8, 8)


def test_synthetic_known_gradient_and_covariance_within_10_percent():
    """Per-sample gradients g_i = G + noise with known diagonal covariance: two learners
    (b_small = 16 each, b_big = 32), 400 iterations, B_simple within 10% of tr(Sigma)/|G|^2."""
    gen = torch.Generator().manual_seed(0)
    dim = 50
    true_g = torch.linspace(-1.0, 1.0, dim) * 0.3
    std = torch.linspace(0.5, 2.0, dim)
    truth = float((std**2).sum() / (true_g**2).sum())
    b_small, learners = 16, 2
    tracker = NoiseScaleTracker(["global"], beta=0.99)
    for _ in range(400):
        samples = true_g + std * torch.randn(learners, b_small, dim, generator=gen)
        local = samples.mean(dim=1)  # each learner's small-batch gradient
        big = local.mean(dim=0)  # what the all-reduce produces
        sq_small = float((local**2).sum(dim=1).mean())
        sq_big = float((big**2).sum())
        scales = tracker.update([sq_small], [sq_big], b_small, b_small * learners)
    assert scales["global"] == pytest.approx(truth, rel=0.10)


def test_tracker_nan_before_updates_and_state_round_trip():
    tracker = NoiseScaleTracker(["op", "global"])
    assert all(math.isnan(v) for v in tracker.noise_scales().values())
    tracker.update([5.0, 6.0], [3.0, 4.0], 10, 40)
    clone = NoiseScaleTracker(["op", "global"])
    clone.load_state_dict(tracker.state_dict())
    assert clone.noise_scales() == tracker.noise_scales()
    assert tracker.noise_scales()["op"] == pytest.approx((80 / 3) / (7 / 3))
    with pytest.raises(ValueError, match="noise-scale state"):
        NoiseScaleTracker(["x"]).load_state_dict(tracker.state_dict())


# --- one iteration's reduced lanes -> metrics (what the learner logs) -----------------------
def _lanes(sq_small, sq_big, trunk, k, minibatches):
    """SUM-reduced noise lanes for per-entry mean squared norms (heads..., global)."""
    local = [s * k * minibatches for s in sq_small]
    big = [s * k * minibatches for s in sq_big]
    return np.array([*local[:-1], trunk, local[-1], *big])


def test_inputs_undo_the_sum_over_learners_and_minibatches():
    k, minibatches, rows = 3, 4, 4 * 32
    lanes = _lanes([5.0, 7.0, 20.0], [3.0, 4.0, 11.0], trunk=123.0, k=k, minibatches=minibatches)
    assert len(lanes) == noise_lane_count(2)
    sq_small, sq_big, b_small, b_big = noise_scale_inputs(lanes, 2, k, minibatches, rows)
    np.testing.assert_allclose(sq_small, [5.0, 7.0, 20.0])  # the trunk slot is dropped
    np.testing.assert_allclose(sq_big, [3.0, 4.0, 11.0])
    assert (b_small, b_big) == (32.0, 96.0)
    with pytest.raises(ValueError, match="noise lanes"):
        noise_scale_inputs(lanes[:-1], 2, k, minibatches, rows)


def test_undefined_noise_scale_is_left_out_never_nan():
    """The two-learner FactoredOps run: ``blueprint``'s |G|^2 estimate 2|G_big|^2 - |G_small|^2
    was negative (learner gradients disagreeing) and B_simple was logged as NaN every iteration.
    These are that run's first-iteration numbers (b_small = 128, 16 minibatches, 2 learners).

    Oracle: McCandlish et al.'s estimators written out here, b = 128, B = 256:
    |G|^2 = (B |G_B|^2 - b |G_b|^2) / (B - b) = 2 big - small, tr = (small - big) / (1/b - 1/B) =
    256 (small - big); EMAs with beta 0.9 from 0 (the bias factor cancels in the ratio)."""
    tracker = NoiseScaleTracker(["op", "blueprint", "global"], beta=0.9)
    k, minibatches, rows = 2, 16, 16 * 128
    small1, big1 = [0.092982, 0.081333, 1.0866], [0.057398, 0.039128, 0.60421]
    small2, big2 = [0.092982, 0.09, 1.0866], [0.057398, 0.0625, 0.60421]

    def ema_ratio(*iterations: tuple[float, float]) -> float:
        g2 = trace = 0.0
        for small, big in iterations:
            g2, trace = 0.9 * g2 + 0.1 * (2 * big - small), 0.9 * trace + 0.1 * 256 * (small - big)
        return trace / g2

    name = {i: mn.head_metric(mn.HEAD_NOISE_SCALE, h) for i, h in enumerate(("op", "blueprint"))}
    lanes = _lanes(small1, big1, 0.5, k, minibatches)
    metrics = noise_scale_metrics(*noise_scales(tracker, lanes, world_size=k, minibatches=minibatches, rows=rows))
    assert 2 * big1[1] - small1[1] < 0  # blueprint's |G|^2 estimate: negative, so B_simple is undefined
    assert set(metrics) == {name[0], mn.GLOBAL_NOISE_SCALE}  # left out, not NaN
    assert metrics[name[0]] == pytest.approx(ema_ratio((small1[0], big1[0])), rel=1e-9)
    assert metrics[mn.GLOBAL_NOISE_SCALE] == pytest.approx(ema_ratio((small1[2], big1[2])), rel=1e-9)
    # Once the learners agree on blueprint's direction, its EMA turns positive and it is logged, the
    # negative first estimate still in it (remembered, not dropped: 520.1 here, 201.1 without it).
    lanes = _lanes(small2, big2, 0.5, k, minibatches)
    metrics = noise_scale_metrics(*noise_scales(tracker, lanes, world_size=k, minibatches=minibatches, rows=rows))
    assert set(metrics) == {name[0], name[1], mn.GLOBAL_NOISE_SCALE}
    for i, key in ((0, name[0]), (1, name[1]), (2, mn.GLOBAL_NOISE_SCALE)):
        assert metrics[key] == pytest.approx(ema_ratio((small1[i], big1[i]), (small2[i], big2[i])), rel=1e-9), key


def test_no_minibatches_or_rows_fold_nothing():
    tracker = NoiseScaleTracker(["op", "global"])
    lanes = _lanes([5.0, 6.0], [3.0, 4.0], 0.0, 2, 1)
    assert noise_scales(tracker, lanes, world_size=2, minibatches=0, rows=10) == ({}, None)
    assert noise_scales(tracker, lanes, world_size=2, minibatches=1, rows=0) == ({}, None)
    assert tracker.updates == 0


def test_update_counts_updates_and_skips_an_overflowing_iteration_whole():
    """b_small 1, b_big 2: g2 = 2*big - small, trace = (small - big) / (1 - 1/2) = 2*(small - big).
    Iteration 1 (small 3, big 2): g2 = 1, trace = 2 -> EMAs (beta 0.5) 0.5 and 1.0.  Iteration 2
    (small 1.7e308, big 0): g2 = -1.7e308 is finite but trace = 3.4e308 overflows to Inf, so
    neither EMA moves.  Iteration 3 (small 5, big 3): g2 = 1, trace = 4 -> 0.75 and 2.5."""
    tracker = NoiseScaleTracker(["h"], beta=0.5)
    assert tracker.update([3.0], [2.0], 1.0, 2.0) == {"h": 2.0}
    assert tracker.g2_ema == [0.5] and tracker.trace_ema == [1.0]
    assert tracker.update([1.7e308], [0.0], 1.0, 2.0) == {"h": 2.0}
    assert tracker.g2_ema == [0.5] and tracker.trace_ema == [1.0]
    assert tracker.update([5.0], [3.0], 1.0, 2.0) == {"h": 2.5 / 0.75}
    assert tracker.g2_ema == [0.75] and tracker.trace_ema == [2.5]
    assert tracker.updates == 3 and tracker.state_dict()["updates"] == 3


def test_update_rejects_norm_lists_of_different_lengths():
    tracker = NoiseScaleTracker(["a", "b"])
    with pytest.raises(ValueError):
        tracker.update([1.0, 2.0], [1.0], 1.0, 2.0)


@pytest.mark.parametrize("beta", [-0.1, 1.0, 1.5])
def test_beta_outside_zero_to_one_is_refused(beta):
    with pytest.raises(ValueError, match=r"^beta must be in \[0, 1\)"):
        NoiseScaleTracker(["h"], beta=beta)


def test_a_zero_gradient_signal_gives_nan_not_a_division():
    """b_small 1, b_big 2, small 2, big 1: g2 = 2*1 - 2 = 0 exactly, trace = 2*(2 - 1) = 2: B_simple = trace / g2
    is undefined, so NaN (and left out by ``noise_scales``)."""
    tracker = NoiseScaleTracker(["h"], beta=0.5)
    scales = tracker.update([2.0], [1.0], 1.0, 2.0)
    assert tracker.g2_ema == [0.0] and tracker.trace_ema == [1.0]
    assert math.isnan(scales["h"])


def test_noise_scale_metrics_names():
    assert noise_scale_metrics({"op": 2.0}, 3.0) == {"grad/head/op/noise_scale": 2.0, "grad/noise_scale": 3.0}
    assert noise_scale_metrics({}, None) == {}
