"""Values that only go up (latches, the iterations they fired at, the telemetry clock, the skipped-update
total, the probe counters) come out of RLlib's driver EXACTLY as the iteration's last telemetry step
logged them, also where one RLlib iteration holds several steps (APPO/IMPALA); per-step values keep the
documented mean; a PPO iteration (one step) is unchanged.

The steps come from the real ``TelemetryTracker`` (lanes written by hand: a NaN log-prob flag, skipped
minibatches, a low entropy), logged with ``log_step_metrics`` into RLlib's real ``MetricsLogger`` and
reduced after each step as the IMPALA learner thread does, then merged by the driver's ``aggregate`` and
``reduce`` (as ``tests/rllib/test_trend_and_cv_in_results.py``).  Oracle: the last step's own metrics
(for the monotone values) and the mean of the steps' values worked out by hand (for the per-step ones).

Bugs these catch: a latch set in the last of four steps reported as 0.25 (RLlib's mean), the telemetry
clock as 3.5 instead of 5, ``update/skipped_total`` averaged, the probe counters averaged; a per-step
count (``update/skipped``) or a norm turned into a max; a name missing from ``MAX_REDUCED``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from ray.rllib.core import ALL_MODULES
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from gradmon_ray import metric_names as mn
from gradmon_ray.rllib.metrics_stats import GRADMON_MAX_REDUCE, GRADMON_REDUCE, reduce_of
from gradmon_ray.rllib.metrics_stats import log_step_metrics as log
from gradmon_ray.telemetry import TelemetryTracker
from gradmon_ray.telemetry.bands import BandSet, CollapseBand

MODULE = "default_policy"
ACTIONS = 4  # pi's number of actions: entropy_norm = entropy / log(4)


def _tracker() -> TelemetryTracker:
    bands = BandSet(collapse=CollapseBand(threshold=0.2, iterations=1))
    return TelemetryTracker(["pi", "vf"], ["pi"], bands=bands, head_sizes=[ACTIONS])


def _step(tracker: TelemetryTracker, norm: float, *, skipped: int = 0, nan: bool = False, entropy_norm: float = 0.9):
    """One telemetry step: pi's norm, vf 1.0, ``skipped`` minibatches skipped, pi's NaN flag, pi's entropy."""
    lay = tracker.layout
    lanes = np.zeros(lay.size)
    lanes[lay.norm_sum], lanes[lay.norm_count] = [norm, 1.0], [1.0, 1.0]
    lanes[lay.minibatches], lanes[lay.skipped] = 4.0, float(skipped)
    lanes[lay.logp_nan] = [1.0 if nan else 0.0]
    health = np.array([entropy_norm * math.log(ACTIONS), 0.0, 1.0, 0.0])  # [entropy, kl, 1, kl_measured]
    return tracker.finish_iteration(lanes, health).to_metrics()


def _through_rllib(steps: list[dict[str, float]], counters: list[dict[str, float]] | None = None) -> dict:
    """The steps as the learner logs them (a reduce after each), merged by the driver into one result."""
    learner, results = MetricsLogger(), []
    for t, metrics in enumerate(steps):
        log(learner, MODULE, metrics)
        if counters:
            log(learner, ALL_MODULES, counters[t])
        results.append(learner.reduce())
    driver = MetricsLogger(root=True)
    driver.aggregate(results, key="learners")
    return driver.reduce(compile=True)["learners"]


