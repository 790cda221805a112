"""Pure-PyTorch telemetry formulas: no Ray, no MLflow, no host synchronisation on hot paths."""

from gradmon_ray.telemetry.accumulator import IterationAccumulator, TelemetryLayout
from gradmon_ray.telemetry.head_norms import (
    HEALTH_BANDS,
    GradientNormPlan,
    GradientNorms,
    classify_grad_norm,
    coefficient_of_variation,
    per_head_grad_norms,
    trend_arrow,
    worst_head,
)
from gradmon_ray.telemetry.latches import HeadLatches, logp_nonfinite_flags
from gradmon_ray.telemetry.noise_scale import NoiseScaleTracker, gradient_noise_terms
from gradmon_ray.telemetry.summary import IterationTelemetry, TelemetryTracker
from gradmon_ray.telemetry.vgs import VarianceGradientScaler

__all__ = [
    "HEALTH_BANDS",
    "GradientNormPlan",
    "GradientNorms",
    "HeadLatches",
    "IterationAccumulator",
    "IterationTelemetry",
    "NoiseScaleTracker",
    "TelemetryLayout",
    "TelemetryTracker",
    "VarianceGradientScaler",
    "classify_grad_norm",
    "coefficient_of_variation",
    "gradient_noise_terms",
    "logp_nonfinite_flags",
    "per_head_grad_norms",
    "trend_arrow",
    "worst_head",
]
