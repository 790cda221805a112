"""``telemetry.minibatch_spread``: the edge cases a learner meets, against worked answers.

Worked answers by hand (the learner-level oracle, numpy on hook-captured gradients, is in
``tests/rllib/test_monitor_step.py``): a head without a gradient in some minibatches (NaN) is
judged on the others, a head without any is left out, a tie names the first minibatch, an Inf
norm is the max, and the clip fraction leaves out minibatches whose global norm is not finite.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.minibatch_spread import minibatch_spread

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
