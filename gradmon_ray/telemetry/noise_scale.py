"""Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
Appendix A), per head.

With data-parallel learners, each learner's local gradient is a small-batch estimate
(``b_small`` samples) and the all-reduced gradient a big-batch one (``b_big``).  Since
``E|G_b|^2 = |G|^2 + tr(Sigma)/b``, two batch sizes give unbiased estimates of the true
squared gradient norm and of the trace of the per-sample gradient covariance:

    |G|^2      ~ (b_big * |G_big|^2 - b_small * |G_small|^2) / (b_big - b_small)
    tr(Sigma)  ~ (|G_small|^2 - |G_big|^2) / (1/b_small - 1/b_big)

Each estimate is noisy, so the two are smoothed separately with EMAs and only then divided:
``B_simple = EMA(tr Sigma) / EMA(|G|^2)``.  B_simple approximates the *critical batch
size*: batches much smaller than it waste optimizer steps on noise, much larger ones waste
samples.  Caveat for PPO: minibatches are reused for several epochs and the policy moves
between them, so the samples are not i.i.d. draws from a fixed distribution; read B_simple as
a trend and an order of magnitude, not an exact batch size.

With ``k`` learners the estimator reduces to the learners' per-minibatch mean gradients
``m_r`` (``M`` their mean): ``|G|^2 ~ (k|M|^2 - mean_r |m_r|^2) / (k - 1)``, i.e. the mean
pairwise dot product ``m_r . m_s`` over ``r != s`` (for two learners simply ``m_0 . m_1``).
For a head whose true ``|G|^2`` is small next to the sampling noise ``tr(Sigma)/b`` this is
negative about as often as positive, and so can EMA(|G|^2) be for many iterations: B_simple
is then undefined (the gradient is indistinguishable from noise at the batch sizes seen so
far) and ``noise_scales`` leaves that entry out instead of returning NaN.

The learner's noise lanes (``noise_lane_count(num_heads)`` float64 values, SUM-reduced across
learners once per iteration together with the rest of the telemetry) are laid out as
``[local sq per head | local trunk sq | local global sq | big sq per head | big global sq]``:
"local" is each learner's own minibatch gradient before DDP's all-reduce (the DDP comm hook
``gradmon_ray.distributed.noise_hook.NoiseScaleHook`` adds them), "big" the all-reduced one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from gradmon_ray import metric_names as mn

T = TypeVar("T")

GLOBAL_ENTRY = "global"
"""The tracker's last entry: all parameters (heads and shared trunk) together."""


def noise_lane_count(num_heads: int) -> int:
    """Length of the noise lanes for ``num_heads`` reported heads (see the module docstring)."""
    return 2 * num_heads + 3


