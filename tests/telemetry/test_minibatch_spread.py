"""``telemetry.minibatch_spread`` and the "spiking" band: the edge cases a learner meets, against
worked answers and ``tests/band_oracle`` (the bands written out by hand).

Worked answers by hand (the learner-level oracle, numpy on hook-captured gradients, is in
``tests/rllib/test_monitor_step.py``): a head without a gradient in some minibatches (NaN) is
judged on the others, a head without any is left out, a tie names the first minibatch, an Inf
norm is the max, and the clip fraction leaves out minibatches whose global norm is not finite.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry import GradientNorms, IterationAccumulator, TelemetryTracker
from gradmon_ray.telemetry.bands import HealthBands
from gradmon_ray.telemetry.minibatch_spread import minibatch_spread
from tests.band_oracle import ACTION_EDGES, VALUE_EDGES, band_code

NAN, INF = math.nan, math.inf


def test_worked_answers_for_missing_heads_ties_inf_and_the_clip():
    norms = np.array(
        [
            # a     b     gone  inf   global
            [1.0, NAN, NAN, 1.0, 2.0],
            [3.0, 0.5, NAN, INF, NAN],  # a non-finite global norm: not counted by the clip
            [3.0, 0.25, NAN, 2.0, 0.5],
            [2.0, NAN, NAN, 1.0, 1.5],
        ]
    )
    spread = minibatch_spread(norms, ["a", "b", "gone", "inf"], grad_clip=1.0)
    assert spread.norm_max == {"a": 3.0, "b": 0.5, "inf": INF}
    assert spread.argmax_minibatch == {"a": 1, "b": 1, "inf": 1}  # a's tie: the first
    # numpy's linear p95 of [1, 3, 3, 2]: rank 0.95 * 3 = 2.85 between 3 and 3; of b's [0.5, 0.25]: 0.4875
    assert spread.norm_p95["a"] == pytest.approx(3.0) and spread.norm_p95["b"] == pytest.approx(0.4875)
    assert spread.clip_binding_fraction == pytest.approx(2 / 3)  # 2.0 and 1.5 of 2.0, 0.5, 1.5
    metrics = spread.to_metrics()
    assert mn.head_metric(mn.HEAD_GRAD_NORM_MAX, "gone") not in metrics
    assert metrics[mn.head_metric(mn.HEAD_GRAD_NORM_ARGMAX, "b")] == 1.0
    assert metrics[mn.CLIP_BINDING_FRACTION] == pytest.approx(2 / 3)


def test_no_clip_no_fraction():
    spread = minibatch_spread(np.array([[1.0, 2.0]]), ["a"], grad_clip=None)
    assert spread.clip_binding_fraction is None and mn.CLIP_BINDING_FRACTION not in spread.to_metrics()


@pytest.mark.parametrize("edges", [ACTION_EDGES, VALUE_EDGES], ids=["action", "value"])
def test_spiking_is_a_calm_mean_with_an_exploding_minibatch_as_the_oracle_writes_it(edges):
    """``HealthBands.judge`` against ``tests/band_oracle.band_code`` (the bands written out by hand)
    on a grid of means and peaks around every edge, NaN included."""
    bands = HealthBands(*edges)
    values = [NAN, 0.0, *(e * f for e in edges for f in (0.5, 1.0, 1.5)), INF]
    for mean in values:
        for peak in values:
            got = mn.HEALTH_CODES[bands.judge(mean, peak)]
            assert got == band_code(mean, edges, peak), (mean, peak)
    assert bands.judge(edges[2], edges[3] * 1.01) == "spiking"  # healthy mean, one minibatch above the edge
    assert bands.judge(edges[3] * 2, edges[3] * 9) == "exploding"  # the alarm is up already


def test_the_tracker_reports_a_spike_hidden_by_the_mean_as_spiking():
    """A head whose mean over 4 minibatches is healthy (1.75) but whose minibatch 2 reached 5.5:
    health code 5 and norm_max 5.5 at minibatch 2; the value head (its own edges) stays healthy."""
    tracker = TelemetryTracker(["a", "value"], ["a"])
    accumulator = IterationAccumulator(tracker.layout)
    rows = np.array([[0.5, 3.0, 4.0], [0.5, 3.0, 4.0], [5.5, 3.0, 4.0], [0.5, 3.0, 4.0]])
    for a, value, total in rows:
        norms = GradientNorms(torch.tensor([a, value]), torch.tensor(total), torch.tensor(0.0), torch.tensor(0.0))
        accumulator.add_minibatch(norms, torch.zeros(1), torch.zeros(1), torch.tensor(0.0))
    summary = tracker.finish_iteration(accumulator.drain()[0], minibatch_norms=rows, grad_clip=None)
    assert summary.head_norms["a"] == pytest.approx(1.75) and summary.health == {"a": "spiking", "value": "healthy"}
    metrics = summary.to_metrics()
    assert metrics[mn.head_metric(mn.HEAD_GRAD_HEALTH, "a")] == 5.0
    assert metrics[mn.head_metric(mn.HEAD_GRAD_NORM_MAX, "a")] == 5.5
    assert metrics[mn.head_metric(mn.HEAD_GRAD_NORM_ARGMAX, "a")] == 2.0
