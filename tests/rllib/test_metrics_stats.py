"""``GradmonMeanStats`` against RLlib's own ``MeanStats`` (the oracle), through RLlib's ``MetricsLogger``.

A bug in the fast path (returning a stale value, dropping NaN, mishandling a learner merge or a
checkpoint restore) shows up as a difference from what stock RLlib reports for the same logs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ray.rllib.utils.metrics.metrics_logger import DEFAULT_STATS_CLS_LOOKUP, MetricsLogger
from ray.rllib.utils.metrics.stats.mean import MeanStats

from gradmon_ray.rllib.metrics_stats import (
    GRADMON_REDUCE,
    GradmonMeanStats,
    log_step_metrics,
)

KEY = "default_policy"


def _same(a: object, b: object) -> bool:
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or a == b


def _stock_logger(steps: list[dict[str, object]]) -> dict:
    logger = MetricsLogger()
    for step in steps:
        for name, value in step.items():
            logger.log_value((KEY, name), value, window=1)
    return logger


def _gradmon_logger(steps: list[dict[str, object]]) -> MetricsLogger:
    logger = MetricsLogger()
    for step in steps:
        log_step_metrics(logger, KEY, step)
    return logger


STEPS = [
    {"a": 1.5, "b": float("nan"), "c": 3, "d": np.float64(2.25), "e": torch.tensor(4.0), "f": float("inf")},
    {"a": -0.5, "b": 7.0, "c": 4, "d": np.float64(float("nan")), "e": torch.tensor(5.0), "f": 1.0},
]


@pytest.mark.parametrize("upto", [1, 2])
def test_reduces_like_rllibs_mean_stats(upto: int) -> None:
    steps = STEPS[:upto]
    stock = _stock_logger(steps).reduce(compile=True)[KEY]
    ours = _gradmon_logger(steps).reduce(compile=True)[KEY]
    assert stock.keys() == ours.keys()
    for name in stock:
        assert _same(ours[name], stock[name]), name


def test_merge_of_two_learners_matches_stock_rllib() -> None:
    # The driver's root logger merges the learners' reduced stats: the mean of their values.
    per_learner = [{"a": 1.0, "b": float("nan"), "rank0_only": 9.0}, {"a": 3.0, "b": 2.0}]
    results = {}
    for make in (_stock_logger, _gradmon_logger):
        root = MetricsLogger(root=True)
        root.aggregate([make([s]).reduce() for s in per_learner], key="learners")
        results[make.__name__] = root.reduce(compile=True)["learners"][KEY]
    stock, ours = results["_stock_logger"], results["_gradmon_logger"]
    assert stock == pytest.approx({"a": 2.0, "b": 2.0, "rank0_only": 9.0})
    assert set(ours) == set(stock)
    for name in stock:
        assert _same(ours[name], stock[name]), name


def test_fast_path_only_for_a_single_python_float() -> None:
    stats = GradmonMeanStats(window=1)
    stats.push(2.5)
    assert stats.window_reduce() == [2.5]
    stats.push(float("nan"))  # window 1: the newest value replaces the old one
    assert math.isnan(stats.window_reduce()[0])
    assert GradmonMeanStats().window_reduce([1.0, 4.0, float("nan")]) == [2.5]  # RLlib's nanmean path


def test_logger_rebuilt_by_rllib_gets_the_class_back() -> None:
    logger = MetricsLogger()  # RLlib's Learner._reset makes a fresh one from the config's lookup
    assert GRADMON_REDUCE not in logger.stats_cls_lookup
    log_step_metrics(logger, KEY, {"a": 1.0})
    assert logger.stats_cls_lookup[GRADMON_REDUCE] is GradmonMeanStats
    assert DEFAULT_STATS_CLS_LOOKUP.get(GRADMON_REDUCE) is None  # RLlib's module-level default untouched
    assert isinstance(logger.stats[KEY]["a"], GradmonMeanStats)


def test_checkpointed_state_restores_as_plain_mean_stats() -> None:
    logger = _gradmon_logger([{"a": 1.25}])
    restored = MetricsLogger()  # no gradmon lookup: e.g. a driver restoring an Algorithm checkpoint
    restored.set_state(logger.get_state())
    stats = restored.stats[KEY]["a"]
    assert type(stats) is MeanStats
    assert restored.reduce(compile=True)[KEY]["a"] == 1.25


@pytest.mark.parametrize("compile", [True, False])
def test_step_by_step_like_a_learner_matches_stock_rllib(compile: bool) -> None:
    """The learner's real pattern: log a step, reduce, log the next step into the SAME Stats
    objects (``log_step_metrics``'s direct push), reduce again.  A stale value left in the
    window, a push into the wrong key or a reduce that does not empty the window shows up as a
    difference from stock RLlib at some step."""
    steps = [*STEPS, {"a": 8.0, "b": 9.0, "c": 5, "d": np.float64(1.0), "e": torch.tensor(6.0), "f": -2.0}]
    stock, ours = MetricsLogger(), MetricsLogger()
    for step in steps:
        for name, value in step.items():
            stock.log_value((KEY, name), value, window=1)
        log_step_metrics(ours, KEY, step)
        got, want = ours.reduce(compile=compile)[KEY], stock.reduce(compile=compile)[KEY]
        assert got.keys() == want.keys()
        for name in want:
            g, w = (got[name], want[name]) if compile else (got[name].peek(), want[name].peek())
            assert _same(g, w), (name, g, w)
            assert _same(g, float(step[name])), (name, g, step[name])
    assert len(ours.stats[KEY]["a"]) == 0  # the window was emptied by the last reduce


def test_logging_continues_into_a_restored_logger() -> None:
    """After RLlib restores a logger from a checkpoint (plain ``MeanStats``), later steps still
    land in it: through ``log_value``, not the fast push, and with the new values."""
    restored = MetricsLogger()
    restored.set_state(_gradmon_logger([{"a": 1.25, "b": 2.0}]).get_state())
    restored.reduce()
    log_step_metrics(restored, KEY, {"a": 3.5, "b": float("nan")})
    out = restored.reduce(compile=True)[KEY]
    assert out["a"] == 3.5 and math.isnan(out["b"])
    assert type(restored.stats[KEY]["a"]) is MeanStats


def test_reduced_copy_is_what_rllibs_clone_builds() -> None:
    """The reduce fast path copies a leaf's attributes instead of calling ``clone()``: it must
    hold exactly the attributes RLlib's clone sets, with the same settings, fresh timers and the
    value.  A new attribute in a later RLlib (a mutable one would be shared by the copy) fails here."""
    stats = GradmonMeanStats(window=1)
    stats.push(2.5)
    stats._start_times["t"] = 1.0  # must not leak into the reduced copy
    reference = stats.clone()
    reduced = stats.reduce(compile=False)
    assert type(reduced) is GradmonMeanStats and reduced is not stats
    assert set(vars(reduced)) == set(vars(reference))
    for name, value in vars(reference).items():
        if name == "values":
            assert list(reduced.values) == [2.5] and list(value) == []
        else:
            assert getattr(reduced, name) == value, name
    assert reduced._start_times is not stats._start_times
    assert len(stats.values) == 0


def _log_everything(logger: MetricsLogger, step: int) -> None:
    """What a learner's logger holds: RLlib's own reduce kinds at two nesting depths, gradmon's values."""
    logger.log_value(("default_policy", "policy_loss"), torch.tensor(0.5 + step), window=1)
    logger.log_value(("default_policy", "curr_kl_coeff"), 0.2 * step, reduce="item")
    logger.log_value(("__all_modules__", "num_env_steps_trained"), 100 + step, reduce="sum")
    logger.log_value(("__all_modules__", "lifetime"), 7, reduce="lifetime_sum")
    logger.log_value(("__all_modules__", "timers", "update"), 0.01 * (step + 1), reduce="ema")
    logger.log_value(("__all_modules__", "timers", "peak"), float(step), reduce="max")
    logger.log_value(("__all_modules__", "timers", "low"), float(-step), reduce="min")
    logger.log_value("top_level", 3.0 + step, window=3)
    log_step_metrics(logger, "default_policy", {"grad/global_norm": 1.5 * step, "latch/nan/op": float("nan")})
