"""The trend and the norm CV as a user reads them in RLlib's result: per telemetry step, and where an
RLlib iteration holds several steps (APPO/IMPALA), through RLlib's own ``MetricsLogger`` merge.

Oracles: the trend codes worked out by hand from known norms with the documented rule (+1 if
norm - prev > 0.01, -1 if < -0.01, else 0); the CV from numpy (population std / mean of the action
heads' norms only); the several-steps value from the documented definition (the mean of the steps'
codes), which RLlib's real ``MetricsLogger`` (learner-side reduce per step, as the IMPALA learner
thread does, then the driver's ``aggregate`` and ``reduce``) must reproduce.

Bugs these catch: the CV logged as NaN for heads ``pi``/``vf`` (the newcomer's APPO result); a value
head counted in the CV; a wrong trend code for a step; the trend read as ``int(-0.5) == 0`` ("→")
by watch where the steps were falling more than rising; docs that promise -1/0/+1 where RLlib
merges several steps into a mean.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from gradmon_ray import metric_names as mn
from gradmon_ray.rllib.metrics_stats import log_step_metrics
from gradmon_ray.telemetry import TelemetryTracker
from gradmon_ray.viz.head_table import trend_arrow_of

MODULE = "default_policy"


def _step(tracker: TelemetryTracker, norms: list[float]) -> dict[str, float]:
    """One telemetry step in which each reported head had one minibatch of the given norm (NaN: none)."""
    layout = tracker.layout
    lanes = np.zeros(layout.size)
    lanes[layout.norm_sum] = [0.0 if math.isnan(n) else n for n in norms]
    lanes[layout.norm_count] = [0.0 if math.isnan(n) else 1.0 for n in norms]
    return tracker.finish_iteration(lanes).to_metrics()


def test_each_steps_trend_is_the_documented_code_and_a_one_action_head_module_logs_no_cv():
    tracker = TelemetryTracker(["pi", "vf"], ["pi"])  # RLlib's default module on CartPole: vf a value head
    pi, vf = [1.0, 0.5, 0.505, 0.6], [2.0, 3.0, 3.2, 3.195]
    expected = {"pi": [0, -1, 0, 1], "vf": [0, 1, 1, 0]}  # by hand: first step NaN prev -> 0; |0.005| <= 0.01
    for t in range(4):
        metrics = _step(tracker, [pi[t], vf[t]])
        for head in ("pi", "vf"):
            assert metrics[mn.head_metric(mn.HEAD_GRAD_TREND, head)] == expected[head][t], (head, t)
        assert mn.HEAD_GRAD_NORM_CV not in metrics, "one action head: the CV is undefined, left out"


def test_an_iteration_of_several_steps_holds_rllibs_mean_of_their_codes_and_watch_shows_its_sign():
    """Three steps inside one APPO iteration: pi falls (-1), stays (0), falls (-1); the learner
    thread reduces after each (``broadcast_interval`` updates), the driver merges all three."""
    tracker = TelemetryTracker(["pi", "vf"], ["pi"])
    _step(tracker, [1.0, 2.0])  # the previous iteration's last step
    learner, results = MetricsLogger(), []
    for pi, vf in ((0.5, 2.5), (0.505, 3.0), (0.3, 3.5)):
        log_step_metrics(learner, MODULE, _step(tracker, [pi, vf]))
        results.append(learner.reduce())
    driver = MetricsLogger(root=True)
    driver.aggregate(results, key="learners")
    logged = driver.reduce(compile=True)["learners"][MODULE]
    pi_trend, vf_trend = (logged[mn.head_metric(mn.HEAD_GRAD_TREND, h)] for h in ("pi", "vf"))
    assert pi_trend == pytest.approx((-1 + 0 - 1) / 3)  # the documented mean of the steps' codes
    assert vf_trend == 1.0  # rising every step: exactly +1
    assert logged[mn.head_metric(mn.HEAD_GRAD_NORM, "pi")] == pytest.approx((0.5 + 0.505 + 0.3) / 3)
    assert mn.HEAD_GRAD_NORM_CV not in logged, "left out every step: no NaN in the result"
    assert (trend_arrow_of(pi_trend), trend_arrow_of(vf_trend)) == ("↘", "↗")
    assert [trend_arrow_of(v) for v in (-0.5, 0.0, 0.25, 1.0, None, math.nan)] == ["↘", "→", "↗", "↗", " ", " "]


def test_the_cv_is_numpys_over_the_action_heads_only_and_left_out_while_undefined():
    tracker = TelemetryTracker(["a", "b", "c", "vf"], ["a", "b", "c"])
    metrics = _step(tracker, [0.2, 0.6, 1.3, 9.0])
    action = np.array([0.2, 0.6, 1.3])
    assert metrics[mn.HEAD_GRAD_NORM_CV] == pytest.approx(action.std(ddof=0) / action.mean(), rel=1e-12)
    metrics = _step(tracker, [0.2, math.nan, 0.7, 9.0])  # b had no gradient: the CV of the finite two
    assert metrics[mn.HEAD_GRAD_NORM_CV] == pytest.approx(np.std([0.2, 0.7]) / np.mean([0.2, 0.7]), rel=1e-12)
    metrics = _step(tracker, [0.4, math.nan, math.nan, 9.0])  # one finite action-head norm: undefined
    assert mn.HEAD_GRAD_NORM_CV not in metrics
    assert mn.HEAD_GRAD_NORM_CV in mn.ABSENT_WHEN_UNDEFINED  # readers drop RLlib's NaN fill of the gap
