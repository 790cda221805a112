"""Multi-agent runs: module x head names, written and read back, against hand-written answers.

A result dict shaped like RLlib's (``result["learners"][module_id][...]``) with two monitored
modules must become ``module/<id>/<name>`` metrics; one module keeps today's plain names; every
reader (parser, head order, progress line, health stop, bands) sees a module's head as the label
``<id>/<head>``.  Expected values are written out by hand here, not computed by the product.
"""

from __future__ import annotations

import pytest

from gradmon_ray import metric_names as mn
from gradmon_ray import metric_parsing as mp
from gradmon_ray.telemetry.bands import DEFAULT_BANDS
from gradmon_ray.telemetry.health_stop import HealthStopMonitor, HealthStopRules
from gradmon_ray.tracking.result_metrics import order_heads, progress_line, result_to_metrics


def _learner(op_norm: float, vf_norm: float, loss: float) -> dict[str, float]:
    return {
        "grad/head/op/norm": op_norm,
        "grad/head/op/health": 2.0 if 0.1 <= op_norm <= 2.0 else 0.0,
        "grad/head/vf/norm": vf_norm,
        "grad/head/vf/health": 2.0,
        "grad/global_norm": 3.0,
        "latch/nan/op": 0.0,
        "policy_loss": loss,
        "not_gradmon": 7.0,
    }


def _result(**modules: dict[str, float]) -> dict:
    return {
        "env_runners": {"episode_return_mean": 1.5, "num_env_steps_sampled_lifetime": 400},
        "learners": {"__all_modules__": {"num_env_steps_trained": 400}, **modules},
    }


def test_two_modules_are_prefixed_and_progress_is_not():
    metrics = result_to_metrics(_result(p0=_learner(0.5, 1.0, -0.1), p1=_learner(0.002, 4.0, 0.2)))
    assert metrics["module/p0/grad/head/op/norm"] == 0.5
    assert metrics["module/p1/grad/head/op/norm"] == 0.002
    assert metrics["module/p1/grad/head/vf/norm"] == 4.0
    assert metrics["module/p1/grad/global_norm"] == 3.0
    assert metrics["module/p0/loss/policy"] == -0.1 and metrics["module/p1/loss/policy"] == 0.2
    assert metrics["env/episode_return_mean"] == 1.5 and metrics["env/steps_sampled_lifetime"] == 400
    assert not any(k.startswith(("grad/", "loss/", "latch/")) for k in metrics), "no unprefixed module metric"
    assert not any("not_gradmon" in k for k in metrics)


def test_one_module_keeps_the_plain_names():
    metrics = result_to_metrics(_result(default_policy=_learner(0.5, 1.0, -0.1)))
    assert metrics["grad/head/op/norm"] == 0.5 and metrics["loss/policy"] == -0.1
    assert not any(k.startswith("module/") for k in metrics)


def test_parse_reads_module_and_head_label_and_round_trips():
    parsed = mp.parse("module/p1/latch/nan/op/first_iteration")
    assert parsed is not None
    assert parsed.template == mn.HEAD_NAN_LATCH_FIRST_ITERATION
    assert parsed.parts == {"head": "p1/op", "module": "p1"}
    assert mn.head_metric(mn.HEAD_NAN_LATCH_FIRST_ITERATION, "p1/op") == "module/p1/latch/nan/op/first_iteration"
    assert mp.parse("module/p1/grad/global_norm").parts == {"module": "p1"}
    assert mp.parse("module/p1/nonsense") is None
    assert mp.modules_of(["module/b/grad/global_norm", "grad/global_norm", "module/a/x", "module/b/y"]) == ["b", "a"]


def test_head_order_keeps_modules_together_value_heads_last():
    heads = ["p1/vf", "p0/b", "p1/a", "p0/vf", "p0/a", "p1/b"]
    assert order_heads(heads) == ["p0/a", "p0/b", "p0/vf", "p1/a", "p1/b", "p1/vf"]
    tagged = ["p1/b", "p1/a", "p1/vf", "p0/b", "p0/a", "p0/vf"]
    assert order_heads(heads, tagged) == tagged
    assert order_heads(["vf", "op", "value", "a"]) == ["a", "op", "value", "vf"]
    assert order_heads(["a10", "vf", "a2", "a1"]) == ["a1", "a2", "a10", "vf"]  # numbers compare as numbers


@pytest.mark.parametrize("label", ["vf", "value", "p1/vf", "p0/value"])
def test_value_heads_are_judged_by_the_value_edges(label):
    assert mn.is_value_head(label)
    assert DEFAULT_BANDS.for_head(label) == DEFAULT_BANDS.value
    assert DEFAULT_BANDS.for_head(label.replace("vf", "op").replace("value", "op")) == DEFAULT_BANDS.action


def test_progress_line_names_the_module_of_the_worst_head():
    metrics = result_to_metrics(_result(p0=_learner(0.5, 1.0, -0.1), p1=_learner(0.002, 4.0, 0.2)))
    line = progress_line(3, 10, metrics)
    # p1/op at 0.002 is dead (< 0.01): the worst action head; vf heads are value heads, not judged.
    assert "worst head p1/op 0.002 (dead)" in line, line


def test_health_stop_names_the_module():
    monitor = HealthStopMonitor(HealthStopRules(dead_iterations=2))
    dead = result_to_metrics(_result(p0=_learner(0.5, 1.0, 0.0), p1=_learner(0.002, 1.0, 0.0)))
    assert monitor.update(1, dead) is None
    decision = monitor.update(2, dead)
    assert decision is not None and decision.head == "p1/op" and decision.rule == "dead"
    assert "head 'op' of module 'p1' dead for 2 consecutive iterations" in decision.message


def test_health_stop_leaves_module_value_heads_alone_unless_asked():
    def dead_vf(module: str) -> dict[str, float]:
        return {f"module/{module}/grad/head/vf/health": 0.0, f"module/{module}/grad/head/vf/norm": 0.001}

    quiet = HealthStopMonitor(HealthStopRules(dead_iterations=1))
    assert quiet.update(1, {**dead_vf("p0"), **dead_vf("p1")}) is None
    strict = HealthStopMonitor(HealthStopRules(dead_iterations=1, include_value_head=True))
    decision = strict.update(1, {**dead_vf("p0"), **dead_vf("p1")})
    assert decision is not None and decision.head == "p0/vf"