def gradient_noise_terms(sq_norm_small: T, sq_norm_big: T, b_small: float, b_big: float) -> tuple[T, T]:
    """``(g2, trace_sigma)`` from squared gradient norms at two batch sizes (floats or tensors)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small} and {b_big}")
    g2 = (b_big * sq_norm_big - b_small * sq_norm_small) / (b_big - b_small)  # type: ignore[operator]
    trace_sigma = (sq_norm_small - sq_norm_big) / (1.0 / b_small - 1.0 / b_big)  # type: ignore[operator]
    return g2, trace_sigma


class NoiseScaleTracker:
    """EMAs of |G|^2 and tr(Sigma) per entry (heads, then "global"), and B_simple.

    ``update`` takes one training iteration's mean squared norms.  Both EMAs start at 0 and
    share the bias factor ``1 - beta^t``, which cancels in the ratio, so B_simple needs no
    bias correction.
    """

    def __init__(self, names: Sequence[str], beta: float = 0.9) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.names = tuple(names)
        self.beta = beta
        self.g2_ema = [0.0] * len(self.names)
        self.trace_ema = [0.0] * len(self.names)
        self.updates = 0

    def update(
        self, sq_small: Sequence[float], sq_big: Sequence[float], b_small: float, b_big: float
    ) -> dict[str, float]:
        """Fold in one iteration; returns ``{name: B_simple}`` (NaN while undefined)."""
        self.updates += 1
        for i, (small, big) in enumerate(zip(sq_small, sq_big, strict=True)):
            g2, trace = gradient_noise_terms(small, big, b_small, b_big)
            if math.isfinite(g2) and math.isfinite(trace):
                self.g2_ema[i] = self.beta * self.g2_ema[i] + (1 - self.beta) * g2
                self.trace_ema[i] = self.beta * self.trace_ema[i] + (1 - self.beta) * trace
        return self.noise_scales()

    def noise_scales(self) -> dict[str, float]:
        """``B_simple`` per entry; NaN before any update or while EMA(|G|^2) <= 0."""
        out = {}
        for name, g2, trace in zip(self.names, self.g2_ema, self.trace_ema, strict=True):
            out[name] = trace / g2 if self.updates and g2 > 0 else float("nan")
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "beta": self.beta,
            "g2_ema": list(self.g2_ema),
            "trace_ema": list(self.trace_ema),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if tuple(state["names"]) != self.names:
            raise ValueError(f"noise-scale state is for {state['names']}, this learner has {list(self.names)}")
        self.g2_ema = [float(x) for x in state["g2_ema"]]
        self.trace_ema = [float(x) for x in state["trace_ema"]]
        self.updates = int(state["updates"])


def noise_scale_inputs(
    lanes: np.ndarray, num_heads: int, world_size: int, minibatches: int, rows: int
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """``(sq_small, sq_big, b_small, b_big)`` for ``NoiseScaleTracker.update`` from one iteration.

    ``lanes`` are the noise lanes after the SUM all-reduce over ``world_size`` learners, each
    of which ran ``minibatches`` minibatches holding ``rows`` rows in all.  The local lanes
    summed over learners and minibatches give the mean small-batch squared norm; the big lanes
    were identical on every learner (computed after DDP's all-reduce), so their SUM is
    ``world_size`` times the per-learner sum.  Entries: the heads, then the global norm (the
    trunk slot is dropped).
    """
    lanes = np.asarray(lanes, dtype=np.float64)
    if lanes.shape != (noise_lane_count(num_heads),):
        raise ValueError(f"expected {noise_lane_count(num_heads)} noise lanes for {num_heads} heads, got {lanes.shape}")
    k, r = world_size, num_heads
    local_sum = np.concatenate([lanes[:r], lanes[r + 1 : r + 2]])  # drop the trunk slot
    big_sum = lanes[r + 2 :]
    sq_small = local_sum / (k * minibatches)  # mean over learners and minibatches
    sq_big = big_sum / (k * minibatches)  # identical on every learner: SUM = k x
    b_small = rows / minibatches
    return sq_small, sq_big, b_small, k * b_small


def noise_scales(
    tracker: NoiseScaleTracker,
    lanes: np.ndarray,
    *,
    world_size: int,
    minibatches: int,
    rows: int,
) -> tuple[dict[str, float], float | None]:
    """Fold one iteration's reduced noise lanes into ``tracker``; the B_simple values to report.

    ``tracker.names`` are the reported heads followed by ``GLOBAL_ENTRY``.  Returns
    ``({head: B}, B over all parameters)``; a value that is undefined (EMA(|G|^2) <= 0: see the
    module docstring) is left out (the global one is then None), never returned as NaN.
    Nothing is folded in (and ``({}, None)`` returned) without minibatches or rows.  The
    metric names are the reporting layer's: ``metric_names.noise_scale_metrics``.
    """
    if minibatches <= 0 or rows <= 0:
        return {}, None
    num_heads = len(tracker.names) - 1
    sq_small, sq_big, b_small, b_big = noise_scale_inputs(lanes, num_heads, world_size, minibatches, rows)
    scales = tracker.update(sq_small.tolist(), sq_big.tolist(), b_small, b_big)
    defined = {name: value for name, value in scales.items() if math.isfinite(value)}
    global_scale = defined.pop(GLOBAL_ENTRY, None)
    return defined, global_scale


def noise_scale_metrics(per_head: Mapping[str, float], global_scale: float | None = None) -> dict[str, float]:
    """``{mn.HEAD_NOISE_SCALE per head: B, GLOBAL_NOISE_SCALE: B}``; ``global_scale`` None: left out."""
    out = {mn.head_metric(mn.HEAD_NOISE_SCALE, head): value for head, value in per_head.items()}
    if global_scale is not None:
        out[mn.GLOBAL_NOISE_SCALE] = global_scale
    return out
