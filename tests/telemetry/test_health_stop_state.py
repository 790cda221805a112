"""HealthStopMonitor's checkpoint format: ``"<dead|exploding>/<head>" -> streak``, its own, not a metric name."""

from __future__ import annotations

import pytest

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.health_stop import HealthStopMonitor, HealthStopRules


def _dead(head: str) -> dict[str, float]:
    return {mn.head_metric(mn.HEAD_GRAD_HEALTH, head): float(mn.HEALTH_CODES["dead"])}


def test_streak_state_round_trips_and_continues():
    a = HealthStopMonitor(HealthStopRules(dead_iterations=3))
    a.update(1, _dead("op"))
    a.update(2, _dead("op"))
    assert a.state_dict() == {"dead/op": 2, "exploding/op": 0, "spiking/op": 0}
    b = HealthStopMonitor(HealthStopRules(dead_iterations=3))
    b.load_state_dict(a.state_dict())
    decision = b.update(3, _dead("op"))
    assert decision is not None and (decision.rule, decision.head) == ("dead", "op")


@pytest.mark.parametrize("key", ["dead", "dead/", "weak/op", "/op", "op"])
def test_a_key_that_is_not_a_streak_key_is_refused(key):
    with pytest.raises(ValueError, match="streak key"):
        HealthStopMonitor(HealthStopRules(dead_iterations=3)).load_state_dict({key: 1})
