"""Turn RLlib's per-iteration result dict into gradmon's flat, named metrics."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray import metric_parsing as mp
from gradmon_ray.telemetry import bands as _bands
from gradmon_ray.telemetry.bands import worst_head
from gradmon_ray.tracking.diagnosis_tags import skipped_summary

ALL_MODULES = "__all_modules__"
"""RLlib's key for the learners' results over all modules (``ray.rllib.core.ALL_MODULES``)."""

DEFAULT_MODULE_ID = "default_policy"
VALUE_HEAD = mn.VALUE_HEAD
"""gradmon's own modules' value head's reported name (value heads are always last: ``order_heads``)."""

_GRADMON_PREFIXES = ("grad/", "policy/", "latch/", "update/", "vgs/", "probe/", "diagnosis/")
# RLlib result paths -> gradmon names (the training-progress rows of docs/metrics.md).
_RLLIB_PATHS: dict[str, tuple[str, ...]] = {
    mn.EPISODE_RETURN_MEAN: ("env_runners", "episode_return_mean"),
    mn.EPISODE_LEN_MEAN: ("env_runners", "episode_len_mean"),
    mn.ENV_STEPS_SAMPLED_LIFETIME: ("env_runners", "num_env_steps_sampled_lifetime"),
    mn.POLICY_LOSS: ("learners", "{module}", "policy_loss"),
    mn.VF_LOSS: ("learners", "{module}", "vf_loss"),
    mn.ENTROPY: ("learners", "{module}", "entropy"),
    mn.MEAN_KL: ("learners", "{module}", "mean_kl_loss"),
    mn.TOTAL_LOSS: ("learners", "{module}", "total_loss"),
    mn.VF_EXPLAINED_VAR: ("learners", "{module}", "vf_explained_var"),
    mn.ITERATION_TIME_S: ("time_this_iter_s",),
    mn.ENV_RUNNERS_HEALTHY: ("fault_tolerance", "num_healthy_workers"),
    mn.ENV_RUNNER_RESTARTS: ("fault_tolerance", "num_remote_worker_restarts"),
}


def _lookup(result: Mapping[str, Any], path: tuple[str, ...], module_id: str) -> Any:
    node: Any = result
    for part in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(part.format(module=module_id))
    return node


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def learners_updated(result: Mapping[str, Any]) -> bool:
    """Whether the learners trained in this iteration.

    False when they had no batch, e.g. while the only EnvRunner is down and being restarted:
    RLlib then still returns a result, with NaN in every learner metric (empty windows).
    """
    trained = _as_float(_lookup(result, ("learners", ALL_MODULES, "num_env_steps_trained"), ""))
    return trained is not None and math.isfinite(trained) and trained > 0


def monitored_modules(result: Mapping[str, Any]) -> list[str]:
    """The module ids under ``result["learners"]`` that carry gradmon telemetry, in RLlib's order."""
    learners = result.get("learners")
    if not isinstance(learners, Mapping):
        return []
    return [
        mid
        for mid, values in learners.items()
        if mid != ALL_MODULES
        and isinstance(values, Mapping)
        and any(isinstance(k, str) and k.startswith(_GRADMON_PREFIXES) for k in values)
    ]


def result_to_metrics(result: Mapping[str, Any], module_id: str | None = None) -> dict[str, float]:
    """Gradmon's telemetry (as the learner logged it) plus the progress metrics, as floats.

    ``module_id`` None: every module with gradmon telemetry; one such module keeps the plain
    names, several get ``module/<id>/<name>`` for everything per module (``MODULE_METRIC``).
    A progress metric RLlib did not report this iteration (e.g. no episode finished yet) is
    left out rather than invented; so is every learner metric of an iteration in which the
    learners did not train (``update/trained`` is then 0).
    """
    updated = learners_updated(result)
    out: dict[str, float] = {mn.LEARNERS_UPDATED: float(updated)}
    modules = [module_id] if module_id is not None else monitored_modules(result) or [DEFAULT_MODULE_ID]
    prefixed = len(modules) > 1
    for mid in modules:
        out.update(_module_metrics(result, mid, updated, mid if prefixed else None))
    out.update(_learner_wide_metrics(result))
    for name, path in _RLLIB_PATHS.items():
        if path[0] == "learners":
            continue
        number = _as_float(_lookup(result, path, ""))
        if number is not None and not (name == mn.EPISODE_RETURN_MEAN and math.isnan(number)):
            out[name] = number
    return out


