"""``vgs/kernels.py``: ``quantiles`` equals numpy's ``nanquantile``, and the compiled VGS step is the
eager one (same factors, statistics and scaled gradients).

``compile="on"`` runs ``vgs_kernels``' functions through ``torch.compile`` (Inductor's C++
on CPU); the worked-answer tests in ``test_scaler.py`` run them eagerly (below 1M parameters
``compile="auto"`` stays eager).  Here both run side by side on the same gradient stream,
non-finite steps included, for the sampled one-pass ``p90`` path (element granularity) and
for ``tensor`` granularity.  Each module compiles once (tens of seconds on a 2-core CPU).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradmon_ray.vgs import VarianceGradientScaler, kernels

MAX_NV = 1e6  # the cap on a normalized variance

SHAPES = [(40, 30), (30,), (9, 30), (9,)]


def _stream(steps: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    mean = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[m + (0.2 + k % 3) * torch.randn(m.shape, generator=gen) for m in mean] for k in range(steps)]
    grads[5][0][0, 0] = float("nan")  # a non-finite step, skipped by its flag
    grads[6][2][1, 1] = float("inf")
    return grads


@pytest.mark.parametrize(
    "kwargs",
    [
        {"granularity": "element", "quantile_sample_size": 256},  # sampled p90: the one-pass path
        {"granularity": "element", "aggregation_method": "mean"},  # fold, then aggregate, then scale
        {"granularity": "tensor"},
    ],
    ids=["element-p90-sampled", "element-mean", "tensor"],
)
def test_compiled_step_equals_eager_step(kwargs):
    sides = []
    for compile_mode in ("off", "on"):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
        vgs = VarianceGradientScaler(params, warmup_steps=2, alpha=2.0, compile=compile_mode, **kwargs)
        factors, scaled = [], []
        for grads in _stream(10):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            skip = torch.tensor(float(not all(torch.isfinite(g).all() for g in grads)))
            factors.append(vgs.scale_gradients(skip=skip).clone())
            vgs.step()
            scaled.append([p.grad.clone() for p in params])
        sides.append((vgs, factors, scaled))
    (eager, eager_factors, eager_grads), (compiled, compiled_factors, compiled_grads) = sides
    assert compiled.compiled and not eager.compiled
    torch.testing.assert_close(torch.stack(compiled_factors), torch.stack(eager_factors), rtol=1e-5, atol=1e-7)
    assert float(eager_factors[-1]) < 0.95  # the factor really acts
    for got, want in zip(compiled_grads, eager_grads, strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(compiled._mean_ema, eager._mean_ema, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(compiled._sq_ema, eager._sq_ema, rtol=1e-5, atol=1e-7)
    got, want = compiled.get_metrics(), eager.get_metrics()
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize(
    ("values", "q"),
    [
        ([1.0, 2.0, math.nan, 4.0], 0.5),
        # NaN at both neighbours of the 0.9 position (3.6 of 0..4): once read as +inf,
        # inf + 0.6 * (inf - inf) gave NaN, and later a silent factor of 1
        ([0.5, math.nan, math.nan, 3.0, 1.5], 0.9),
        ([math.nan, 2.0, 2.0, 2.0, 5.0], 0.5),  # ties
        ([math.nan, 7.0, math.nan], 0.1),  # one entry left
        ([0.0, MAX_NV, 3.0, math.nan], 0.9),  # a capped +Inf entry is the largest
        ([4.0, 1.0, 3.0, 2.0], 0.9),  # no NaN: numpy's own quantile
    ],
)
def test_quantiles_equal_numpy_nanquantile(values, q):
    got = kernels.quantiles(torch.tensor(values), (q, 0.0, 1.0))
    want = np.nanquantile(np.array(values), [q, 0.0, 1.0])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


def test_quantiles_of_only_nan_entries_are_nan():
    assert torch.isnan(kernels.quantiles(torch.full((5,), math.nan), (0.1, 0.9))).all()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.just(math.nan), st.sampled_from([0.0, 1.0, 2.5]), st.floats(0, MAX_NV)), max_size=60),
    st.floats(0, 1),
)
def test_quantiles_equal_numpy_nanquantile_on_any_entries(values, q):
    values = [*values, 1.0]  # at least one entry
    got = float(kernels.quantiles(torch.tensor(values, dtype=torch.float64), (q,))[0])
    assert got == pytest.approx(float(np.nanquantile(np.array(values), q)), rel=1e-9, abs=1e-9)


def test_tensor_statistic_is_the_mean_absolute_gradient_worked_answer():
    """granularity="tensor", beta 0.9: after one step each tensor's EMAs hold (1 - beta) * s and
    (1 - beta) * s^2 with s = mean|g|: g1 = [1, -3] -> s = 2; g2 = [0.5, 0.5, -2, 1] -> s = 1."""
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, 2))
    vgs = VarianceGradientScaler([p1, p2], granularity="tensor", beta=0.9, warmup_steps=0)
    p1.grad, p2.grad = torch.tensor([1.0, -3.0]), torch.tensor([[0.5, 0.5], [-2.0, 1.0]])
    vgs.update_statistics()
    state = vgs.state_dict()
    torch.testing.assert_close(state["param_grad_mean_ema"], torch.tensor([0.2, 0.1]), rtol=1e-6, atol=0)
    torch.testing.assert_close(state["param_grad_sq_ema"], torch.tensor([0.4, 0.1]), rtol=1e-6, atol=0)


def test_quantiles_of_nothing_are_zeros_and_of_only_nan_are_nan_at_the_ends_too():
    """Empty input: one 0 per quantile (nothing to scale by).  Only NaN entries: NaN for every q,
    the extreme quantiles 0 and 1 included (whose selection lands on a +-Inf placeholder)."""
    assert kernels.quantiles(torch.empty(0), (0.5, 0.9)).tolist() == [0.0, 0.0]
    only_nan = kernels.quantiles(torch.full((5,), math.nan), (0.0, 0.5, 1.0))
    assert torch.isnan(only_nan).tolist() == [True, True, True]


def test_a_minus_inf_gradient_enters_the_spatial_emas_as_zero():
    """Tensor granularity, beta 0.5, a step that is not skipped: g = [-inf, 1] makes the spatial mean
    -Inf, the sum of squares +Inf and the variance NaN, and every non-finite statistic enters the EMA
    as 0.  A second step g = [1, 3] (mean 2, var (1 + 9)/2 - 4 = 1, norm sqrt(10), max 3) then reads,
    bias-corrected over the two steps, (0.5 * x) / (1 - 0.5^2) = 2x/3."""
    p = torch.nn.Parameter(torch.zeros(2))
    vgs = VarianceGradientScaler([p], granularity="tensor", beta=0.5, warmup_steps=0)
    p.grad = torch.tensor([-math.inf, 1.0])
    vgs.update_statistics()
    metrics = vgs.get_metrics()
    assert [metrics[f"vgs/grad_{k}_ema"] for k in ("mean", "var", "norm", "max")] == [0.0, 0.0, 0.0, 0.0]
    p.grad = torch.tensor([1.0, 3.0])
    vgs.update_statistics()
    metrics = vgs.get_metrics()
    want = [2.0 * 2 / 3, 1.0 * 2 / 3, math.sqrt(10.0) * 2 / 3, 3.0 * 2 / 3]
    got = [metrics[f"vgs/grad_{k}_ema"] for k in ("mean", "var", "norm", "max")]
    assert got == pytest.approx(want, rel=1e-6)


def test_a_failed_compile_warns_once_with_its_first_line_and_runs_eagerly(monkeypatch, caplog):
    """``compile_on_demand.Kernel``: when ``torch.compile`` raises, one warning names the caller's label
    and the error's first line, the eager function answers (now and on later calls) and ``compiled``
    stays False."""
    import logging

    import gradmon_ray.compile_on_demand as cod

    def failing_compile(*args, **kwargs):
        raise RuntimeError("backend exploded\nsecond line of the traceback")

    monkeypatch.setattr(cod.torch, "compile", failing_compile)
    kernel = cod.Kernel(lambda x: x * 2 + 1, compile=True, label="VGS element step")
    with caplog.at_level(logging.WARNING, logger="gradmon_ray.compile_on_demand"):
        assert kernel(torch.tensor([1.0, 3.0])).tolist() == [3.0, 7.0]
        assert kernel(torch.tensor([0.5])).tolist() == [2.0]
    assert [r.getMessage() for r in caplog.records] == [
        "VGS element step: torch.compile failed (backend exploded); running the eager version"
    ]
    assert kernel.compiled is False
    default = cod.Kernel(lambda x: x, compile=True)
    with caplog.at_level(logging.WARNING, logger="gradmon_ray.compile_on_demand"):
        default(torch.zeros(1))
    assert caplog.records[-1].getMessage().startswith("VGS: torch.compile failed (backend exploded)")
