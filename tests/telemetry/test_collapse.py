"""The tracker's policy head health: per-head entropy / KL means over learners, entropy_norm, and
the collapse latch fed a hand-written sequence; the health_stop rule on it.

Bugs these catch: the latch firing one step early or late, a high step not resetting the
counter, a latch that un-latches, state lost in a checkpoint, the SUM across learners not
divided back (or divided by the world size when a learner measured nothing), entropy_norm
divided by log2 or by the wrong head's size.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry import BandSet, TelemetryTracker
from gradmon_ray.telemetry.bands import CollapseBand
from gradmon_ray.telemetry.health_stop import STOP_REASON_CODES, HealthStopMonitor, HealthStopRules
from gradmon_ray.telemetry.state_digest import state_digest

HEADS = ("op", "slot")
SIZES = (4, 2)


def _tracker(threshold: float = 0.3, iterations: int = 3) -> TelemetryTracker:
    bands = BandSet(collapse=CollapseBand(threshold=threshold, iterations=iterations))
    return TelemetryTracker(("op", "slot", "value"), HEADS, bands=bands, latch_heads=HEADS, head_sizes=SIZES)


def _lanes(entropy_norm: dict[str, float], kl: dict[str, float] | None = None) -> np.ndarray:
    """One learner's head-health lanes for the given normalised entropies (entropy = norm * ln n)."""
    entropy = [entropy_norm[h] * math.log(n) for h, n in zip(HEADS, SIZES, strict=True)]
    kls = [(kl or {}).get(h, 0.0) for h in HEADS]
    return np.array([*entropy, *kls, 1.0, 1.0 if kl else 0.0])


def _step(tracker: TelemetryTracker, health: np.ndarray | None):
    return tracker.finish_iteration(np.zeros(tracker.layout.size), health)


def test_collapse_fires_exactly_on_the_nth_consecutive_low_step_and_stays_latched():
    tracker = _tracker(threshold=0.3, iterations=3)
    op = [0.9, 0.2, 0.1, 0.5, 0.2, 0.25, 0.29, 0.9, 0.95]  # low at 2,3 | reset at 4 | low 5,6,7 -> fires at 7
    latched, first = [], []
    for value in op:
        summary = _step(tracker, _lanes({"op": value, "slot": 1.0}))
        latched.append(summary.collapse_latched["op"])
        first.append(summary.collapse_first_iteration.get("op"))
        assert summary.collapse_latched["slot"] is False
    assert latched == [False] * 6 + [True] * 3  # stays latched at 0.9 and 0.95
    assert first == [None] * 6 + [7] * 3
    metrics = summary.to_metrics()
    assert metrics[mn.head_metric(mn.HEAD_COLLAPSE_LATCH, "op")] == 1.0
    assert metrics[mn.head_metric(mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION, "op")] == 7.0
    assert metrics[mn.head_metric(mn.HEAD_COLLAPSE_LATCH, "slot")] == 0.0
    assert mn.head_metric(mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION, "slot") not in metrics


def test_a_step_without_a_measurement_neither_breaks_nor_extends_a_streak():
    tracker = _tracker(threshold=0.3, iterations=2)
    _step(tracker, _lanes({"op": 0.1, "slot": 1.0}))
    summary = _step(tracker, None)  # no minibatch seen: nothing reported
    assert summary.head_entropy == {} and summary.head_entropy_norm == {} and summary.head_kl == {}
    assert not any(k.startswith("policy/") for k in summary.to_metrics())
    summary = _step(tracker, np.zeros(6))  # every learner's counts 0: the same
    assert summary.collapse_latched["op"] is False
    summary = _step(tracker, _lanes({"op": 0.1, "slot": 1.0}))
    assert summary.collapse_latched["op"] is True and summary.collapse_first_iteration == {"op": 4}


def test_state_dict_round_trip_keeps_streaks_latches_and_first_iterations():
    tracker = _tracker(threshold=0.3, iterations=2)
    for op, slot in [(0.1, 0.1), (0.1, 0.9), (0.9, 0.2)]:  # op latches at 2; slot has a streak of 1
        _step(tracker, _lanes({"op": op, "slot": slot}))
    state = tracker.state_dict()
    restored = _tracker(threshold=0.3, iterations=2)
    restored.load_state_dict(state)
    assert state_digest(restored.state_dict()) == state_digest(state)
    summary = _step(restored, _lanes({"op": 0.9, "slot": 0.2}))  # slot's second low step in a row
    assert summary.collapse_latched == {"op": True, "slot": True}
    assert summary.collapse_first_iteration == {"op": 2, "slot": 4}
    before = _tracker().state_dict()
    assert state_digest(before) != state_digest(state)  # the digest sees the collapse state


