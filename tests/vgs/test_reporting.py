"""``vgs/reporting.py``: every ``vgs/*`` metric ``get_metrics()`` reports, against a numpy re-implementation.

``tests/vgs/vgs_oracle.py`` recomputes the VGS formulas in float64 from the module
docstring and seed 002 (its flaws fixed); nothing here calls the scaler's own helpers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradmon_ray import metric_names as mn
from gradmon_ray.vgs import VarianceGradientScaler
from tests.vgs.vgs_oracle import assert_vgs_metrics_close, numpy_vgs_metrics

SHAPES = [(6, 5), (5,), (3, 4), (4,)]


def _gradient_stream(steps: int, seed: int) -> list[list[np.ndarray]]:
    """Tensors of very different scales and noise levels, some elements exactly constant."""
    rng = np.random.default_rng(seed)
    base = [rng.normal(size=s) * scale for s, scale in zip(SHAPES, (0.01, 1.0, 10.0, 0.3), strict=True)]
    noise = (0.05, 2.0, 0.5, 0.0)  # the last tensor never changes: its nv is exactly 0
    return [
        [(b * (1 + n * rng.normal(size=b.shape))).astype(np.float32) for b, n in zip(base, noise, strict=True)]
        for _ in range(steps)
    ]


@pytest.mark.parametrize("granularity", ["element", "tensor"])
@pytest.mark.parametrize("method", ["p90", "mean", "weighted_mean"])
def test_every_vgs_metric_equals_the_numpy_reimplementation(granularity, method):
    """12 steps, two of them skipped (non-finite), warmup 5: statistics, percentiles, the
    aggregate, the factor and the spatial EMAs as ``get_metrics()`` reports them."""
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    settings = {"beta": 0.8, "alpha": 3.0, "eps": 1e-8, "warmup_steps": 5}
    vgs = VarianceGradientScaler(params, aggregation_method=method, granularity=granularity, **settings)
    stream = _gradient_stream(12, seed=7)
    skipped = [k in (3, 8) for k in range(len(stream))]
    for k, grads in enumerate(stream):
        for p, g in zip(params, grads, strict=True):
            p.grad = torch.from_numpy(g.copy())
            if skipped[k]:
                p.grad.view(-1)[0] = float("nan")
        vgs.scale_gradients(skip=torch.tensor(float(skipped[k])))
        vgs.step()
        if k in (2, 11):  # inside and after warmup
            seen = stream[: k + 1]
            expected = numpy_vgs_metrics(
                seen, aggregation_method=method, granularity=granularity, skipped=skipped[: k + 1], **settings
            )
            assert_vgs_metrics_close(vgs.get_metrics(), expected)
    assert expected[mn.VGS_WARMUP_ACTIVE] == 0.0 and expected[mn.VGS_SCALING_FACTOR] < 0.99  # the factor acts
    assert expected[mn.VGS_STOCHASTIC_VAR_P10] < expected[mn.VGS_STOCHASTIC_VAR_P90]


def test_the_factor_is_what_the_gradients_are_multiplied_by():
    """The applied factor (gradient after / before) is the oracle's ``vgs/scaling_factor``."""
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    vgs = VarianceGradientScaler(params, beta=0.9, alpha=5.0, warmup_steps=0)
    stream = _gradient_stream(6, seed=3)
    for k, grads in enumerate(stream):
        for p, g in zip(params, grads, strict=True):
            p.grad = torch.from_numpy(g.copy())
        vgs.scale_gradients()
        expected = numpy_vgs_metrics(stream[: k + 1], beta=0.9, alpha=5.0, warmup_steps=0)
        ratio = params[1].grad.double().numpy() / grads[1].astype(np.float64)
        np.testing.assert_allclose(ratio, expected[mn.VGS_SCALING_FACTOR], rtol=1e-5)
        vgs.step()
