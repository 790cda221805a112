"""Host-side statistics of the per-iteration head norms: the trend arrow and the norms' CV.

Pure Python (no torch): both are functions of floats that the learner computes once per
iteration on the host, after the lanes are copied back (``telemetry.summary``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

TREND_DELTA = 0.01
"""A change of the norm larger than this (either way) is a trend; smaller is steady."""


def trend_arrow(prev: float, cur: float) -> str:
    """ "↗" if cur - prev > 0.01, "↘" if cur - prev < -0.01, else "→" (also when either is NaN)."""
    delta = cur - prev
    if delta > TREND_DELTA:
        return "↗"
    if delta < -TREND_DELTA:
        return "↘"
    return "→"


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Population std / mean of the finite values; NaN with fewer than two or a zero mean.

    Used across the action heads' norms: near 0 means all heads learn at a similar rate,
    above ~1 means some heads get far more signal than others.
    """
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return float("nan")
    mean = sum(finite) / len(finite)
    if mean == 0.0:
        return float("nan")
    var = sum((v - mean) ** 2 for v in finite) / len(finite)
    return math.sqrt(var) / mean
