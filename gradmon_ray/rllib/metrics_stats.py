"""How gradmon's metrics ride RLlib's ``MetricsLogger``: a ``mean`` Stats that reduces one float cheaply.

gradmon logs ~70 values per telemetry step (more with many heads), each already the step's
aggregate (``window=1``).  RLlib's ``MeanStats`` reduces every one of them with
``np.nanmean`` on every ``MetricsLogger.reduce()``, about 20 us per value on this project's CPU
(1.9 ms per update for 80 values, ``bench/telemetry_overhead.py``'s default model spends ~200
ms per update): a visible share of the telemetry's own cost.  ``GradmonMeanStats`` is
``MeanStats`` with a fast path for the one case gradmon produces (a single Python float in the
window), same result (NaN stays NaN), and RLlib's code path for everything else (several
values when the driver merges learners, tensors, numpy scalars).

It is registered under its own reduce name through RLlib's documented extension point
(``MetricsLogger.stats_cls_lookup``, which ``AlgorithmConfig.logging(custom_stats_cls_lookup=)``
also sets) and keeps ``stats_cls_identifier = "mean"``: a checkpointed ``MetricsLogger``
state restores as a plain ``MeanStats`` anywhere, with or without gradmon's lookup.

Values that only go up during a run (``MAX_REDUCED``: latches, the iterations they fired at, the
telemetry clock, the skipped-update total, the probe counters) go into ``GradmonMaxStats``
(``MaxStats``, ``stats_cls_identifier = "max"``) instead: where the driver merges several
telemetry steps into one result (APPO/IMPALA run many per ``train()``), RLlib's mean would
average them (a latch set in 1 step of 4 read 0.25, the clock 10.5); their max is exactly the
last step's value.  With one step per iteration (PPO) the max of one value is that value.

The learner's ``MetricsLogger`` itself is RLlib's, untouched: an earlier version swapped its
class for a cheaper ``reduce()`` walk, which saved ~0.2 ms per update (132 vs 344 us) against
~200 ms per update, far below the benchmark's own A/A noise (1-2.6%), so it was dropped.
"""

from __future__ import annotations

from typing import Any

from ray.rllib.utils.metrics.metrics_logger import MetricsLogger
from ray.rllib.utils.metrics.stats.max import MaxStats
from ray.rllib.utils.metrics.stats.mean import MeanStats

from gradmon_ray import compat
from gradmon_ray import metric_names as mn
from gradmon_ray import metric_parsing as mp

GRADMON_REDUCE = "gradmon_mean"
"""The ``reduce=`` name gradmon's metrics are logged with (``GradmonMeanStats``)."""
GRADMON_MAX_REDUCE = "gradmon_max"
"""The ``reduce=`` name of the ``MAX_REDUCED`` metrics (``GradmonMaxStats``)."""
MAX_REDUCED: frozenset[str] = frozenset(
    (
        mn.HEAD_NAN_LATCH,
        mn.HEAD_INF_LATCH,
        mn.HEAD_NAN_LATCH_FIRST_ITERATION,
        mn.HEAD_INF_LATCH_FIRST_ITERATION,
        mn.HEAD_COLLAPSE_LATCH,
        mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION,
        mn.SKIPPED_UPDATES_TOTAL,
        mn.TELEMETRY_ITERATION,
        *mn.PROBE_COUNTERS,
    )
)
"""Templates and names whose values never go down in a run: merged by their max, not their mean."""


class _OneFloatReduce:
    """An O(1) reduce of a window holding one Python float (mixed into a ``SeriesStats``)."""

    values: Any
    is_leaf: bool

    def window_reduce(self, values: Any = None) -> list[Any]:
        values = self.values if values is None else values
        if len(values) == 1:
            (value,) = values
            if type(value) is float:  # exactly float: not a tensor, not a numpy scalar
                return [value]  # nanmean / nanmax of one value is that value (NaN included)
        return super().window_reduce(values)

    def reduce(self, compile: bool = True) -> Any:
        values = self.values
        if not self.is_leaf or len(values) != 1 or type(values[0]) is not float:
            return super().reduce(compile)
        # MeanStats.reduce (SeriesStats.reduce with a window) for one float on a learner's logger,
        # without its window_reduce call and new container.
        value = values[0]
        values.clear()  # what MeanStats.reduce's _set_values([]) leaves: an empty window
        if compile:
            return value
        # What ``self.clone()`` builds (same settings, fresh timers) holding the value; a leaf's
        # attributes are all settings, so a copy of them is that clone for a third of the cost
        # (tests/rllib/test_metrics_stats.py compares the two attribute by attribute).
        reduced = compat.copy_stats(self)
        reduced.values = [value]
        return reduced


class GradmonMeanStats(_OneFloatReduce, MeanStats):
    """``MeanStats`` with an O(1) reduce of a window holding one Python float."""


class GradmonMaxStats(_OneFloatReduce, MaxStats):
    """``MaxStats`` with the same O(1) reduce (the max of one value is that value, NaN included)."""


_STATS_OF_REDUCE = {GRADMON_REDUCE: GradmonMeanStats, GRADMON_MAX_REDUCE: GradmonMaxStats}
_reduce_of_name: dict[str, str] = {}  # names repeat every step: parse each once


def reduce_of(name: str) -> str:
    """``GRADMON_MAX_REDUCE`` for a ``MAX_REDUCED`` metric (a template filled with a head, or a
    plain name), else ``GRADMON_REDUCE``."""
    reduce = _reduce_of_name.get(name)
    if reduce is None:
        parsed = mp.parse(name)
        template = parsed.template if parsed is not None else name
        reduce = GRADMON_MAX_REDUCE if template in MAX_REDUCED or name in MAX_REDUCED else GRADMON_REDUCE
        _reduce_of_name[name] = reduce
    return reduce


def log_step_metrics(metrics_logger: MetricsLogger, key: str, metrics: dict[str, float]) -> None:
    """Log one telemetry step's values under ``key`` (``window=1``: each is the step's aggregate).

    Registers ``GradmonMeanStats`` and ``GradmonMaxStats`` on the logger first: RLlib rebuilds a
    learner's logger in ``Learner._reset`` (from the config's lookup), so this is checked every
    step, a dict lookup.  Each name is reduced by ``reduce_of(name)``.  From the second step on, a
    value goes straight into its Stats (a ``push``, what ``log_value`` ends with, minus ~2 us of
    key handling per value); a key the logger does not hold as gradmon's class (the first step, a
    logger RLlib restored from a checkpoint as plain ``MeanStats``/``MaxStats``) goes through
    ``log_value``.
    """
    lookup = metrics_logger.stats_cls_lookup
    if any(lookup.get(reduce) is not cls for reduce, cls in _STATS_OF_REDUCE.items()):
        metrics_logger.stats_cls_lookup = {**lookup, **_STATS_OF_REDUCE}
    logged = metrics_logger.stats.get(key)  # RLlib's nested dict: stats[key][name] for key (key, name)
    if not isinstance(logged, dict):
        logged = {}
    for name, value in metrics.items():
        stats = logged.get(name)
        if type(stats) in (GradmonMeanStats, GradmonMaxStats):  # the class was chosen by reduce_of on the first step
            stats.push(value)
        else:
            metrics_logger.log_value((key, name), value, reduce=reduce_of(name), window=1)