def test_entropy_and_kl_are_the_mean_over_the_learners_that_measured():
    tracker = _tracker()
    a = _lanes({"op": 0.5, "slot": 1.0}, kl={"op": 0.02, "slot": 0.04})
    b = _lanes({"op": 0.25, "slot": 0.5}, kl={"op": 0.06, "slot": 0.0})
    summary = _step(tracker, a + b)  # the SUM the collective hands back, two learners
    assert summary.head_entropy["op"] == pytest.approx((0.5 + 0.25) / 2 * math.log(4))
    assert summary.head_entropy_norm == pytest.approx({"op": 0.375, "slot": 0.75})  # / ln 4 and / ln 2
    assert summary.head_kl == pytest.approx({"op": 0.04, "slot": 0.02})
    nothing = np.zeros(6)  # a learner that saw no minibatch adds zeros and count 0
    summary = _step(tracker, a + nothing)
    assert summary.head_entropy_norm == pytest.approx({"op": 0.5, "slot": 1.0})
    metrics = summary.to_metrics()
    assert metrics[mn.head_metric(mn.HEAD_ENTROPY, "slot")] == pytest.approx(math.log(2))
    assert metrics[mn.head_metric(mn.HEAD_KL, "slot")] == pytest.approx(0.04)


def test_head_health_metrics_are_plain_floats():
    """Entropy, entropy_norm and KL reach RLlib as Python floats (what gradmon's fast-path Stats
    takes; a numpy scalar falls back to RLlib's slow reduce), also with the counts summed."""
    summary = _step(_tracker(), _lanes({"op": 0.5, "slot": 1.0}, kl={"op": 0.02, "slot": 0.04}) * 2)
    values = [*summary.head_entropy.values(), *summary.head_entropy_norm.values(), *summary.head_kl.values()]
    assert len(values) == 6 and all(type(v) is float for v in values)
    assert all(type(v) is float for v in summary.to_metrics().values())


def test_a_one_action_head_has_no_entropy_norm_and_never_collapses():
    bands = BandSet(collapse=CollapseBand(threshold=1.01, iterations=1))
    tracker = TelemetryTracker(("a", "b"), ("a", "b"), bands=bands, head_sizes=(1, 3))
    summary = tracker.finish_iteration(np.zeros(tracker.layout.size), np.array([0.0, 0.5, 0.0, 0.0, 1.0, 0.0]))
    assert summary.head_entropy == {"a": 0.0, "b": 0.5}
    assert summary.head_entropy_norm == pytest.approx({"b": 0.5 / math.log(3)})
    assert summary.collapse_latched == {"a": False, "b": True}
    assert summary.head_kl == {}  # KL count 0: not measured


def test_without_head_sizes_no_policy_metrics_at_all():
    tracker = TelemetryTracker(("pi", "vf"), ("pi",), latch_heads=("policy",))
    metrics = tracker.finish_iteration(np.zeros(tracker.layout.size)).to_metrics()
    assert not any(k.startswith(("policy/", "latch/collapse/")) for k in metrics)


@pytest.mark.parametrize(("threshold", "iterations"), [(-0.1, 5), (0.05, 0), (0.05, 1.5), (True, 5)])
def test_collapse_band_refuses_bad_values(threshold, iterations):
    with pytest.raises(ValueError, match="collapse"):
        CollapseBand(threshold=threshold, iterations=iterations)


def test_health_stop_collapse_rule_fires_on_the_latch_with_code_5():
    latch = mn.head_metric(mn.HEAD_COLLAPSE_LATCH, "slot")
    first = mn.head_metric(mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION, "slot")
    off = HealthStopMonitor(HealthStopRules(nan_latch=True))
    assert off.update(3, {latch: 1.0, first: 3.0}) is None  # the rule is off
    monitor = HealthStopMonitor(HealthStopRules(collapse=True))
    assert HealthStopRules(collapse=True).any and not HealthStopRules().any
    assert monitor.update(2, {latch: 0.0, mn.head_metric(mn.HEAD_COLLAPSE_LATCH, "op"): 0.0}) is None
    decision = monitor.update(3, {latch: 1.0, first: 3.0})
    assert (decision.rule, decision.head, decision.iteration, decision.code) == ("collapse", "slot", 3, 5)
    assert STOP_REASON_CODES["collapse"] == 5 and "collapsed" in decision.message


def test_collapse_latches_for_other_heads_are_refused_naming_both_head_lists():
    from gradmon_ray.telemetry.latches import CollapseLatches

    saved = CollapseLatches(("a", "b"), 0.1, 3).state_dict()
    with pytest.raises(ValueError) as err:
        CollapseLatches(("a", "c"), 0.1, 3).load_state_dict(saved)
    assert str(err.value) == "checkpointed collapse latches are for heads ['a', 'b'], this learner has ['a', 'c']"


def test_head_health_lanes_of_the_wrong_length_are_refused_word_for_word():
    tracker = TelemetryTracker(("a", "b"), ("a", "b"), head_sizes=(2, 3))
    assert tracker.head_health_size == 2 * 2 + 2  # entropy and KL sums per head, then the two learner counts
    with pytest.raises(ValueError) as err:
        tracker.finish_iteration(np.zeros(tracker.layout.size), np.zeros(3))
    assert str(err.value) == "expected 6 head-health lanes, got shape (3,)"
