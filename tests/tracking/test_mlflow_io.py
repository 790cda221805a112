"""The one conversion from a metrics dict to MLflow entities, shared by the sink and replay."""

from __future__ import annotations

import math

from gradmon_ray.tracking.mlflow_io import FLOAT_MAX, MAX_METRICS_PER_BATCH, log_in_batches, to_mlflow_metrics


def test_to_mlflow_metrics_clamps_inf_keeps_nan_and_finite_values():
    metrics = to_mlflow_metrics({"a": math.inf, "b": -math.inf, "c": math.nan, "d": -2.5, "e": 3}, 7, 1234)
    assert [(m.key, m.step, m.timestamp) for m in metrics] == [(k, 7, 1234) for k in "abcde"]
    values = [m.value for m in metrics]
    assert values[:2] == [FLOAT_MAX, -FLOAT_MAX] and math.isnan(values[2]) and values[3:] == [-2.5, 3.0]
    assert isinstance(values[4], float)


class _Recorder:
    def __init__(self):
        self.calls = []

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        self.calls.append((run_id, len(metrics), len(params), len(tags)))


def test_log_in_batches_keeps_to_mlflow_limits_and_skips_empty_parts():
    client = _Recorder()
    metrics = to_mlflow_metrics({f"m{i}": float(i) for i in range(MAX_METRICS_PER_BATCH + 1)}, 1, 0)
    log_in_batches(client, "r", metrics=metrics, params={f"p{i}": i for i in range(101)}, tags={"t": "v"})
    assert client.calls == [("r", 1000, 0, 0), ("r", 1, 0, 0), ("r", 0, 100, 0), ("r", 0, 1, 0), ("r", 0, 0, 1)]
    empty = _Recorder()
    log_in_batches(empty, "r")
    assert empty.calls == []