def test_an_appo_iteration_of_four_steps_reports_the_last_steps_latches_clock_and_totals_exactly():
    tracker = _tracker()
    _step(tracker, 1.0)  # iteration 1: the previous RLlib iteration's only step
    steps = [
        _step(tracker, 1.1),  # 2
        _step(tracker, 1.2, skipped=1),  # 3
        _step(tracker, 1.3, entropy_norm=0.1),  # 4: pi collapses (below 0.2 for 1 step)
        _step(tracker, 1.4, skipped=2, nan=True),  # 5: pi's NaN latch fires
    ]
    counters = [
        {mn.PROBE_REQUESTS_SENT: float(n), mn.PROBE_COMPLETED: float(max(n - 1, 0)), mn.PROBE_FAILURES: 0.0}
        for n in (1, 1, 2, 3)
    ]
    learners = _through_rllib(steps, counters)
    got = learners[MODULE]
    last = steps[-1]
    exact = {
        mn.head_metric(mn.HEAD_NAN_LATCH, "pi"): 1.0,  # RLlib's mean: 0.25
        mn.head_metric(mn.HEAD_NAN_LATCH_FIRST_ITERATION, "pi"): 5.0,
        mn.head_metric(mn.HEAD_INF_LATCH, "pi"): 0.0,
        mn.head_metric(mn.HEAD_COLLAPSE_LATCH, "pi"): 1.0,  # the mean: 0.5
        mn.head_metric(mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION, "pi"): 4.0,
        mn.TELEMETRY_ITERATION: 5.0,  # the mean: 3.5
        mn.SKIPPED_UPDATES_TOTAL: 3.0,  # the mean: (0 + 1 + 1 + 3) / 4
    }
    assert {name: last[name] for name in exact} == exact  # the oracle is what the last step logged
    assert {name: got[name] for name in exact} == exact
    assert got[mn.SKIPPED_UPDATES] == pytest.approx((0 + 1 + 0 + 2) / 4)  # a per-step count: the documented mean
    assert got[mn.head_metric(mn.HEAD_GRAD_NORM, "pi")] == pytest.approx((1.1 + 1.2 + 1.3 + 1.4) / 4)
    entropy = got[mn.head_metric(mn.HEAD_ENTROPY_NORM, "pi")]
    assert entropy == pytest.approx((0.9 + 0.9 + 0.1 + 0.9) / 4)
    assert learners[ALL_MODULES] == {mn.PROBE_REQUESTS_SENT: 3.0, mn.PROBE_COMPLETED: 2.0, mn.PROBE_FAILURES: 0.0}


def test_a_ppo_iteration_of_one_step_reports_every_value_as_logged():
    tracker = _tracker()
    _step(tracker, 0.5)
    step = _step(tracker, 0.7, skipped=1, nan=True, entropy_norm=0.05)
    got = _through_rllib([step])[MODULE]
    assert got.keys() == step.keys()
    for name, value in step.items():
        assert got[name] == value or (math.isnan(value) and math.isnan(got[name])), name


@pytest.mark.parametrize(
    "name",
    [
        mn.head_metric(t, "op")
        for t in (
            mn.HEAD_NAN_LATCH,
            mn.HEAD_INF_LATCH,
            mn.HEAD_NAN_LATCH_FIRST_ITERATION,
            mn.HEAD_INF_LATCH_FIRST_ITERATION,
            mn.HEAD_COLLAPSE_LATCH,
            mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION,
        )
    ]
    + [mn.TELEMETRY_ITERATION, mn.SKIPPED_UPDATES_TOTAL, *mn.PROBE_COUNTERS],
)
def test_every_value_that_only_goes_up_is_merged_by_its_max(name):
    assert reduce_of(name) == GRADMON_MAX_REDUCE


@pytest.mark.parametrize(
    "name",
    [
        mn.head_metric(mn.HEAD_GRAD_NORM, "op"),
        mn.head_metric(mn.HEAD_GRAD_TREND, "op"),
        mn.head_metric(mn.HEAD_GRAD_HEALTH, "op"),
        mn.head_metric(mn.HEAD_ENTROPY_NORM, "op"),
        mn.SKIPPED_UPDATES,
        mn.MINIBATCH_UPDATES,
        mn.NAN_GRAD_COUNT,
        mn.VGS_SCALING_FACTOR,
        "policy_loss",  # not a gradmon name
    ],
)
def test_per_step_values_keep_the_mean(name):
    assert reduce_of(name) == GRADMON_REDUCE
