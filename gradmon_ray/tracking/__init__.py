"""Where telemetry goes: the asynchronous MLflow sink and RLlib-result flattening."""

from gradmon_ray.tracking.mlflow_sink import MlflowSink
from gradmon_ray.tracking.results import heads_in, latched_heads, progress_line, result_to_metrics

__all__ = ["MlflowSink", "heads_in", "latched_heads", "progress_line", "result_to_metrics"]
