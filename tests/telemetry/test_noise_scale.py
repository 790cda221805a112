"""Gradient noise scale: worked answers and a synthetic problem with a known answer."""

from __future__ import annotations

import math

import pytest
import torch

from gradmon_ray.telemetry import NoiseScaleTracker, gradient_noise_terms


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
