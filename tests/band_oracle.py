"""The documented health bands written out by hand (docs/metrics.md): the oracle the band, health-code
and worst-head tests compare the product's ``gradmon_ray.telemetry.bands`` with."""

from __future__ import annotations

import math

ACTION_EDGES = (0.01, 0.1, 2.0, 5.0)
"""The action heads' default edges: dead < 0.01 <= weak < 0.1 <= healthy <= 2 < elevated <= 5 < exploding."""
VALUE_EDGES = (0.01, 0.1, 10.0, 50.0)
"""The value heads' default edges."""
BAND_NAMES = ("dead", "weak", "healthy", "elevated", "exploding", "spiking")
"""By health code 0-5."""


def band_code(norm: float, edges: tuple[float, float, float, float] = ACTION_EDGES, peak: float = math.nan) -> int:
    """The health code of ``norm`` by ``edges`` (-1 for NaN: no band); 5 ("spiking") where the mean
    is weak, healthy or elevated (codes 1-3) and the largest minibatch norm ``peak`` is above the
    elevated edge."""
    if math.isnan(norm):
        return -1
    dead, weak, healthy, elevated = edges
    code = 0 if norm < dead else 1 if norm < weak else 2 if norm <= healthy else 3 if norm <= elevated else 4
    return 5 if code in (1, 2, 3) and peak > elevated else code
