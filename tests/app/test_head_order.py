"""Head order (``gradmon_ray.app.head_order``) is the action space's order, then ``value``: never
the order of the metric keys.

RLlib's ``MetricsLogger.aggregate`` merges the learners' results through a ``set`` of key
paths, so the keys of ``result["learners"][module]`` come in a different order in every
process.  Every reader and writer of the head list must give the same order whatever that is.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import gymnasium as gym

from gradmon_ray import metric_names as mn
from gradmon_ray.app.head_order import head_order, reported_head_order
from gradmon_ray.envs import HEAD_NAMES, HEAD_SIZES
from gradmon_ray.rllib.module import resolve_heads
from gradmon_ray.tracking.result_metrics import heads_in, order_heads
from gradmon_ray.tracking.result_metrics import latch_tags as _latch_tags
from gradmon_ray.viz.runs import run_heads

DICT_SPACE = gym.spaces.Dict({h: gym.spaces.Discrete(HEAD_SIZES[h]) for h in HEAD_NAMES})
DICT_ORDER = [*resolve_heads(DICT_SPACE).names, "value"]
MD_SPACE = gym.spaces.MultiDiscrete([3, 4, 2, 5])
MD_NAMES = ["move", "fire", "aim", "jump"]  # not sorted: the configured order must win
MD_ORDER = [*MD_NAMES, "value"]
SEEDS = range(8)


def _metrics(heads: list[str], seed: int, latched: tuple[str, ...] = ()) -> dict[str, float]:
    """A learner result's gradmon metrics for ``heads``, keys in a shuffled order."""
    items = [(mn.GLOBAL_GRAD_NORM, 1.0)]
    for head in heads:
        items.append((mn.head_metric(mn.HEAD_GRAD_NORM, head), 0.5))
        items.append((mn.head_metric(mn.HEAD_GRAD_NORM_PREV, head), 0.4))
        if head != "value":
            items.append((mn.head_metric(mn.HEAD_NAN_LATCH, head), float(head in latched)))
            items.append((mn.head_metric(mn.HEAD_INF_LATCH, head), float(head in latched)))
    random.Random(seed).shuffle(items)
    return dict(items)


def test_reported_head_order_is_resolve_heads_then_value():
    assert [*sorted(HEAD_NAMES), "value"] == DICT_ORDER  # a Dict space: sorted keys (dm-tree's order)
    assert list(reported_head_order(DICT_SPACE)) == DICT_ORDER
    assert list(reported_head_order(MD_SPACE, MD_NAMES)) == MD_ORDER
    assert list(reported_head_order(gym.spaces.Discrete(3))) == ["action", "value"]


def _every_seed(check) -> None:
    """Run ``check(seed)`` on every key shuffle; fail once, naming each seed whose check failed."""
    orders = {tuple(k for k in _metrics(DICT_ORDER, seed) if k.endswith("/norm")) for seed in SEEDS}
    assert len(orders) == len(SEEDS), "premise: every seed shuffles the heads differently"
    failures = []
    for seed in SEEDS:
        try:
            check(seed)
        except AssertionError as error:
            failures.append(f"seed {seed}: {error}")
    assert not failures, "\n".join(failures)


def test_heads_in_does_not_follow_the_key_order():
    def check(seed: int) -> None:
        assert heads_in(_metrics(DICT_ORDER, seed)) == DICT_ORDER  # no order given: sorted, then value
        assert heads_in(_metrics(MD_ORDER, seed), MD_ORDER) == MD_ORDER
        assert heads_in(_metrics(MD_ORDER, seed)) == [*sorted(MD_NAMES), "value"]

    _every_seed(check)


def test_latch_tags_name_heads_in_action_space_order():
    def check(seed: int) -> None:
        tags = {mn.TAG_HEAD_NAMES: ",".join(DICT_ORDER)}
        assert _latch_tags(_metrics(DICT_ORDER, seed), False) == tags  # no order known: sorted, the Dict's own
        assert _latch_tags(_metrics(DICT_ORDER, seed), False, reported_head_order(DICT_SPACE)) == tags
        assert _latch_tags(_metrics(DICT_ORDER, seed), True, DICT_ORDER) == {}  # set once only
        latched = ("jump", "move", "aim")
        tags = _latch_tags(_metrics(MD_ORDER, seed, latched), False, reported_head_order(MD_SPACE, MD_NAMES))
        assert tags[mn.TAG_HEAD_NAMES] == ",".join(MD_ORDER)
        assert tags[mn.TAG_NAN_LATCHED_HEADS] == tags[mn.TAG_INF_LATCHED_HEADS] == "move,aim,jump"

    _every_seed(check)


def test_run_heads_follows_the_tag_and_else_sorts():
    def check(seed: int) -> None:
        assert run_heads(_metrics(MD_ORDER, seed), {mn.TAG_HEAD_NAMES: ",".join(MD_ORDER)}) == MD_ORDER
        assert run_heads(_metrics(DICT_ORDER, seed), {}) == DICT_ORDER
        assert run_heads(_metrics(MD_ORDER, seed), {}) == [*sorted(MD_NAMES), "value"]

    _every_seed(check)


def test_order_heads_puts_unknown_heads_sorted_after_the_known_ones_and_value_last():
    assert order_heads(["zeta", "value", "fire", "alpha", "move", "fire"], MD_ORDER) == [
        "move",
        "fire",
        "alpha",
        "zeta",
        "value",
    ]
    assert order_heads(["value", "b", "a"], ["value", "b"]) == ["b", "a", "value"]
    assert order_heads([]) == []


def test_the_driver_takes_the_order_from_the_modules_action_space_and_config():
    algo = SimpleNamespace(spaces={"default_policy": (gym.spaces.Box(0, 1, (3,)), MD_SPACE)})
    cfg = SimpleNamespace(model=SimpleNamespace(head_names=MD_NAMES), env=SimpleNamespace(id="x"))
    assert list(head_order(algo, cfg)) == MD_ORDER
    algo.spaces["default_policy"] = (None, DICT_SPACE)
    plain = SimpleNamespace(model=SimpleNamespace(head_names=None), env=SimpleNamespace(id="x"))
    assert list(head_order(algo, plain)) == DICT_ORDER


def test_the_built_in_env_is_shown_in_its_declared_order_op_first():
    from gradmon_ray.envs import BUILTIN_ENV_ID, FactoredOpsEnv

    algo = SimpleNamespace(spaces={"default_policy": (None, FactoredOpsEnv().action_space)})
    cfg = SimpleNamespace(model=SimpleNamespace(head_names=None), env=SimpleNamespace(id=BUILTIN_ENV_ID))
    expected = ["op", "slot", "blueprint", "style", "tempo", "alpha_target", "alpha_speed", "alpha_curve", "value"]
    assert list(head_order(algo, cfg)) == expected
