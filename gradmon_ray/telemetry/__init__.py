"""Pure-PyTorch telemetry formulas: no Ray, no MLflow, no host synchronisation on hot paths."""

from gradmon_ray.telemetry.accumulator import IterationAccumulator
from gradmon_ray.telemetry.bands import (
    ACTION_BANDS,
    HEALTH_BANDS,
    VALUE_BANDS,
    BandSet,
    HealthBands,
    classify_grad_norm,
    worst_head,
)
from gradmon_ray.telemetry.buckets import bucket_names, group_reward_stds, split_into_buckets
from gradmon_ray.telemetry.head_norms import HeadPart, ParamRows, per_head_grad_norms
from gradmon_ray.telemetry.lane_layout import TelemetryLayout
from gradmon_ray.telemetry.latches import HeadLatches, logp_nonfinite_flags, logp_sums
from gradmon_ray.telemetry.noise_scale import NoiseScaleTracker, gradient_noise_terms
from gradmon_ray.telemetry.norm_plan import GradientNormPlan, GradientNorms
from gradmon_ray.telemetry.shares import cosine_similarities, signed_shares
from gradmon_ray.telemetry.tracker import IterationTelemetry, TelemetryTracker
from gradmon_ray.telemetry.trends import coefficient_of_variation, trend_arrow

__all__ = [
    "ACTION_BANDS",
    "HEALTH_BANDS",
    "VALUE_BANDS",
    "BandSet",
    "GradientNormPlan",
    "GradientNorms",
    "HeadLatches",
    "HeadPart",
    "HealthBands",
    "IterationAccumulator",
    "IterationTelemetry",
    "NoiseScaleTracker",
    "ParamRows",
    "TelemetryLayout",
    "TelemetryTracker",
    "bucket_names",
    "classify_grad_norm",
    "coefficient_of_variation",
    "cosine_similarities",
    "gradient_noise_terms",
    "group_reward_stds",
    "logp_nonfinite_flags",
    "logp_sums",
    "per_head_grad_norms",
    "signed_shares",
    "split_into_buckets",
    "trend_arrow",
    "worst_head",
]
