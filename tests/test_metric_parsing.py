"""``metric_parsing.py``: ``parse``, the one parser of gradmon metric names (defined in ``metric_names``).

The round trip enumerates metric_names' name constants (every upper-case ``str`` with a ``/``,
the rule ``tests/test_oracle_table.py`` uses), so a template added to ``metric_names.py`` is
covered here without touching this file; it fails until the new name is in ``metric_parsing.METRIC_TEMPLATES``
(through ``PER_HEAD_TEMPLATES``, ``SCALAR_NAMES`` or ``PROBE_TEMPLATES``) and parses unambiguously.
"""

from __future__ import annotations

import itertools
import re

import pytest

from gradmon_ray import metric_names as mn
from gradmon_ray import metric_parsing as mp
from gradmon_ray.telemetry.buckets import bucket_names
from gradmon_ray.viz.runs import probe_view

PLACEHOLDER = re.compile(r"\{(\w+)\}")

# Sample values for any placeholder; none is a literal segment of a template (a component called
# ``num_steps`` IS ``PROBE_NUM_STEPS``: see test_explicit_probe_scalars_are_not_components).
SAMPLES: tuple[str, ...] = ("op", "value", "blue-print.2", "A_b")
BUCKET_SAMPLES: tuple[str, ...] = ("bucket_1", "bucket_12")


def metric_name_constants() -> dict[str, str]:
    return {a: v for a, v in vars(mn).items() if a.isupper() and isinstance(v, str) and "/" in v}


def sample_fills(template: str) -> list[dict[str, str]]:
    """Several fillings of ``template``'s placeholders, different values in different placeholders."""
    parts = list(dict.fromkeys(PLACEHOLDER.findall(template)))
    choices = [BUCKET_SAMPLES if p == "bucket" else SAMPLES for p in parts]
    return [dict(zip(parts, values, strict=True)) for values in itertools.product(*choices)]


CONSTANTS = metric_name_constants()


def test_the_enumeration_sees_templates_and_scalars():
    values = set(CONSTANTS.values())
    assert {mn.HEAD_GRAD_NORM, mn.HEAD_NAN_LATCH_FIRST_ITERATION, mn.PROBE_HEAD_NORM, mn.GLOBAL_GRAD_NORM} <= values
    assert values == set(mp.METRIC_TEMPLATES), "every metric name constant is one parse knows, and no other"


def test_every_template_round_trips():
    """Every name constant, filled with every sample: parse gives back the template and the parts."""
    failures = []
    for attr, template in sorted(CONSTANTS.items()):
        for parts in sample_fills(template):
            name = template.format(**parts)
            parsed = mp.parse(name)
            if parsed is None:
                failures.append(f"metric_names.{attr}: {name!r} does not parse (add it to METRIC_TEMPLATES)")
            elif (parsed.template, parsed.parts) != (template, parts) or any(parsed[p] != v for p, v in parts.items()):
                failures.append(f"metric_names.{attr}: {name!r} -> {parsed}")
    assert not failures, "\n".join(failures)


def test_no_two_templates_tie_on_a_name():
    """Where several templates match, the one with the most literal text wins; never a tie."""
    failures = []
    for attr, template in sorted(CONSTANTS.items()):
        for parts in sample_fills(template):
            name = template.format(**parts)
            matching = [t for t in mp.METRIC_TEMPLATES if mp.template_pattern(t).match(name)]
            literal = sorted((len(PLACEHOLDER.sub("", t)) for t in matching), reverse=True)
            if literal.count(literal[0]) != 1:
                failures.append(f"metric_names.{attr}: {name!r} matches {matching} equally")
    assert not failures, "\n".join(failures)


def test_scalars_parse_with_no_parts():
    assert mp.parse(mn.GLOBAL_NOISE_SCALE) == mp.ParsedName(mn.GLOBAL_NOISE_SCALE, {})
    assert mp.parse(mn.HEALTH_STOP_REASON) == mp.ParsedName(mn.HEALTH_STOP_REASON, {})


def test_a_latch_first_iteration_is_not_a_latch_of_a_deeper_head():
    parsed = mp.parse("latch/nan/op/first_iteration")
    assert parsed == mp.ParsedName(mn.HEAD_NAN_LATCH_FIRST_ITERATION, {"head": "op"})
    assert mp.heads_of(["latch/nan/op/first_iteration", "latch/nan/slot"], mn.HEAD_NAN_LATCH) == ["slot"]


@pytest.mark.parametrize(
    "name",
    [
        "latch/nan/op/first_iteration/x",  # an extra path level
        "latch/nan/op/extra",
        "grad/head/op/sub/norm",  # a head of two segments
        "grad/head//norm",  # an empty segment
        "latch/nan/",
        "grad_norm/bucket_1//task",
        "grad/global_norm/",  # trailing or leading slash
        "/grad/global_norm",
        "grad/global_norm_x",  # a longer last segment
        "grad/global_norm\n",
        "GRAD/global_norm",
        "grad/head/op/Norm",
        "grad_norm/bucket_x/task",  # a bucket is bucket_<n>
        "grad_norm/1/task",
        "grad_norm/bucket_1/task/extra",
        "grad_norm/bucket_1/regularizer/l2",  # no _grad_norm / _share suffix
        "probe/unknown",
        "policy_loss",  # RLlib's own names and gradmon's tags are not metric names
        mn.TAG_STATUS,
        "",
        "/",
    ],
)
def test_names_that_only_look_like_gradmon_names_do_not_parse(name):
    assert mp.parse(name) is None


