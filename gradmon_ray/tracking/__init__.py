"""Where telemetry goes: the asynchronous MLflow sink, its spill file, RLlib-result flattening, and
``GradmonMLflowCallback`` (an RLlib callback streaming a user's own algorithm through the same sink).

Exports are resolved lazily (PEP 562) so that the CLI can import ``tracking.spill`` without
pulling in torch through ``results``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CallbackSettings": "gradmon_ray.tracking.callback",
    "GradmonMLflowCallback": "gradmon_ray.tracking.callback",
    "MlflowSink": "gradmon_ray.tracking.mlflow_sink",
    "heads_in": "gradmon_ray.tracking.result_metrics",
    "latched_heads": "gradmon_ray.tracking.result_metrics",
    "progress_line": "gradmon_ray.tracking.result_metrics",
    "result_to_metrics": "gradmon_ray.tracking.result_metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
