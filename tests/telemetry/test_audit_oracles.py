"""Audit oracles for the accumulator -> tracker path: worked answers written out here."""

from __future__ import annotations

import math

import pytest
import torch

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry import IterationAccumulator, TelemetryTracker
from gradmon_ray.telemetry.norm_plan import GradientNorms

REPORTED = ("op", "slot", "value")
ACTION = ("op", "slot")


def _mb(heads, global_norm, nan=0.0, inf=0.0):
    return GradientNorms(
        torch.tensor(heads, dtype=torch.float32),
        torch.tensor(global_norm, dtype=torch.float32),
        torch.tensor(nan),
        torch.tensor(inf),
    )


def test_an_inf_norm_stays_in_the_mean_and_reads_exploding_while_nan_is_left_out():
    tracker = TelemetryTracker(REPORTED, ACTION)
    acc = IterationAccumulator(tracker.layout)
    zeros = torch.zeros(2)
    for norms, skipped in (
        (_mb([1.0, 0.5, 2.0], 3.0), 0.0),
        (_mb([float("inf"), float("nan"), 4.0], float("inf"), inf=3), 1.0),
    ):
        acc.add_minibatch(norms, zeros, zeros, torch.tensor(skipped))
    summary = tracker.finish_iteration(acc.drain()[0])
    assert summary.head_norms["op"] == math.inf  # (1 + inf) / 2: an Inf is data, not "missing"
    assert summary.head_norms["slot"] == pytest.approx(0.5)  # NaN left out: 0.5 / 1
    assert summary.head_norms["value"] == pytest.approx(3.0)
    assert summary.global_norm == math.inf
    assert summary.health["op"] == "exploding" and summary.health["slot"] == "healthy"
    assert summary.inf_grad_count == 3.0 and summary.skipped == 1 and summary.minibatches == 2
    metrics = summary.to_metrics()
    assert metrics[mn.head_metric(mn.HEAD_GRAD_HEALTH, "op")] == mn.HEALTH_CODES["exploding"]
    assert math.isnan(summary.head_norm_cv)  # one finite action-head norm: undefined
    # the next iteration's prev is the Inf, not the last finite value
    acc.add_minibatch(_mb([1.0, 1.0, 1.0], 1.0), zeros, zeros, torch.tensor(0.0))
    nxt = tracker.finish_iteration(acc.drain()[0])
    assert nxt.head_norms_prev["op"] == math.inf and nxt.trends["op"] == "↘"
    assert nxt.head_norms_prev["slot"] == pytest.approx(0.5)
