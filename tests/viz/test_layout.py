"""Pure layout logic shared by the panel, plots and report: module grouping, unique abbreviations,
the run's band edges read back from its params.  Hand-written answers; bugs caught: a plain cut
that makes ``alpha_target``/``alpha_speed``/``alpha_curve`` all ``alpha_…``, a clash left
unresolved, modules interleaved or reordered, a run's configured edges ignored."""

from __future__ import annotations

import pytest

from gradmon_ray.envs import HEAD_NAMES
from gradmon_ray.telemetry.bands import DEFAULT_BANDS, HealthBands
from gradmon_ray.viz.layout import abbreviate, group_heads, legend, run_bands, short_head


def test_the_builtin_heads_at_7_characters():
    short = abbreviate([*HEAD_NAMES, "value"], 7)
    assert short == {
        "op": "op",
        "slot": "slot",
        "blueprint": "bluepr…",
        "style": "style",
        "tempo": "tempo",
        "alpha_target": "a_targ…",
        "alpha_speed": "a_speed",
        "alpha_curve": "a_curve",
        "value": "value",
    }
    assert legend(short) == "bluepr… = blueprint, a_targ… = alpha_target, a_speed = alpha_speed, a_curve = alpha_curve"


@pytest.mark.parametrize(
    ("names", "width", "expected"),
    [
        # the initials collide (h_c_1 twice): numbered, by a cut of the name
        (
            ["head_comp_1", "head_comp_2", "hxx_comp_1"],
            7,
            {"head_comp_1": "head_…1", "head_comp_2": "h_c_2", "hxx_comp_1": "hxx_c…2"},
        ),
        # one word each, same first 6 letters
        (["abcdefghij", "abcdefghik"], 7, {"abcdefghij": "abcde…1", "abcdefghik": "abcde…2"}),
        # a numbered name would collide with a name that fits: positions as the last resort
        (["abcde…1", "abcdefghij", "abcdefghik"], 7, {"abcde…1": "h1", "abcdefghij": "h2", "abcdefghik": "h3"}),
        (["op", "slot"], 2, {"op": "op", "slot": "s…"}),
    ],
)
def test_abbreviations_are_unique_and_fit(names, width, expected):
    short = abbreviate(names, width)
    assert short == expected
    assert len(set(short.values())) == len(names) and all(len(s) <= width for s in short.values())


def test_abbreviation_too_narrow_for_any_unique_name():
    with pytest.raises(ValueError, match="cannot name 10 heads uniquely in 2 characters"):
        abbreviate([f"head{i}" for i in range(10)], 2)


def test_group_heads_keeps_modules_together_in_first_seen_order():
    heads = ["p2/op", "p1/op", "p2/value", "p1/vf"]
    assert group_heads(heads) == [("p2", ["p2/op", "p2/value"]), ("p1", ["p1/op", "p1/vf"])]
    assert group_heads(["op", "value"]) == [(None, ["op", "value"])]
    assert group_heads([]) == []
    assert [short_head(h) for h in heads] == ["op", "op", "value", "vf"]


def _params(action: tuple[float, ...], value: tuple[float, ...]) -> dict[str, str]:
    edges = ("dead_below", "weak_below", "healthy_max", "elevated_max")
    out = {f"telemetry.bands.action.{e}": str(v) for e, v in zip(edges, action, strict=True)}
    out.update({f"telemetry.bands.value.{e}": str(v) for e, v in zip(edges, value, strict=True)})
    return out


def test_run_bands_reads_the_runs_configured_edges():
    bands = run_bands(_params((0.001, 0.05, 1.0, 3.0), (0.02, 0.2, 5.0, 20.0)))
    assert bands.action == HealthBands(0.001, 0.05, 1.0, 3.0)
    assert bands.value == HealthBands(0.02, 0.2, 5.0, 20.0)
    assert bands.for_head("p1/vf").classify(8.0) == "elevated"  # 5 < 8 <= 20
    assert bands.for_head("op").classify(2.0) == "elevated"  # 1 < 2 <= 3


CUSTOM_ACTION = HealthBands(0.001, 0.05, 1.0, 3.0)
CUSTOM_VALUE = HealthBands(0.02, 0.2, 5.0, 20.0)


@pytest.mark.parametrize(
    ("params", "action", "value"),
    [
        ({}, DEFAULT_BANDS.action, DEFAULT_BANDS.value),  # a run without them (a user's own callback)
        ({"telemetry.bands.action.dead_below": "0.01"}, DEFAULT_BANDS.action, DEFAULT_BANDS.value),
        (_params((0.1, 0.01, 2.0, 5.0), CUSTOM_VALUE.edges), DEFAULT_BANDS.action, CUSTOM_VALUE),  # not increasing
        (_params(CUSTOM_ACTION.edges, (0.01, 0.1, float("nan"), 50.0)), CUSTOM_ACTION, DEFAULT_BANDS.value),
        (_params(CUSTOM_ACTION.edges, (0.01, 0.1, "ten", 50.0)), CUSTOM_ACTION, DEFAULT_BANDS.value),
    ],
    ids=["none", "incomplete", "not-increasing", "nan", "not-a-number"],
)
def test_edges_that_do_not_parse_fall_back_to_the_defaults_kind_by_kind(params, action, value):
    bands = run_bands(params)
    assert (bands.action, bands.value) == (action, value)


@pytest.mark.parametrize(
    "noise, params, expected",
    [
        (3400.0, {"ppo.minibatch_size": "128"}, "critical batch ~ B_simple = 3,400 samples; minibatch 128: well below"),
        (3400.0, {"minibatch_size": "4096"}, "minibatch 4,096: near it"),
        (100.0, {"ppo.minibatch_size": "2048"}, "minibatch 2,048: well above it"),
        (3400.0, {"minibatch_size": "None"}, "critical batch ~ B_simple = 3,400 samples"),
    ],
)
def test_batch_advice_says_where_the_minibatch_lies_against_the_noise_scale(noise, params, expected):
    from gradmon_ray.viz.layout import batch_advice

    assert expected in batch_advice(noise, params)


def test_no_advice_without_a_positive_noise_scale():
    from gradmon_ray.viz.layout import batch_advice

    assert batch_advice(None, {}) is None and batch_advice(float("nan"), {}) is None and batch_advice(-3.0, {}) is None
