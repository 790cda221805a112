"""Health bands: the action heads' edges, the value head's own edges, and where each applies."""

from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path

import pytest
import torch

from gradmon_ray.telemetry import (
    ACTION_BANDS,
    VALUE_BANDS,
    BandSet,
    GradientNorms,
    HealthBands,
    IterationAccumulator,
    TelemetryTracker,
    classify_grad_norm,
    worst_head,
)

NAN, INF = float("nan"), float("inf")

# (x, band) at and around every edge: dead < 0.01 <= weak < 0.1 <= healthy <= 2.0 < elevated <= 5.0 < exploding
ACTION_CASES = [
    (0.0, "dead"),
    (0.00999, "dead"),
    (0.01, "weak"),
    (0.0999, "weak"),
    (0.1, "healthy"),
    (2.0, "healthy"),
    (2.0001, "elevated"),
    (3.0, "elevated"),
    (5.0, "elevated"),
    (5.0001, "exploding"),
    (6.0, "exploding"),
    (INF, "exploding"),
    (NAN, "missing"),
]
# dead < 0.01 <= weak < 0.1 <= healthy <= 10 < elevated <= 50 < exploding
VALUE_CASES = [
    (0.0, "dead"),
    (0.00999, "dead"),
    (0.01, "weak"),
    (0.0999, "weak"),
    (0.1, "healthy"),
    (2.0001, "healthy"),
    (3.0, "healthy"),
    (6.0, "healthy"),
    (10.0, "healthy"),
    (10.0001, "elevated"),
    (50.0, "elevated"),
    (50.0001, "exploding"),
    (INF, "exploding"),
    (NAN, "missing"),
]


@pytest.mark.parametrize(("x", "band"), ACTION_CASES)
def test_action_edges_are_classify_grad_norms_default(x, band):
    assert classify_grad_norm(x) == band
    assert classify_grad_norm(x, bands=ACTION_BANDS) == band
    assert ACTION_BANDS.classify(x) == band


@pytest.mark.parametrize(("x", "band"), VALUE_CASES)
def test_value_edges(x, band):
    assert classify_grad_norm(x, bands=VALUE_BANDS) == band
    assert BandSet().for_head("value").classify(x) == band


