"""Gradient-health early stopping rules, checked iteration by iteration."""

from __future__ import annotations

import math

import pytest

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.health_stop import STOP_REASON_CODES, HealthStopMonitor, HealthStopRules

CODE = mn.HEALTH_CODES


def _metrics(health: dict[str, str], nan: dict[str, float] | None = None) -> dict[str, float]:
    out = {mn.head_metric(mn.HEAD_GRAD_HEALTH, h): float(CODE[s]) for h, s in health.items()}
    out.update({mn.head_metric(mn.HEAD_GRAD_NORM, h): 1.0 for h in health})
    for head, value in (nan or {}).items():
        out[mn.head_metric(mn.HEAD_NAN_LATCH, head)] = value
        out[mn.head_metric(mn.HEAD_INF_LATCH, head)] = 0.0
    return out


def test_exploding_streak_of_three_fires_on_the_third_consecutive_iteration():
    monitor = HealthStopMonitor(HealthStopRules(exploding_iterations=3))
    sequence = ["exploding", "exploding", "healthy", "exploding", "exploding", "exploding"]
    fired = [monitor.update(i + 1, _metrics({"op": s, "slot": "healthy"})) for i, s in enumerate(sequence)]
    assert [d is not None for d in fired] == [False, False, False, False, False, True]  # the streak restarts at 4
    decision = fired[-1]
    assert (decision.rule, decision.head, decision.iteration, decision.code) == ("exploding", "op", 6, 2)
    assert "exploding for 3 consecutive iterations" in decision.message


def test_dead_rule_and_missing_values_neither_break_nor_extend_a_streak():
    monitor = HealthStopMonitor(HealthStopRules(dead_iterations=2))
    assert monitor.update(1, _metrics({"value": "dead"})) is None
    nan_health = {mn.head_metric(mn.HEAD_GRAD_HEALTH, "value"): math.nan}
    assert monitor.update(2, nan_health) is None
    assert monitor.update(3, {}) is None  # telemetry off this iteration
    decision = monitor.update(4, _metrics({"value": "dead"}))
    assert decision is not None and decision.rule == "dead" and decision.code == STOP_REASON_CODES["dead"]


def test_rules_off_never_fire_and_one_iteration_rules():
    off = HealthStopMonitor(HealthStopRules())
    assert not off.rules.any
    for i in range(10):
        assert off.update(i, _metrics({"op": "exploding"}, nan={"op": 1.0})) is None
    one = HealthStopMonitor(HealthStopRules(exploding_iterations=1))
    assert one.update(1, _metrics({"op": "exploding"})).iteration == 1


def test_nan_latch_rule_ignores_first_iteration_metrics_and_wins_over_streaks():
    monitor = HealthStopMonitor(HealthStopRules(nan_latch=True, exploding_iterations=1))
    metrics = _metrics({"op": "healthy", "slot": "exploding"}, nan={"op": 0.0, "slot": 0.0})
    metrics[mn.head_metric(mn.HEAD_NAN_LATCH_FIRST_ITERATION, "op")] = 7.0  # not a latch value
    assert monitor.update(1, metrics).rule == "exploding"
    metrics[mn.head_metric(mn.HEAD_NAN_LATCH, "slot")] = 1.0
    decision = monitor.update(2, metrics)
    assert (decision.rule, decision.head, decision.code) == ("nan_latch", "slot", 3)


def test_state_round_trip_keeps_streaks():
    a = HealthStopMonitor(HealthStopRules(exploding_iterations=3))
    a.update(1, _metrics({"op": "exploding"}))
    a.update(2, _metrics({"op": "exploding"}))
    b = HealthStopMonitor(HealthStopRules(exploding_iterations=3))
    b.load_state_dict(a.state_dict())
    assert b.update(3, _metrics({"op": "exploding"})).iteration == 3
    with pytest.raises(ValueError, match="dead_iterations must be >= 0"):
        HealthStopMonitor(HealthStopRules(dead_iterations=-1))
