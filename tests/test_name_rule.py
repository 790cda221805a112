"""The one name rule (``head_labels.check_name``): every accepted head name and module id
round-trips through the metric grammar, and every name the grammar or MLflow cannot carry is
refused, in one line, by each place that takes one.

Oracles, none of them the rule itself: ``metric_parsing.parse`` (the one reader) must give back the
template, the head label and the module of each name ``metric_names`` writes; MLflow's own
``_validate_metric_name`` (its character set on Linux and on Windows, and its "a path must not
resolve to another name" check) and its 250-character key limit must take every such name; the
``gradmon.head_names`` / ``gradmon.value_heads`` tags must split back into the same labels.

Bugs these catch: a rule that lets ``/`` (``pi/logits`` read as module ``pi``), ``,`` (a tag split
in two), ``.``/``..`` (MLflow refuses ``grad/head/../norm``), a space, a control character or a
non-ASCII letter through; a name so long its metric passes MLflow's limit; a place that takes a
name without asking the rule (heads, value_heads, modules, per_module keys, gradmon's own module).
"""

from __future__ import annotations

import string
from unittest import mock

import gymnasium as gym
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlflow.utils import validation as mlflow_validation

from gradmon_ray import metric_names as mn
from gradmon_ray import metric_parsing as mp
from gradmon_ray.config.module_patterns import is_pattern
from gradmon_ray.head_labels import MAX_NAME_LENGTH, check_name
from gradmon_ray.rllib.module import ModelConfigError, resolve_heads
from gradmon_ray.rllib.settings import GradmonSettings

NEAR_VALID = string.ascii_letters + string.digits + "_-."
TROUBLE = "/ ,:\t\n\x00\x7f\\é{}#?*%"
"""Characters that break the grammar, a tag or MLflow somewhere (or are whitespace/control/non-ASCII)."""

names = st.one_of(
    st.text(alphabet=NEAR_VALID, min_size=1, max_size=MAX_NAME_LENGTH + 3),
    st.text(alphabet=NEAR_VALID + TROUBLE, max_size=12),
    st.sampled_from([".", "..", "...", "-", "_", "a..b", ".hidden", "x" * MAX_NAME_LENGTH]),
    st.text(max_size=6),  # anything unicode
)
FILL = {"bucket": "bucket_3", "component": "task"}


def accepted(name: str) -> bool:
    try:
        check_name(name, "name")
    except ValueError:
        return False
    return True


def mlflow_accepts(metric: str) -> bool:
    """MLflow's own validation, as its Linux and its Windows servers run it."""
    for windows in (False, True):
        with mock.patch.object(mlflow_validation, "is_windows", return_value=windows):
            try:
                mlflow_validation._validate_metric_name(metric)
            except Exception:
                return False
    return len(metric) <= mlflow_validation.MAX_ENTITY_KEY_LENGTH


def written(template: str, label: str) -> str:
    """The metric gradmon writes for ``label`` (a head, or ``<module>/<head>``) and ``template``."""
    if template in mn.PER_HEAD_TEMPLATES:
        return mn.head_metric(template, label)
    module, head = mn.split_head_label(label)
    return mn.module_metric(module, template.format(head=head, **FILL))


PER_HEAD = (*mn.PER_HEAD_TEMPLATES, mn.PROBE_HEAD_NORM)


def round_trips(head: str, module: str | None) -> list[str]:
    """What goes wrong when ``head`` (of ``module``) is written and read back; [] when nothing."""
    label = mn.head_label(module, head)
    problems = []
    if mn.split_head_label(label) != (module, head):
        problems.append(f"label {label!r} splits as {mn.split_head_label(label)}")
    for template in PER_HEAD:
        metric = written(template, label)
        parsed = mp.parse(metric)
        want = {"head": label, **({"module": module} if module is not None else {})}
        if template == mn.PROBE_HEAD_NORM:
            want |= FILL
        if parsed is None or parsed.template != template or parsed.parts != want:
            problems.append(f"{metric!r} parses as {parsed}")
        if not mlflow_accepts(metric):
            problems.append(f"MLflow refuses {metric!r}")
    for tag in (mn.format_value_heads([label, label]),):
        if mn.parse_value_heads(tag) != (label, label) or tag.split(",") != [label, label]:
            problems.append(f"tag {tag!r} splits wrong")
    return problems


@settings(max_examples=250, deadline=None)
@given(head=names, module=names)
def test_every_accepted_name_round_trips_and_every_name_that_breaks_it_is_refused(head, module):
    for m in (None, module):
        if m is not None and not accepted(m):
            continue
        problems = round_trips(head, m)
        if accepted(head):
            assert problems == [], (head, m)
        elif m is None:
            # refused: the grammar or MLflow breaks on it, or it is one of the names refused for
            # portability (whitespace, ':', control, non-ASCII, over MAX_NAME_LENGTH)
            portable = all(c in NEAR_VALID for c in head) and 0 < len(head) <= MAX_NAME_LENGTH
            assert problems or not portable, f"{head!r} round-trips and is portable, yet refused"


@pytest.mark.parametrize(
    "bad",
    ["pi/logits", "", " pi", "pi ", "a b", "a,b", "a:b", ".", "..", "tab\there", "nl\n", "\x00", "é", "x" * 65],
)
def test_each_bad_name_is_refused_by_the_rule_in_one_line_naming_it_and_what_is_allowed(bad):
    with pytest.raises(ValueError) as info:
        check_name(bad, "gradmon head name")
    message = str(info.value)
    assert "\n" not in message and repr(bad) in message
    assert message.startswith("gradmon head name ") and "A-Z a-z 0-9 _ - ." in message


def test_what_the_rule_accepts():
    for good in ("pi", "vf", "a0", "default_policy", "blue-print.2", "A_b", ".hidden", "a..b", "x" * 64):
        assert check_name(good, "head") == good
    assert len(mn.module_metric("m" * 64, mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION.format(head="h" * 64))) <= 250


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad=names.filter(lambda n: not accepted(n)))
def test_every_place_that_takes_a_name_refuses_a_bad_one_in_one_line(bad):
    """The gradmon settings (heads keys, value_heads, modules, per_module keys) and gradmon's own
    module (``model.head_names``, ``Dict`` action keys).  ``modules`` also takes glob patterns
    (``config.module_patterns``): a bad name that is one (``*``, ``a?b``) is accepted there."""
    glob = isinstance(bad, str) and is_pattern(bad) and accepted(bad.replace("*", "x").replace("?", "x"))
    if glob:
        assert GradmonSettings.from_learner_config({"gradmon": {"modules": [bad]}}).modules == (bad,)
    entries = [
        {"heads": {bad: r"^pi\."}},
        {"value_heads": [bad]},
        *([] if glob else [{"modules": [bad]}]),
        {"per_module": {bad: {}}},
        {"per_module": {"p0": {"heads": {bad: r"^pi\."}}}},
        {"per_module": {"p0": {"value_heads": [bad]}}},
    ]
    for gradmon in entries:
        with pytest.raises(ValueError) as info:
            GradmonSettings.from_learner_config({"gradmon": gradmon})
        assert "\n" not in str(info.value) and repr(bad) in str(info.value), gradmon
    with pytest.raises(ModelConfigError, match=r"^model\.head_names: head name "):
        resolve_heads(gym.spaces.MultiDiscrete([2, 3]), [bad, "ok"])
    if isinstance(bad, str) and bad:  # a gymnasium Dict needs str keys
        with pytest.raises(ModelConfigError, match="Dict action key"):
            resolve_heads(gym.spaces.Dict({bad: gym.spaces.Discrete(2)}))
