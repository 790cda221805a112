"""A numpy re-implementation of the VGS formulas, for oracle tests (not a test module).

Written from the formulas in ``gradmon_ray/vgs/scaler.py``'s docstring and seed 002, with
the seed's known flaws fixed as ``/work/shared/seeds/README.md`` asks (statistics per element
and over TIME, never the spread within a tensor), in float64 and with plain loops, sharing no
code with the product:

    a_i = EMA(|g_i|) / (1 - beta^t),   b_i = EMA(g_i^2) / (1 - beta^t)
    nv_i = max(b_i - a_i^2, 0) / (a_i^2 + eps)
    factor = clamp(1 / (1 + alpha * aggregate(nv)), 1e-4, 1)   (1 during warmup)

``t`` counts the applied (non-skipped) updates; the warmup clock counts every step.
``granularity="tensor"``: one statistic per tensor, ``s = mean(|g|)``, and its square.
The legacy spatial EMAs (mean, population variance, L2 norm and max |g| over all elements,
signed mean) are bias-corrected by the same ``t``.
"""

from __future__ import annotations

import numpy as np

from gradmon_ray import metric_names as mn


def numpy_vgs_metrics(
    steps: list[list[np.ndarray]],
    *,
    beta: float = 0.99,
    alpha: float = 0.1,
    eps: float = 1e-8,
    warmup_steps: int = 100,
    aggregation_method: str = "p90",
    granularity: str = "element",
    skipped: list[bool] | None = None,
    sample: np.ndarray | None = None,
) -> dict[str, float]:
    """Every ``vgs/*`` metric after feeding ``steps`` (per step: one gradient array per tensor);
    with ``sample`` (flat entry indices), the percentiles and the spatial statistics are over
    those entries only (the spatial sums scaled up to all entries)."""
    sizes = [g.size for g in steps[0]]
    width = sum(sizes) if granularity == "element" else len(sizes)
    mean_ema = np.zeros(width)
    sq_ema = np.zeros(width)
    spatial_ema = np.zeros(4)  # signed mean, variance, norm, max|g|
    applied = 0
    for k, grads in enumerate(steps):
        if skipped is not None and skipped[k]:
            continue
        flat = np.concatenate([np.asarray(g, dtype=np.float64).ravel() for g in grads])
        if granularity == "element":
            stat = np.abs(flat)
        else:
            stat = np.array([np.abs(np.asarray(g, dtype=np.float64)).mean() for g in grads])
        mean_ema = beta * mean_ema + (1 - beta) * stat
        sq_ema = beta * sq_ema + (1 - beta) * stat**2
        n = flat.size
        seen = flat if sample is None else flat[sample]  # a sample's sums, extrapolated to all n
        total, total_sq = seen.sum() * n / seen.size, (seen**2).sum() * n / seen.size
        mean = total / n
        spatial = np.array([mean, total_sq / n - mean**2, np.sqrt(total_sq), np.abs(seen).max()])
        spatial_ema = beta * spatial_ema + (1 - beta) * spatial
        applied += 1

    if applied:
        correction = 1 - beta**applied
        a, b = mean_ema / correction, sq_ema / correction
        nv = np.maximum(b - a * a, 0.0) / (a * a + eps)
        spatial = spatial_ema / correction
    else:
        nv, spatial = np.zeros(width), np.zeros(4)
    if granularity == "element":
        bounds = np.cumsum([0, *sizes])
        per_tensor = np.array([nv[bounds[i] : bounds[i + 1]].mean() for i in range(len(sizes))])
        weighted = nv.mean()
    else:
        per_tensor = nv
        weighted = float((nv * np.array(sizes)).sum() / sum(sizes))
    p10, p50, p90 = np.quantile(nv if sample is None else nv[sample], [0.1, 0.5, 0.9])  # linear interpolation
    aggregate = {"p90": p90, "mean": per_tensor.mean(), "weighted_mean": weighted}[aggregation_method]
    step_count = len(steps)
    warmup = step_count < warmup_steps
    factor = 1.0 if warmup else float(np.clip(1.0 / (1.0 + alpha * aggregate), 1e-4, 1.0))
    return {
        mn.VGS_STOCHASTIC_VAR_P10: float(p10),
        mn.VGS_STOCHASTIC_VAR_P50: float(p50),
        mn.VGS_STOCHASTIC_VAR_P90: float(p90),
        mn.VGS_STOCHASTIC_VAR_MEAN: float(per_tensor.mean()),
        mn.VGS_GRAD_NORM_EMA: float(spatial[2]),
        mn.VGS_GRAD_MEAN_EMA: float(spatial[0]),
        mn.VGS_GRAD_VAR_EMA: float(spatial[1]),
        mn.VGS_GRAD_MAX_EMA: float(spatial[3]),
        mn.VGS_NORMALIZED_VARIANCE: float(aggregate),
        mn.VGS_SCALING_FACTOR: factor,
        mn.VGS_STEP_COUNT: float(step_count),
        mn.VGS_WARMUP_ACTIVE: float(warmup),
    }


NV_METRICS = (
    mn.VGS_STOCHASTIC_VAR_P10,
    mn.VGS_STOCHASTIC_VAR_P50,
    mn.VGS_STOCHASTIC_VAR_P90,
    mn.VGS_STOCHASTIC_VAR_MEAN,
    mn.VGS_NORMALIZED_VARIANCE,
)


def assert_vgs_metrics_close(got: dict, expected: dict, rel: float = 2e-4) -> None:
    """Every ``vgs/*`` name present and equal to the oracle (float32 product vs float64 oracle)."""
    import pytest

    for name, want in expected.items():
        assert name in got, name
        if name == mn.VGS_GRAD_MEAN_EMA:  # a signed mean near 0: float32 summation error
            abs_tol = 1e-6 * max(1.0, abs(expected[mn.VGS_GRAD_NORM_EMA]))
        elif name in NV_METRICS:  # b - a^2 cancels in float32: ~1e-6 absolute for nv ~ 0
            abs_tol = 5e-6
        else:
            abs_tol = 1e-7
        assert float(got[name]) == pytest.approx(want, rel=rel, abs=abs_tol), (name, float(got[name]), want)


def assert_same_vgs_state(got: dict, want: dict, what: str = "VGS state") -> None:
    """Two ``VarianceGradientScaler.state_dict()``s equal bit for bit (statistics, counters, clock)."""
    import torch

    assert got.keys() == want.keys(), what
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), f"{what}: {key} changed"
        else:
            assert got[key] == value or (value != value and got[key] != got[key]), f"{what}: {key} changed"
