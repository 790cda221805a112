"""The whole iteration, not its mean: per head the largest and the 95th-percentile minibatch norm and
which minibatch had the largest, and how often gradient clipping was binding.

RLlib logs the last minibatch's gradient norm and gradmon the mean over the iteration's
minibatches: a spike in minibatch 7 of 34 is averaged away (SB3 fixed the same blind spot for
``clip_fraction``, DLR-RM/stable-baselines3#149).  The learner's drain already stacks every
minibatch's norms on the device (``norm_records``); they ride the step's one host copy, and this
module reads them there, in numpy: no device op beyond that copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradmon_ray import metric_names as mn


@dataclass(frozen=True)
class MinibatchSpread:
    """One module's minibatch norms of one telemetry step, beyond their mean (plain floats)."""

    norm_max: dict[str, float]
    norm_p95: dict[str, float]
    argmax_minibatch: dict[str, int]
    """Per head, the index (from 0, over all epochs of the step) of the minibatch with ``norm_max``."""
    clip_binding_fraction: float | None
    """None: no global-norm clip configured (or no minibatch with a finite global norm)."""

    def to_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for head, value in self.norm_max.items():
            out[mn.head_metric(mn.HEAD_GRAD_NORM_MAX, head)] = value
            out[mn.head_metric(mn.HEAD_GRAD_NORM_P95, head)] = self.norm_p95[head]
            out[mn.head_metric(mn.HEAD_GRAD_NORM_ARGMAX, head)] = float(self.argmax_minibatch[head])
        if self.clip_binding_fraction is not None:
            out[mn.CLIP_BINDING_FRACTION] = self.clip_binding_fraction
        return out


def minibatch_spread(norms: np.ndarray, heads: Sequence[str], grad_clip: float | None) -> MinibatchSpread:
    """From ``norms`` ``[minibatches, heads + 1]`` (each head's norm, then the module's global norm;
    NaN where there was no gradient): a head with no gradient in any minibatch is left out.
    ``grad_clip``: the module's global-norm clip (None: none, or RLlib clips per tensor or value)."""
    norms = np.asarray(norms, dtype=np.float64).reshape(-1, len(heads) + 1)
    norm_max: dict[str, float] = {}
    norm_p95: dict[str, float] = {}
    argmax: dict[str, int] = {}
    for k, head in enumerate(heads):
        column = norms[:, k]
        present = ~np.isnan(column)
        if not present.any():
            continue
        index = int(np.nanargmax(column))
        norm_max[head] = float(column[index])
        with np.errstate(invalid="ignore"):  # an Inf norm: the interpolation meets inf - inf, numpy warns
            norm_p95[head] = float(np.percentile(column[present], 95))
        argmax[head] = index
    fraction = None
    if grad_clip is not None:
        global_norms = norms[:, -1]
        finite = global_norms[np.isfinite(global_norms)]
        if finite.size:
            fraction = float(np.mean(finite > grad_clip))
    return MinibatchSpread(norm_max, norm_p95, argmax, fraction)