def test_classify_grad_norm_keeps_its_signature():
    params = inspect.signature(classify_grad_norm).parameters
    assert list(params) == ["x", "bands"]
    assert params["x"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert params["bands"].kind is inspect.Parameter.KEYWORD_ONLY and params["bands"].default is None
    assert ACTION_BANDS.edges == (0.01, 0.1, 2.0, 5.0) and VALUE_BANDS.edges == (0.01, 0.1, 10.0, 50.0)


def test_custom_edges():
    bands = HealthBands(dead_below=0.001, weak_below=0.05, healthy_max=1.0, elevated_max=3.0)
    got = [classify_grad_norm(x, bands=bands) for x in (0.0009, 0.001, 0.05, 1.0, 1.01, 3.0, 3.01)]
    assert got == ["dead", "weak", "healthy", "healthy", "elevated", "elevated", "exploding"]


@pytest.mark.parametrize(
    "edges",
    [
        (0.01, 0.01, 2.0, 5.0),  # equal
        (0.01, 0.1, 5.0, 2.0),  # decreasing
        (0.0, 0.1, 2.0, 5.0),  # not positive
        (-1.0, 0.1, 2.0, 5.0),
        (0.01, 0.1, 2.0, INF),  # not finite
        (0.01, NAN, 2.0, 5.0),
    ],
)
def test_edges_must_be_positive_finite_and_strictly_increasing(edges):
    with pytest.raises(ValueError, match="band edges must be"):
        HealthBands(*edges)


def test_band_set_from_dict_keeps_defaults_for_what_is_not_given():
    assert BandSet.from_dict(None) == BandSet() == BandSet(ACTION_BANDS, VALUE_BANDS)
    custom = BandSet.from_dict({"value": {"healthy_max": 20.0, "elevated_max": 100.0}})
    assert custom.action == ACTION_BANDS and custom.value.edges == (0.01, 0.1, 20.0, 100.0)
    assert BandSet.from_dict(custom.to_dict()) == custom
    assert custom.for_head("value") is custom.value and custom.for_head("op") is custom.action


def test_the_bands_module_does_not_import_torch():
    source = (Path(__file__).resolve().parents[2] / "gradmon_ray" / "telemetry" / "bands.py").read_text()
    imported = [
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(ast.parse(source))
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    ]
    assert not [m for m in imported if m and m.split(".")[0] in ("torch", "numpy", "ray")], imported


def _summary(tracker: TelemetryTracker, heads: list[float]):
    acc = IterationAccumulator(tracker.layout)
    one = torch.tensor(1.0)
    norms = GradientNorms(torch.tensor(heads), one, 0 * one, 0 * one)
    acc.add_minibatch(norms, torch.zeros(len(tracker.action_heads)), torch.zeros(len(tracker.action_heads)), 0 * one)
    return tracker.finish_iteration(acc.drain()[0])


def test_tracker_takes_configured_bands():
    bands = BandSet.from_dict({"action": {"healthy_max": 4.0, "elevated_max": 8.0}, "value": {"elevated_max": 12.0}})
    summary = _summary(TelemetryTracker(("op", "value"), ("op",), bands=bands), [3.0, 13.0])
    assert summary.health == {"op": "healthy", "value": "exploding"}


def test_worst_head_with_a_band_set_judges_value_by_its_own_edges():
    norms = {"op": 0.09, "slot": 1.0, "value": 3.6}
    assert worst_head(norms) == ("value", "elevated")  # one set of edges for all: the old behaviour
    assert worst_head(norms, bands=BandSet()) == ("op", "weak")
    assert worst_head({"op": 1.0, "value": 60.0}, bands=BandSet()) == ("value", "exploding")
    assert math.isclose(VALUE_BANDS.healthy_centre, math.log(1.0))  # sqrt(0.1 * 10)


def test_band_set_round_trips_every_section_through_its_dict():
    from gradmon_ray.telemetry.bands import CollapseBand

    custom = BandSet.from_dict(
        {
            "action": {"dead_below": 0.02, "healthy_max": 3.0},
            "value": {"elevated_max": 100.0},
            "collapse": {"threshold": 0.2, "iterations": 9},
            "update_ratio": {"high": 0.05},
        }
    )
    assert custom.action.edges == (0.02, 0.1, 3.0, 5.0)  # elevated_max keeps its default 5.0
    assert custom.collapse == CollapseBand(threshold=0.2, iterations=9)
    assert custom.to_dict() == {
        "action": {
            "dead_below": 0.02,
            "weak_below": 0.1,
            "healthy_max": 3.0,
            "elevated_max": ACTION_BANDS.elevated_max,
        },
        "value": {
            "dead_below": VALUE_BANDS.dead_below,
            "weak_below": VALUE_BANDS.weak_below,
            "healthy_max": VALUE_BANDS.healthy_max,
            "elevated_max": 100.0,
        },
        "collapse": {"threshold": 0.2, "iterations": 9},
        "update_ratio": {"low": 1e-4, "high": 0.05},  # low keeps its default
    }
    assert BandSet.from_dict(custom.to_dict()) == custom


def test_worst_head_ranks_a_zero_norm_as_dead_without_a_log():
    # 0.0 has no logarithm: it is dead (severity first), at an infinite distance from the healthy centre
    assert worst_head({"a": 0.0, "b": 1.0}) == ("a", "dead")
    assert worst_head({"b": 1.0, "a": 0.0}) == ("a", "dead")
    # two dead heads: the one with no finite distance (0.0) beats one at 1e-3 (equal severity)
    assert worst_head({"c": 1e-3, "a": 0.0}) == ("a", "dead")
