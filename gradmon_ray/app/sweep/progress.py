"""What ``gradmon-ray tune`` prints while a sweep runs, and what it names each trial's MLflow run.

Pure formatting (no Ray): the Tune callback that prints these lines as results arrive is
``sweep.run.TrialProgress``.  Every measured number is printed at 4 significant digits
(``fmt4``); counts (iterations) as integers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.bands import DEFAULT_BANDS, BandSet, worst_head
from gradmon_ray.tracking.redact import short
from gradmon_ray.tracking.result_metrics import heads_in, latched_heads

MAX_RUN_NAME_LEN = 200
"""MLflow keeps run names in a 250-character column; a long search space is cut here, with ``...``."""


def fmt4(value: Any) -> str:
    """``value`` at 4 significant digits (``0.0003162``, ``-0.7812``, ``1.235e+04``); ``n/a`` when it is
    None, NaN or not a number."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "n/a"
    return "n/a" if math.isnan(number) else f"{number:.4g}"


def worst_of(
    metrics: Mapping[str, Any], bands: BandSet = DEFAULT_BANDS, *, include_value_head: bool = False
) -> tuple[str, float, str] | None:
    """The worst head of one iteration's metrics: ``(head, gradient norm, band)``; None without telemetry.

    As ``gradmon-ray train``'s progress line judges it: the action heads by ``bands.action``
    (``worst_head``), the value heads (``bands.is_value_head``) too with ``include_value_head``.
    """
    heads = heads_in({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, value_heads=bands.value_heads)
    if not heads:
        return None
    judged = [h for h in heads if include_value_head or not bands.is_value_head(h)] or heads
    norms = {h: float(metrics[mn.head_metric(mn.HEAD_GRAD_NORM, h)]) for h in judged}
    head, band = worst_head(norms, bands=bands)
    return head, norms[head], band


def trial_progress_line(
    trial_id: str,
    iteration: int,
    total: int,
    metrics: Mapping[str, Any],
    *,
    bands: BandSet = DEFAULT_BANDS,
    include_value_head: bool = False,
    stop_reason: str | None = None,
) -> str:
    """One line per trial iteration: ``trial <id> | iter i/N | return R | worst head H NORM (band)``.

    ``metrics``: what the trial reported to Tune for that iteration (``result_to_metrics``' names);
    an iteration in which the learners did not train says so instead of naming a head; latched
    heads and a health rule's stop are appended when there are any.
    """
    parts = [f"trial {trial_id}", f"iter {iteration}/{total}", f"return {fmt4(metrics.get(mn.EPISODE_RETURN_MEAN))}"]
    worst = worst_of(metrics, bands, include_value_head=include_value_head)
    if metrics.get(mn.LEARNERS_UPDATED) == 0.0:
        parts.append("no update: nothing to train on")
    elif worst is not None:
        head, norm, band = worst
        parts.append(f"worst head {head} {fmt4(norm)} ({band})")
    else:
        parts.append("telemetry off")
    numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    latched = sorted(set(latched_heads(numeric, "nan")) | set(latched_heads(numeric, "inf")))
    if latched:
        parts.append("latched: " + ", ".join(latched))
    if stop_reason:
        parts.append(f"stopped: {stop_reason}")
    return " | ".join(parts)


def trial_summary_line(
    trial_id: str,
    status: str,
    iterations: int,
    metric: str,
    value: Any,
    *,
    run_id: str | None = None,
    stop_reason: str | None = None,
) -> str:
    """The sweep's closing line for one trial: status, iterations, its ranking metric, its MLflow run."""
    line = f"trial {trial_id} {status} | {iterations} iterations | {metric} {fmt4(value)}"
    if run_id:
        line += f" | MLflow run {run_id}"
    return line + (f" | stopped: {stop_reason}" if stop_reason else "")


def _short(value: Any) -> str:
    if isinstance(value, float):
        return fmt4(value)
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)
    return str(value)


def trial_run_name(sweep_name: str, trial_id: str, sampled: Mapping[str, Any]) -> str:
    """A sweep trial's MLflow run name: ``<sweep>-<trial id>``, then the values it was given.

    E.g. ``vgs_sweep-3f2a1_00002 (ppo.lr=0.0003162, vgs.alpha=0.1)``: distinct (Tune's trial ids
    are unique) and readable in MLflow's run list without opening the run.  Floats at 4 significant
    digits; at most ``MAX_RUN_NAME_LEN`` characters.
    """
    name = f"{sweep_name}-{trial_id}"
    if sampled:
        name += " (" + ", ".join(f"{k}={_short(v)}" for k, v in sorted(sampled.items())) + ")"
    return short(name, MAX_RUN_NAME_LEN)  # masked, then cut: a sampled URI's password never shows


def trial_count(search_space: Mapping[str, Any], num_samples: int) -> int:
    """How many trials Tune runs: ``num_samples`` times the product of the grid sizes."""
    grid = 1
    for spec in search_space.values():
        if isinstance(spec, dict) and "grid" in spec:
            grid *= len(spec["grid"])
    return num_samples * grid
