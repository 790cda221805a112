"""``vgs/aggregation.py``: undefined entries.  NaN is ignored (numpy's ``nanquantile`` / ``nanmean``
on the restored EMAs are the oracle), +Inf counts as the cap, and with no entry left the factor
falls to its floor and the percentile metrics are NaN."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradmon_ray import metric_names as mn
from gradmon_ray.vgs import VarianceGradientScaler

MAX_NV = 1e6


def _numpy_nv(mean_ema: np.ndarray, sq_ema: np.ndarray, steps: float, beta: float, eps: float) -> np.ndarray:
    """The normalized variance per entry from a state's EMAs, in float64 (NaN propagates), capped at 1e6."""
    with np.errstate(invalid="ignore", over="ignore"):
        correction = 1 - beta**steps
        a, b = mean_ema / correction, sq_ema / correction
        nv = np.maximum(b - a * a, 0.0) / (a * a + eps)
    return np.where(np.isnan(nv), np.nan, np.minimum(nv, MAX_NV))


def _state_with(vgs: VarianceGradientScaler, params, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    for step in range(6):
        for p in params:
            p.grad = 1.0 + (0.2 + 0.3 * step % 3) * torch.randn(p.shape, generator=gen) * torch.rand(
                p.shape, generator=gen
            )
        vgs.scale_gradients()
        vgs.step()
    return vgs.state_dict()


def test_a_restored_state_with_nan_at_the_p90_neighbours_scales_by_the_nanquantile():
    """NaN in the restored EMA of the two entries around the p90 position: the percentiles, the
    aggregate and the factor are numpy's nanquantile of the rest (they were NaN, then factor 1)."""
    params = [torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(4))]
    settings_ = {"beta": 0.9, "alpha": 0.5, "eps": 1e-8, "warmup_steps": 0}
    state = _state_with(VarianceGradientScaler(params, **settings_), params)
    mean, sq = state["param_grad_mean_ema"].double().numpy(), state["param_grad_sq_ema"].double().numpy()
    nv = _numpy_nv(mean, sq, state["stat_steps"], 0.9, 1e-8)
    order = np.argsort(nv)
    neighbours = order[[math.floor(0.9 * 9), math.floor(0.9 * 9) + 1]]  # positions 8 and 9 of 0..9
    state["param_grad_mean_ema"][neighbours] = math.nan
    nv[neighbours] = math.nan

    restored = VarianceGradientScaler(params, **settings_)
    restored.load_state_dict(state)
    metrics = restored.get_metrics()
    p10, p50, p90 = np.nanquantile(nv, [0.1, 0.5, 0.9])
    assert metrics[mn.VGS_STOCHASTIC_VAR_P90] == pytest.approx(p90, rel=1e-5)
    assert (metrics[mn.VGS_STOCHASTIC_VAR_P10], metrics[mn.VGS_STOCHASTIC_VAR_P50]) == pytest.approx(
        (p10, p50), rel=1e-5
    )
    per_tensor = [np.nanmean(nv[:6]), np.nanmean(nv[6:])]
    assert metrics[mn.VGS_STOCHASTIC_VAR_MEAN] == pytest.approx(np.mean(per_tensor), rel=1e-5)
    assert metrics[mn.VGS_NORMALIZED_VARIANCE] == pytest.approx(p90, rel=1e-5)
    factor = min(1.0, max(1e-4, 1 / (1 + 0.5 * p90)))
    assert metrics[mn.VGS_SCALING_FACTOR] == pytest.approx(factor, rel=1e-5) and factor < 0.99