def _module_metrics(result: Mapping[str, Any], module_id: str, updated: bool, prefix: str | None) -> dict[str, float]:
    """One module's gradmon telemetry and losses (named for ``prefix``'s module, or plain)."""
    out: dict[str, float] = {}
    if not updated:
        return out
    learner = _lookup(result, ("learners", "{module}"), module_id) or {}
    for key, value in learner.items():
        if isinstance(key, str) and key.startswith(_GRADMON_PREFIXES):
            number = _as_float(value)
            if number is None or (math.isnan(number) and _absent_when_undefined(key)):
                continue  # RLlib's NaN for a metric the learner left out this iteration
            out[mn.module_metric(prefix, key)] = number
    for name, path in _RLLIB_PATHS.items():
        if path[0] == "learners":
            number = _as_float(_lookup(result, path, module_id))
            if number is not None:
                out[mn.module_metric(prefix, name)] = number
    return out


def _learner_wide_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """The probe counters, which the learner logs once under RLlib's ``ALL_MODULES`` (not per
    module), under their plain names in every run; RLlib's NaN (not logged this iteration) left out."""
    learners = _lookup(result, ("learners", ALL_MODULES), "")
    if not isinstance(learners, Mapping):
        return {}
    numbers = {name: _as_float(learners.get(name)) for name in mn.PROBE_COUNTERS}
    return {name: n for name, n in numbers.items() if n is not None and not math.isnan(n)}


def order_heads(
    heads: Iterable[str], order: Sequence[str] | None = None, value_heads: Collection[str] = ()
) -> list[str]:
    """``heads`` in gradmon's head order: action heads, then the value heads; never in the input's order.

    Heads named in ``order`` (the action-space order: a ``Dict`` space's sorted keys, a
    ``MultiDiscrete``'s ``model.head_names``; what ``resolve_heads`` gives and the
    ``gradmon.head_names`` tag holds) come first, in that order; any other action heads
    follow, sorted (``a2`` before ``a10``); value heads (``metric_names.is_value_head`` with the run's
    declared ``value_heads``) are always last.  Without ``order`` that is: sorted action heads, then
    the value heads.  With module labels
    (``p1/op``) each module's heads stay together, modules in first-seen order of ``order``,
    then sorted.  Duplicates are dropped.
    """
    present = list(dict.fromkeys(heads))
    rank = {h: i for i, h in enumerate(dict.fromkeys(order or ()))}
    module_rank: dict[str | None, int] = {}
    for h in rank:
        module_rank.setdefault(mn.split_head_label(h)[0], len(module_rank))
    for module in sorted({mn.split_head_label(h)[0] or "" for h in present}):
        module_rank.setdefault(module or None, len(module_rank))

    def key(head: str) -> tuple[int, int, int, list[Any]]:
        module = mn.split_head_label(head)[0]
        value = mn.is_value_head(head, value_heads)
        return (module_rank[module], int(value), rank.get(head, len(rank)) if not value else 0, _natural(head))

    return sorted(present, key=key)


