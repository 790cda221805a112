"""``config/module_patterns.py``: the module ids and glob patterns ``modules`` and ``probe.modules`` take.

Every answer is written out by hand.  Bugs these catch: a pattern matched as a literal id (``league_*``
naming no league module), an id matched as a prefix (``p1`` naming ``p10``), ``[``/``]`` read as a
character class, a pattern holding characters no metric name can carry (``/``, a space) accepted, an
entry that matched a module reported as unmatched, and the run config refusing a pattern.
"""

from __future__ import annotations

import pytest

from gradmon_ray.config import ConfigError, config_from_dict
from gradmon_ray.config.module_patterns import check_module_entry, matches, unmatched


@pytest.mark.parametrize(
    ("module_id", "entries", "expected"),
    [
        ("league_3", ["league_*"], True),
        ("league_", ["league_*"], True),  # * matches the empty run too
        ("main_league_3", ["league_*"], False),
        ("p1", ["p?"], True),
        ("p10", ["p?"], False),
        ("p10", ["p1"], False),  # an id is the whole id, never a prefix
        ("p1", ["p0", "p1"], True),
        ("p1", None, True),  # no list: every module
        ("league_1", ["league_[0-9]*"], False),  # [...] is no character class (refused when read, below)
    ],
)
def test_matches(module_id, entries, expected):
    assert matches(module_id, entries) is expected


def test_unmatched_keeps_the_order_of_the_entries():
    assert unmatched(["x_*", "p0", "typo", "p?"], ["p0", "p1"]) == ["x_*", "typo"]
    assert unmatched(None, ["p0"]) == []


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("league/*", "module id 'league/*' is not a module id or a glob pattern of one: use 1-64 characters"),
        ("a b*", "module id 'a b*' is not a module id or a glob pattern of one"),
        ("a[0-9]", "module id 'a[0-9]' cannot go into gradmon's metric names"),
        ("p 1", "module id 'p 1' cannot go into gradmon's metric names"),
    ],
)
def test_an_entry_no_metric_name_can_carry_is_one_line(entry, message):
    with pytest.raises(ValueError) as raised:
        check_module_entry(entry, "module id")
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
    assert check_module_entry("league_*", "module id") == "league_*" and check_module_entry("p1", "x") == "p1"


def test_the_run_configs_probe_modules_take_patterns_and_refuse_a_bad_one():
    cfg = config_from_dict({"probe": {"gradient_analysis_every": 1, "modules": ["league_*", "main"]}})
    assert cfg.probe.modules == ["league_*", "main"]
    with pytest.raises(ConfigError, match=r"^probe\.modules: module id 'league/\*' is not a module id or a glob"):
        config_from_dict({"probe": {"modules": ["league/*"]}})