def test_the_one_pass_sampled_step_after_a_restore_with_nan_uses_the_nanquantile_of_the_sample():
    """Element granularity with a sample (the per-step path, ``element_step``): NaN in a third of
    the restored EMA (NaN stays NaN through the fold), the returned factor and the scaled
    gradients follow numpy's nanquantile over the sampled entries after this step's fold."""
    shapes = [(20, 15), (40,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    settings_ = {"beta": 0.9, "alpha": 2.0, "eps": 1e-8, "warmup_steps": 0}
    state = _state_with(VarianceGradientScaler(params, quantile_sample_size=53, **settings_), params, seed=3)
    state["param_grad_mean_ema"][::3] = math.nan
    vgs = VarianceGradientScaler(params, quantile_sample_size=53, **settings_)
    vgs.load_state_dict(state)
    grads = [torch.full(s, 0.7) + 0.5 * torch.randn(s, generator=torch.Generator().manual_seed(9)) for s in shapes]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    factor = float(vgs.scale_gradients())

    g = np.concatenate([x.double().numpy().ravel() for x in grads])
    mean = 0.9 * state["param_grad_mean_ema"].double().numpy() + 0.1 * np.abs(g)
    sq = 0.9 * state["param_grad_sq_ema"].double().numpy() + 0.1 * g * g
    nv = _numpy_nv(mean, sq, state["stat_steps"] + 1, 0.9, 1e-8)[vgs._sample.numpy()]
    assert np.isnan(nv).any() and not np.isnan(nv).all()
    want = min(1.0, max(1e-4, 1 / (1 + 2.0 * np.nanquantile(nv, 0.9))))
    assert factor == pytest.approx(want, rel=1e-5) and want < 0.99
    for p, x in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, x * want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", ["p90", "mean", "weighted_mean"])
def test_no_defined_entry_falls_back_to_the_smallest_factor_and_reports_nan(method):
    """Every restored EMA entry NaN: no statistic is left, so the aggregate is the cap (1e6) and
    the factor its floor, not 1; the percentile and mean metrics are NaN, so it shows in MLflow."""
    params = [torch.nn.Parameter(torch.zeros(5))]
    settings_ = {"alpha": 0.1, "warmup_steps": 0, "aggregation_method": method}
    state = _state_with(VarianceGradientScaler(params, **settings_), params)
    state["param_grad_mean_ema"][:] = math.nan
    vgs = VarianceGradientScaler(params, **settings_)
    vgs.load_state_dict(state)
    metrics = vgs.get_metrics()
    for name in (mn.VGS_STOCHASTIC_VAR_P10, mn.VGS_STOCHASTIC_VAR_P50, mn.VGS_STOCHASTIC_VAR_P90):
        assert math.isnan(metrics[name]), name
    assert math.isnan(metrics[mn.VGS_STOCHASTIC_VAR_MEAN])
    assert metrics[mn.VGS_NORMALIZED_VARIANCE] == MAX_NV
    floor = max(1e-4, 1 / (1 + 0.1 * MAX_NV))
    assert metrics[mn.VGS_SCALING_FACTOR] == pytest.approx(floor)
    params[0].grad = torch.ones(5)
    assert float(vgs.scale_gradients()) == pytest.approx(floor)
    torch.testing.assert_close(params[0].grad, torch.full((5,), floor))


def test_an_infinite_entry_counts_as_the_cap():
    """+Inf in a restored squared EMA: that entry's nv is the cap, the largest there is."""
    params = [torch.nn.Parameter(torch.zeros(4))]
    state = _state_with(VarianceGradientScaler(params, warmup_steps=0, beta=0.9), params)
    state["param_grad_sq_ema"][2] = math.inf
    vgs = VarianceGradientScaler(params, warmup_steps=0, beta=0.9)
    vgs.load_state_dict(state)
    nv = _numpy_nv(
        state["param_grad_mean_ema"].double().numpy(),
        state["param_grad_sq_ema"].double().numpy(),
        state["stat_steps"],
        0.9,
        1e-8,
    )
    assert nv[2] == MAX_NV
    assert vgs.get_normalized_variance() == pytest.approx(np.quantile(nv, 0.9), rel=1e-5)


def test_a_disabled_scaler_with_statistics_reports_zero_variance_and_factor_one():
    """A checkpoint restored with ``enabled=False`` keeps its statistics but aggregates nothing:
    nv 0 and factor 1, even though the same statistics give a non-zero nv when enabled."""
    p = torch.nn.Parameter(torch.zeros(3))
    src = VarianceGradientScaler([p], warmup_steps=0)
    stream = []
    for i in range(3):
        g = torch.tensor([1.0, 2.0, 3.0]) * (1 + i)
        p.grad = g.clone()
        src.scale_gradients()
        src.step()
        stream.append([g.numpy()])
    dst = VarianceGradientScaler([p], warmup_steps=0)
    dst.load_state_dict({**src.state_dict(), "enabled": False})
    assert torch.equal(dst.state_dict()["param_grad_sq_ema"], src.state_dict()["param_grad_sq_ema"])
    assert dst.normalized_variance_tensor().item() == 0.0 and dst.get_normalized_variance() == 0.0
    assert dst.scaling_factor_tensor().item() == 1.0
    from tests.vgs.vgs_oracle import numpy_vgs_metrics

    want = numpy_vgs_metrics(stream, beta=0.99, alpha=0.1, eps=1e-8, warmup_steps=0)
    assert src.get_normalized_variance() == pytest.approx(want[mn.VGS_NORMALIZED_VARIANCE], rel=1e-4)
