"""Gradient-health early stopping rules, checked iteration by iteration."""

from __future__ import annotations

import math

import pytest
import torch

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry import GradientNorms, IterationAccumulator, TelemetryTracker
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
    assert monitor.update(1, _metrics({"slot": "dead"})) is None
    nan_health = {mn.head_metric(mn.HEAD_GRAD_HEALTH, "slot"): math.nan}
    assert monitor.update(2, nan_health) is None
    assert monitor.update(3, {}) is None  # telemetry off this iteration
    decision = monitor.update(4, _metrics({"slot": "dead"}))
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


def _value_at(norm: float, health: str) -> dict[str, float]:
    """An iteration where the action heads are healthy and the value head's norm is ``norm``."""
    metrics = _metrics({"op": "healthy", "slot": "healthy", "value": health})
    metrics[mn.head_metric(mn.HEAD_GRAD_NORM, "value")] = norm
    return metrics


def test_value_head_at_6_does_not_stop_the_run_by_default():
    """A value gradient of 6.0 is healthy for a critic; the old code called it exploding and stopped."""
    tracker = TelemetryTracker(("op", "slot", "value"), ("op", "slot"))
    acc = IterationAccumulator(tracker.layout)
    one = torch.tensor(1.0)
    acc.add_minibatch(
        GradientNorms(torch.tensor([1.0, 1.0, 6.0]), one, 0 * one, 0 * one), torch.zeros(2), torch.zeros(2), 0 * one
    )
    summary = tracker.finish_iteration(acc.drain()[0])
    assert summary.health["value"] == "healthy"
    monitor = HealthStopMonitor(HealthStopRules(exploding_iterations=1, dead_iterations=1))
    assert monitor.update(1, summary.to_metrics()) is None
    # Even a value health code of "exploding" (e.g. from custom edges) is ignored by default ...
    assert monitor.update(2, _value_at(60.0, "exploding")) is None
    assert monitor.update(3, _value_at(0.001, "dead")) is None


def test_value_head_is_watched_by_its_own_bands_when_included():
    rules = HealthStopRules(exploding_iterations=2, include_value_head=True)
    assert rules.any and not HealthStopRules(include_value_head=True).any
    monitor = HealthStopMonitor(rules)
    assert monitor.update(1, _value_at(6.0, "healthy")) is None  # value bands: healthy up to 10
    assert monitor.update(2, _value_at(60.0, "exploding")) is None
    decision = monitor.update(3, _value_at(60.0, "exploding"))
    assert (decision.rule, decision.head, decision.iteration) == ("exploding", "value", 3)


def test_inf_latch_rule_names_its_rule_head_and_reason():
    monitor = HealthStopMonitor(HealthStopRules(inf_latch=True))
    metrics = _metrics({"op": "healthy", "slot": "healthy"}, nan={"op": 0.0, "slot": 0.0})
    assert monitor.update(1, metrics) is None
    metrics[mn.head_metric(mn.HEAD_INF_LATCH, "slot")] = 1.0
    decision = monitor.update(2, metrics)
    assert (decision.rule, decision.head, decision.iteration) == ("inf_latch", "slot", 2)
    assert decision.code == STOP_REASON_CODES["inf_latch"]
    assert decision.message == f"{mn.describe_head('slot')}: Inf in its log-probs (latched)"


def test_spiking_streak_of_two_fires_with_its_own_code_and_a_spike_breaks_no_exploding_streak():
    """A head "spiking" (calm mean, one exploding minibatch) two iterations in a row fires the
    spiking rule (code 6) on the second; the exploding rule (also on) counts only "exploding"."""
    monitor = HealthStopMonitor(HealthStopRules(exploding_iterations=2, spiking_iterations=2))
    sequence = ["spiking", "healthy", "spiking", "spiking"]
    fired = [monitor.update(i + 1, _metrics({"op": s, "slot": "healthy"})) for i, s in enumerate(sequence)]
    assert [d is not None for d in fired] == [False, False, False, True]
    decision = fired[-1]
    assert (decision.rule, decision.head, decision.iteration, decision.code) == ("spiking", "op", 4, 6)
    assert "spiking for 2 consecutive iterations" in decision.message
    restored = HealthStopMonitor(HealthStopRules(spiking_iterations=3))
    restored.load_state_dict(monitor.state_dict())  # the spiking streak survives a checkpoint
    assert restored.update(5, _metrics({"op": "spiking"})).rule == "spiking"


def test_reproduced_rule_stops_on_a_reproduced_event_of_any_module_and_never_on_a_transient_one():
    monitor = HealthStopMonitor(HealthStopRules(reproduced_nonfinite=True))
    assert monitor.update(1, {mn.DIAGNOSIS_REPRODUCED: 0.0}) is None  # transient: training goes on
    assert monitor.update(2, {}) is None  # no event: the metric is left out
    decision = monitor.update(
        3, {"module/p1/" + mn.DIAGNOSIS_REPRODUCED: 0.0, "module/p2/" + mn.DIAGNOSIS_REPRODUCED: 1.0}
    )
    assert decision is not None and decision.code == STOP_REASON_CODES["reproduced_nonfinite"] == 7
    assert decision.head == "p2" and "module p2" in decision.message
    assert HealthStopMonitor(HealthStopRules()).update(1, {mn.DIAGNOSIS_REPRODUCED: 1.0}) is None  # rule off