@pytest.mark.parametrize(
    "template",
    [mn.PROBE_REWARD_STD_MEAN, mn.PROBE_NUM_GROUPS, mn.PROBE_NUM_EPISODES, mn.PROBE_NUM_STEPS],
)
def test_explicit_probe_scalars_are_not_components(template):
    name = mn.probe_metric(template, "bucket_3")
    assert mp.parse(name) == mp.ParsedName(template, {"bucket": "bucket_3"})
    assert probe_view({name: 1.0}).norms == {}


def test_the_regularizer_total_is_its_own_name():
    name = mn.probe_metric(mn.PROBE_REGULARIZER_TOTAL, "bucket_1")
    assert mp.parse(name) == mp.ParsedName(mn.PROBE_REGULARIZER_TOTAL, {"bucket": "bucket_1"})
    error = mn.probe_metric(mn.PROBE_REGULARIZER_ERROR, "bucket_1", regularizer="l2")
    assert mp.parse(error) == mp.ParsedName(mn.PROBE_REGULARIZER_ERROR, {"bucket": "bucket_1", "regularizer": "l2"})


def test_heads_of_keeps_the_names_order_and_only_that_template():
    names = ["grad/head/b/norm", "grad/head/a/norm_prev", "grad/head/a/norm", "grad/head/x/y/norm", "grad/global_norm"]
    assert mp.heads_of(names, mn.HEAD_GRAD_NORM) == ["b", "a"]
    assert mp.heads_of(names, mn.HEAD_GRAD_NORM_PREV) == ["a"]


def test_probe_buckets_are_in_numeric_order():
    names = [
        mn.probe_metric(mn.PROBE_COMPONENT_NORM, "bucket_10", component="task"),
        mn.probe_metric(mn.PROBE_SHARE, "bucket_2", component="task"),
        mn.probe_metric(mn.PROBE_NUM_STEPS, "bucket_1"),
        mn.probe_metric(mn.PROBE_COMPONENT_NORM, "bucket_2", component="kl"),
        mn.GLOBAL_GRAD_NORM,
    ]
    assert mp.probe_buckets(names) == ["bucket_1", "bucket_2", "bucket_10"]
    view = probe_view({name: 1.0 for name in names})
    assert view.buckets == ["bucket_2", "bucket_10"]  # the buckets with component norms
    assert sorted(bucket_names(12), key=mp.bucket_index) == bucket_names(12)
    assert bucket_names(12)[9:] == ["bucket_10", "bucket_11", "bucket_12"]


def test_bucket_index_and_probe_bucket():
    assert mn.probe_bucket(3) == "bucket_3" and mp.bucket_index("bucket_10") == 10
    for bad in ("bucket_", "bucket_x", "b10", "bucket_1/x"):
        with pytest.raises(ValueError, match="not a probe bucket"):
            mp.bucket_index(bad)


# --- multi-module names (``module/<id>/<name>``) and the template index -------------------------------


def test_a_module_metric_parses_as_its_name_with_the_module_and_a_module_head_label():
    assert mp.split_module("module/p1/grad/global_norm") == ("p1", "grad/global_norm")
    assert mp.split_module("grad/global_norm") == (None, "grad/global_norm")
    # written by hand: HEAD_GRAD_NORM is "grad/head/{head}/norm", the head label of module p1's head op is "p1/op"
    assert mp.parse("module/p1/grad/head/op/norm") == mp.ParsedName(
        mn.HEAD_GRAD_NORM, {"head": "p1/op", "module": "p1"}
    )
    assert mp.parse("module/p1/grad/global_norm") == mp.ParsedName(mn.GLOBAL_GRAD_NORM, {"module": "p1"})
    assert mp.heads_of(["module/p1/grad/head/op/norm", "module/p2/grad/head/op/norm"], mn.HEAD_GRAD_NORM) == [
        "p1/op",
        "p2/op",
    ]


def test_modules_of_lists_each_module_once_in_first_seen_order():
    names = ["module/b/grad/global_norm", "grad/global_norm", "module/a/x", "module/b/y", "plain"]
    assert mp.modules_of(names) == ["b", "a"]
    assert mp.modules_of(["grad/global_norm"]) == []


def test_first_segment_and_the_candidate_index():
    assert mp._first_segment("grad/head/{head}/norm") == "grad"
    assert mp._first_segment("{head}/norm") is None
    assert mp._first_segment("grad") == "grad"
    index = mp._candidates()
    # grad_norm/bucket_1/num_steps fills PROBE_NUM_STEPS and PROBE_COMPONENT_NORM: the explicit name (more
    # literal text) is tried first; every template sits under its literal first segment.
    firsts = [t for t, _ in index["grad_norm"]]
    assert firsts.index(mn.PROBE_NUM_STEPS) < firsts.index(mn.PROBE_COMPONENT_NORM)
    for template in mp.METRIC_TEMPLATES:
        patterns = dict(index[template.split("/", 1)[0]])
        name = template.format(**sample_fills(template)[0])
        assert patterns[template].match(name) is not None
    assert index[None] == ()  # no template starts with a placeholder today
