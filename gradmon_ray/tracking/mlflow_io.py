"""How gradmon turns values into MLflow entities and writes them: one place for the live sink and replay.

The live ``MlflowSink`` and ``gradmon-ray replay`` both write through these functions, so a
metric replayed from a spill file reaches MLflow exactly as the sink would have written it
(+-Inf as the largest finite float, NaN as NaN) and in batches within MLflow's limits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from gradmon_ray.tracking.redact import redact_text

MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limits
MAX_PARAMS_PER_BATCH = 100
MAX_TAGS_PER_BATCH = 100

FLOAT_MAX = 1.7976931348623157e308


def mlflow_value(value: float) -> float:
    """The value gradmon hands MLflow: +-Inf become +-``FLOAT_MAX``, everything else (NaN too) as is.

    MLflow stores NaN natively but not Inf (its SQL stores clamp it, others differ): writing
    the largest float ourselves keeps an Inf visible, and the same on every backend.
    """
    value = float(value)
    if math.isinf(value):
        return math.copysign(FLOAT_MAX, value)
    return value


def to_mlflow_metrics(metrics: Mapping[str, float], step: int, timestamp_ms: int) -> list[Any]:
    """One iteration's metrics dict as MLflow ``Metric`` entities."""
    from mlflow.entities import Metric

    return [Metric(str(key), mlflow_value(value), int(timestamp_ms), int(step)) for key, value in metrics.items()]


def log_in_batches(
    client: Any,
    run_id: str,
    *,
    metrics: Iterable[Any] = (),
    params: Mapping[str, str] | None = None,
    tags: Mapping[str, str] | None = None,
) -> None:
    """Write metric entities, then params, then tags with ``log_batch`` in chunks MLflow accepts.

    Param and tag values go through ``redact_text``: whatever path they came by (the run config's
    ``mlflow.tracking_uri``, an error text in a tag), no credential is stored in MLflow.
    """
    from mlflow.entities import Param, RunTag

    metric_list = list(metrics)
    for i in range(0, len(metric_list), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metric_list[i : i + MAX_METRICS_PER_BATCH])
    param_list = [Param(str(k), redact_text(str(v))) for k, v in (params or {}).items()]
    for i in range(0, len(param_list), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=param_list[i : i + MAX_PARAMS_PER_BATCH])
    tag_list = [RunTag(str(k), redact_text(str(v))) for k, v in (tags or {}).items()]
    for i in range(0, len(tag_list), MAX_TAGS_PER_BATCH):
        client.log_batch(run_id, tags=tag_list[i : i + MAX_TAGS_PER_BATCH])