def _natural(text: str) -> list[Any]:
    """Sort key that orders ``a2`` before ``a10`` (digit runs compare as numbers)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part]


def heads_in(
    metrics: Mapping[str, float], order: Sequence[str] | None = None, value_heads: Collection[str] = ()
) -> list[str]:
    """Head names that have a ``grad/head/<head>/norm`` entry, in ``order_heads(..., order, value_heads)``'s order.

    Never in the metrics' key order: RLlib's ``MetricsLogger.aggregate`` merges the learners'
    results through a ``set`` of key paths, so that order changes from process to process.
    """
    return order_heads(mp.heads_of(metrics, mn.HEAD_GRAD_NORM), order, value_heads)


def latched_heads(metrics: Mapping[str, float], kind: str) -> list[str]:
    """Heads whose ``kind`` ("nan" or "inf") latch metric is 1."""
    template = mn.HEAD_NAN_LATCH if kind == "nan" else mn.HEAD_INF_LATCH
    return mp.heads_of((key for key, value in metrics.items() if value > 0), template)


def _absent_when_undefined(key: str) -> bool:
    parsed = mp.parse(key)
    return parsed is not None and parsed.template in mn.ABSENT_WHEN_UNDEFINED


def progress_line(
    iteration: int,
    total: int,
    metrics: Mapping[str, float],
    *,
    bands: _bands.BandSet | None = None,
    include_value_head: bool = False,
    value_heads: Collection[str] = (),
) -> str:
    """One human line per iteration: steps, return, worst head and its band, latched heads.

    The worst head is the worst action head (``worst_head``, by ``bands.action``, default
    ``BandSet()``); with ``include_value_head`` the value heads compete too, judged by
    ``bands.value``.  Value heads: ``value``, ``vf``, ``bands.value_heads`` and ``value_heads``
    (the run's declared ones, ``run_value_heads``).
    """
    bands = (bands or _bands.DEFAULT_BANDS).with_value_heads(value_heads)
    steps = metrics.get(mn.ENV_STEPS_SAMPLED_LIFETIME)
    ret = metrics.get(mn.EPISODE_RETURN_MEAN)
    parts = [
        f"iter {iteration}/{total}",
        f"env steps {int(steps)}" if steps is not None else "env steps ?",
        f"return {ret:.3f}" if ret is not None else "return n/a",
    ]
    heads = heads_in(metrics, value_heads=bands.value_heads)
    skipped = skipped_summary(metrics)
    if metrics.get(mn.LEARNERS_UPDATED) == 0.0:
        healthy = metrics.get(mn.ENV_RUNNERS_HEALTHY)
        parts.append(
            "no update: nothing to train on" + (f" ({int(healthy)} EnvRunners healthy)" if healthy is not None else "")
        )
    elif skipped is not None and skipped.endswith("did not train"):  # every norm is NaN: no worst head to name
        parts.append(skipped)
    elif heads:
        judged = [h for h in heads if include_value_head or not bands.is_value_head(h)] or heads
        norms = {h: metrics[mn.head_metric(mn.HEAD_GRAD_NORM, h)] for h in judged}
        worst, band = worst_head(norms, bands=bands)
        parts.append(f"worst head {worst} {norms[worst]:.3f} ({band})")
        if skipped is not None:
            parts.append(skipped)
    else:
        parts.append("telemetry off")
    latched = sorted(set(latched_heads(metrics, "nan")) | set(latched_heads(metrics, "inf")))
    parts.append("latched: " + (", ".join(latched) if latched else "none"))
    return " | ".join(parts)


def latch_tags(
    metrics: dict[str, float], heads_named: bool, head_order: Sequence[str] = (), value_heads: Collection[str] = ()
) -> dict[str, str]:
    """The head-names and value-heads tags (once: while not ``heads_named``) and the latched-heads
    tags, in ``head_order``.

    Heads missing from ``head_order`` follow it sorted, value heads last (``order_heads``): never
    in the metrics' key order.  ``value_heads``: the run's declared value heads besides ``value``
    and ``vf`` (``run_value_heads``); when there are any, ``gradmon.value_heads`` lists every
    reported value head.
    """
    heads = heads_in(metrics, head_order, value_heads)
    tags = {}
    if heads and not heads_named:
        tags[mn.TAG_HEAD_NAMES] = ",".join(heads)
        if value_heads:  # none declared: no tag, and readers take value and vf, as the learner did
            tags[mn.TAG_VALUE_HEADS] = mn.format_value_heads(mn.value_heads_among(heads, value_heads))
    for kind, tag in (("nan", mn.TAG_NAN_LATCHED_HEADS), ("inf", mn.TAG_INF_LATCHED_HEADS)):
        heads = order_heads(latched_heads(metrics, kind), head_order, value_heads)
        if heads:
            tags[tag] = ",".join(heads)
    return tags


def run_value_heads(algorithm: Any, module_id: str | None = None) -> tuple[str, ...]:
    """The value heads an algorithm's module(s) declare besides ``value`` and ``vf``, for
    ``latch_tags``: each module's own ``value_heads`` attribute, then ``learner_config_dict["gradmon"]``'s
    ``value_heads`` (a ``per_module`` entry's replacing the top level's), as the learner reads them
    (``rllib.heads.declared_value_heads``, ``GradmonSettings.for_module``; the learner refuses bad
    ones, so nothing is checked here).

    ``module_id`` None: every policy, each head as ``<module>/<head>`` when there are several.
    Duck-typed (tracking imports nothing from ``gradmon_ray.rllib``): a module the driver cannot
    reach declares nothing.
    """
    policies = [module_id] if module_id is not None else list(getattr(algorithm.config, "policies", None) or [])
    policies = [str(p) for p in policies] or [DEFAULT_MODULE_ID]
    entry = (getattr(algorithm.config, "learner_config_dict", None) or {}).get("gradmon") or {}
    out: list[str] = []
    for mid in policies:
        try:
            own = tuple(getattr(algorithm.get_module(mid), "value_heads", None) or ())
        except Exception:  # no module on the driver (e.g. remote EnvRunners only)
            own = ()
        per_module = (entry.get("per_module") or {}).get(mid) or {}
        given = per_module["value_heads"] if per_module.get("value_heads") is not None else entry.get("value_heads")
        prefix = mid if module_id is None and len(policies) > 1 else None
        out += [mn.head_label(prefix, h) for h in dict.fromkeys((*own, *(given or ())))]
    return tuple(out)
