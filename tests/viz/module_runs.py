"""Hand-made MLflow runs for the display tests: per-head norms (``head_label``s, so a multi-module
run is ``p1/op``, ``p2/op``), latches, per-module scalars and params, logged as the learner and
``gradmon-ray train`` name them, every value chosen so each cell has a hand-written answer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn


def log_run(
    client: MlflowClient,
    experiment: str,
    norms: Mapping[str, Sequence[float]],
    *,
    tag: Sequence[str] | None = None,
    trends: Mapping[str, float] | None = None,
    latches: Mapping[str, tuple[float, float]] | None = None,
    entropy: Mapping[str, float] | None = None,
    module_scalars: Mapping[str, Sequence[float]] | None = None,
    params: Mapping[str, str] | None = None,
    value_heads: Sequence[str] = (),
) -> str:
    """A finished run; returns its id.

    ``norms``: each head's norm per iteration (steps 1, 2, ...), no health code (the display
    judges the norm itself); ``tag``: the ``gradmon.head_names`` tag (default: ``norms``' order);
    ``trends``: the last iteration's trend code per head; ``latches``: ``(nan, inf)`` per head,
    logged at every step (a head not named gets no latch metric, as the value head);
    ``entropy``: the last normalised entropy per head (and a clear collapse latch);
    ``module_scalars``: full metric name (``module/<id>/update/skipped_total`` or plain) -> values;
    ``value_heads``: the ``gradmon.value_heads`` tag, as a run that declares value heads writes it
    (none: no tag, as a run without declared value heads or one written before the tag existed).
    """
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    run_id = client.create_run(exp_id, run_name=experiment).info.run_id
    metrics: list[Metric] = []

    def put(name: str, values: Sequence[float]) -> None:
        metrics.extend(Metric(name, float(v), 1000 + step, step) for step, v in enumerate(values, start=1))

    last = max(len(v) for v in norms.values())
    for head, values in norms.items():
        put(mn.head_metric(mn.HEAD_GRAD_NORM, head), values)
    for head, code in (trends or {}).items():
        metrics.append(Metric(mn.head_metric(mn.HEAD_GRAD_TREND, head), float(code), 2000, last))
    for head, (nan, inf) in (latches or {}).items():
        put(mn.head_metric(mn.HEAD_NAN_LATCH, head), [nan] * last)
        put(mn.head_metric(mn.HEAD_INF_LATCH, head), [inf] * last)
    for head, value in (entropy or {}).items():
        metrics.append(Metric(mn.head_metric(mn.HEAD_ENTROPY_NORM, head), value, 2000, last))
        metrics.append(Metric(mn.head_metric(mn.HEAD_COLLAPSE_LATCH, head), 0.0, 2000, last))
    for name, values in (module_scalars or {}).items():
        put(name, values)
    tags = [RunTag(mn.TAG_HEAD_NAMES, ",".join(tag if tag is not None else norms)), RunTag(mn.TAG_STATUS, "finished")]
    tags += [RunTag(mn.TAG_VALUE_HEADS, ",".join(value_heads))] if value_heads else []
    client.log_batch(run_id, metrics=metrics, params=[Param(k, v) for k, v in (params or {}).items()], tags=tags)
    client.set_terminated(run_id)
    return run_id
