"""Per-head gradient norms, bands, trends, CV: worked answers and property tests."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradmon_ray.telemetry import (
    GradientNormPlan,
    classify_grad_norm,
    coefficient_of_variation,
    per_head_grad_norms,
    trend_arrow,
    worst_head,
)


def _param(*values: float, grad: list[float] | None) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.tensor(values, dtype=torch.float32))
    if grad is not None:
        p.grad = torch.tensor(grad, dtype=torch.float32)
    return p


@pytest.fixture
def hand_built_heads():
    """Head a: grads [3, 4] and [12] -> sqrt(9+16+144) = 13. Head b: no grads -> NaN.
    Head c: grads [1, 2, 2] and [0] -> 3; one param without grad is ignored.  Trunk: [0, 5]."""
    a = [_param(0, 0, grad=[3, 4]), _param(0, grad=[12])]
    b = [_param(0, 0, grad=None)]
    c = [_param(0, 0, 0, grad=[1, 2, 2]), _param(0, grad=[0]), _param(0, grad=None)]
    trunk = [_param(0, 0, grad=[0, 5])]
    return {"a": a, "b": b, "c": c}, trunk


def test_per_head_grad_norms_worked_answer(hand_built_heads):
    groups, _ = hand_built_heads
    norms = per_head_grad_norms(groups)
    assert norms.shape == (3,)
    assert norms[0].item() == pytest.approx(13.0)
    assert math.isnan(norms[1].item())
    assert norms[2].item() == pytest.approx(3.0)


def test_per_head_grad_norms_all_missing_is_all_nan():
    norms = per_head_grad_norms({"x": [_param(1, grad=None)], "y": []})
    assert torch.isnan(norms).all()


def test_plan_matches_worked_answer_and_counts(hand_built_heads):
    groups, trunk = hand_built_heads
    all_params = [p for ps in groups.values() for p in ps] + trunk
    result = GradientNormPlan(groups, all_params).compute()
    assert result.head_norms[0].item() == pytest.approx(13.0)
    assert math.isnan(result.head_norms[1].item())
    assert result.head_norms[2].item() == pytest.approx(3.0)
    # global: 169 + 9 + 25 (trunk) = 203
    assert result.global_norm.item() == pytest.approx(math.sqrt(203.0))
    assert result.nan_count.item() == 0 and result.inf_count.item() == 0
    assert result.found_nonfinite.item() == 0.0


def test_plan_counts_nan_and_inf_elements_exactly(hand_built_heads):
    groups, trunk = hand_built_heads
    groups["a"][0].grad = torch.tensor([float("nan"), float("inf")])
    trunk[0].grad = torch.tensor([float("-inf"), float("nan")])
    all_params = [p for ps in groups.values() for p in ps] + trunk
    result = GradientNormPlan(groups, all_params).compute()
    assert result.nan_count.item() == 2
    assert result.inf_count.item() == 2
    assert math.isnan(result.head_norms[0].item())
    assert result.head_norms[2].item() == pytest.approx(3.0)  # untouched head stays exact
    assert result.found_nonfinite.item() == 1.0


def test_plan_inf_only_head_norm_is_inf():
    p = _param(0, 0, grad=[float("inf"), 1.0])
    result = GradientNormPlan({"h": [p]}, [p]).compute()
    assert math.isinf(result.head_norms[0].item())
    assert result.inf_count.item() == 1 and result.nan_count.item() == 0


def test_plan_finite_elements_whose_squares_overflow_count_nothing():
    """|g| = 3e38 is finite in float32 but its square is not: the global norm is Inf, so the
    CPU path counts, and the exact count is 0 NaN / 0 Inf (nothing to skip for)."""
    p = _param(0, 0, grad=[3e38, 1.0])
    result = GradientNormPlan({"h": [p]}, [p]).compute()
    assert math.isinf(result.global_norm.item())
    assert result.nan_count.item() == 0 and result.inf_count.item() == 0
    assert result.found_nonfinite.item() == 0.0


def test_plan_counts_are_tensors_on_the_grads_device_in_both_paths(hand_built_heads):
    groups, trunk = hand_built_heads
    all_params = [p for ps in groups.values() for p in ps] + trunk
    finite = GradientNormPlan(groups, all_params).compute()
    groups["a"][0].grad = torch.tensor([float("nan"), 1.0])
    broken = GradientNormPlan(groups, all_params).compute()
    for result in (finite, broken):
        for t in (result.nan_count, result.inf_count, result.found_nonfinite):
            assert isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == torch.float32


def test_plan_rejects_overlapping_or_unknown_params():
    p = _param(0, grad=[1])
    with pytest.raises(ValueError, match="two heads"):
        GradientNormPlan({"a": [p], "b": [p]}, [p])
    with pytest.raises(ValueError, match="all_params"):
        GradientNormPlan({"a": [p]}, [])


def test_plan_no_grads_at_all():
    p = _param(0, grad=None)
    result = GradientNormPlan({"a": [p]}, [p]).compute()
    assert math.isnan(result.head_norms[0].item()) and math.isnan(result.global_norm.item())
    assert result.found_nonfinite.item() == 0.0


def test_the_plan_follows_which_gradients_are_present_not_only_how_many():
    """Two heads with same-shaped parameters: first only head a has a gradient, then only head b
    (as many gradients, a different pattern).  Each call's numbers are those of its own gradients:
    a cache keyed by the number of present gradients would add b's squares into a's slot."""
    a, b, trunk = _param(0, 0, grad=[3, 4]), _param(0, 0, grad=None), _param(0, grad=[12])
    plan = GradientNormPlan({"a": [a], "b": [b]}, [a, b, trunk])
    first = plan.compute()
    assert first.head_norms[0].item() == pytest.approx(5.0) and math.isnan(first.head_norms[1].item())
    assert first.global_norm.item() == pytest.approx(13.0)  # sqrt(9 + 16 + 144)
    a.grad, b.grad = None, torch.tensor([float("nan"), 8.0])
    second = plan.compute()
    assert math.isnan(second.head_norms[0].item()) and math.isnan(second.head_norms[1].item())
    assert second.nan_count.item() == 1 and second.inf_count.item() == 0
    b.grad = torch.tensor([6.0, 8.0])
    third = plan.compute()
    assert math.isnan(third.head_norms[0].item()), "head a has no gradient in this call"
    assert third.head_norms[1].item() == pytest.approx(10.0)
    assert third.global_norm.item() == pytest.approx(math.sqrt(36 + 64 + 144))
    assert third.nan_count.item() == 0 and third.inf_count.item() == 0


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3), min_size=2, max_size=6),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_plan_equals_reference_formula_and_numpy(shapes, seed, data):
    """Property: the vectorised plan equals the reference formula and an independent numpy sum."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape))
        if data.draw(st.booleans()):
            p.grad = torch.randn(shape, generator=gen) * data.draw(st.sampled_from([1e-3, 1.0, 1e3]))
        params.append(p)
    cut = data.draw(st.integers(1, len(params) - 1))
    groups = {"h0": params[:cut], "h1": params[cut:]}
    trunk = torch.nn.Parameter(torch.zeros(3))
    trunk.grad = torch.randn(3, generator=gen)
    plan = GradientNormPlan(groups, [*params, trunk]).compute()
    ref = per_head_grad_norms(groups)
    torch.testing.assert_close(plan.head_norms, ref, equal_nan=True, rtol=1e-5, atol=1e-6)
    for i, ps in enumerate(groups.values()):
        sq = [np.sum(p.grad.double().numpy() ** 2) for p in ps if p.grad is not None]
        expected = math.sqrt(sum(sq)) if sq else float("nan")
        got = plan.head_norms[i].item()
        assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected, rel=1e-5)
    all_sq = sum(np.sum(p.grad.double().numpy() ** 2) for p in [*params, trunk] if p.grad is not None)
    assert plan.global_norm.item() == pytest.approx(math.sqrt(all_sq), rel=1e-5)


@pytest.mark.parametrize(
    ("x", "band"),
    [
        (0.0, "dead"),
        (0.00999, "dead"),
        (0.01, "weak"),
        (0.0999, "weak"),
        (0.1, "healthy"),
        (1.0, "healthy"),
        (2.0, "healthy"),
        (2.0001, "elevated"),
        (5.0, "elevated"),
        (5.0001, "exploding"),
        (float("inf"), "exploding"),
        (float("nan"), "missing"),
    ],
)
def test_classify_grad_norm_band_edges(x, band):
    assert classify_grad_norm(x) == band


@pytest.mark.parametrize(
    ("prev", "cur", "arrow"),
    [
        (0.0, 0.01, "→"),  # delta exactly 0.01 is not "> 0.01"
        (0.0, -0.01, "→"),
        (0.0, 0.0101, "↗"),
        (0.0, -0.0101, "↘"),
        (1.0, 1.0, "→"),
        (0.5, 3.0, "↗"),
        (3.0, 0.5, "↘"),
        (float("nan"), 1.0, "→"),
        (1.0, float("nan"), "→"),
    ],
)
def test_trend_arrow_edges(prev, cur, arrow):
    assert trend_arrow(prev, cur) == arrow


def test_coefficient_of_variation_worked_answers():
    assert coefficient_of_variation([1.0, 3.0]) == pytest.approx(0.5)  # mean 2, population std 1
    assert coefficient_of_variation([2.0, 2.0, 2.0]) == 0.0
    assert coefficient_of_variation([1.0, float("nan"), 3.0]) == pytest.approx(0.5)
    assert math.isnan(coefficient_of_variation([1.0]))
    assert math.isnan(coefficient_of_variation([0.0, 0.0]))


def test_worst_head_prefers_severity_then_distance_from_healthy_centre():
    assert worst_head({"a": 1.0, "b": 7.0, "c": 0.05}) == ("b", "exploding")
    assert worst_head({"a": 0.5, "b": float("nan")}) == ("b", "missing")
    # all healthy: 1.9 is further (log scale) from sqrt(0.2)=0.447 than 0.3 is
    assert worst_head({"a": 0.3, "b": 1.9}) == ("b", "healthy")
    assert worst_head({"a": 0.001, "b": 100.0})[1] in {"dead", "exploding"}


def test_plan_counts_and_norms_against_numpy_for_several_modules_with_row_heads():
    """Three modules, one with a row-split output layer, NaN/+-Inf sprinkled over heads and trunks:
    every head norm, global norm and exact NaN/Inf element count, and each module's skip flag,
    against numpy in float64 over the same gradients (a different code path: no packing, no
    multi-tensor ops, no index)."""
    from gradmon_ray.telemetry.head_norms import ParamRows

    gen = torch.Generator().manual_seed(3)
    modules, arrays = [], []
    for m in range(3):
        w = torch.nn.Parameter(torch.zeros(6, 4))
        b = torch.nn.Parameter(torch.zeros(6))
        trunk = torch.nn.Parameter(torch.zeros(5, 3))
        for p in (w, b, trunk):
            p.grad = torch.randn(p.shape, generator=gen)
        if m == 1:
            groups = {"x": [ParamRows(w, slice(0, 2)), ParamRows(b, slice(0, 2))], "y": [ParamRows(w, slice(3, 6))]}
            w.grad[4, 1] = float("nan")
            trunk.grad[0, 0] = float("inf")
            trunk.grad[1, 2] = float("-inf")
        else:
            groups = {"x": [w], "y": [b]}
            if m == 2:  # Inf only: its skip flag must come from the non-finite marks, not the NaN ones
                b.grad[0] = float("inf")
                b.grad[5] = float("-inf")
        modules.append((groups, [w, b, trunk]))
        arrays.append([p.grad.double().numpy().copy() for p in (w, b, trunk)])
    result = GradientNormPlan.for_modules(modules).compute_all()

    def norm(*parts):
        with np.errstate(invalid="ignore", over="ignore"):
            return math.sqrt(sum(float(np.sum(a * a)) for a in parts))

    w1, b1, _ = arrays[1]
    want_heads = [
        norm(arrays[0][0]), norm(arrays[0][1]),
        norm(w1[0:2], b1[0:2]), norm(w1[3:6]),
        norm(arrays[2][0]), norm(arrays[2][1]),
    ]  # fmt: skip
    np.testing.assert_allclose(result.head_norms.numpy(), want_heads, rtol=1e-6)
    every = [np.concatenate([a.ravel() for a in module]) for module in arrays]
    np.testing.assert_allclose(result.global_norm.numpy(), [norm(e) for e in every], rtol=1e-6)
    assert result.nan_count.tolist() == [float(np.isnan(e).sum()) for e in every] == [0.0, 1.0, 0.0]
    assert result.inf_count.tolist() == [float(np.isinf(e).sum()) for e in every] == [0.0, 2.0, 2.0]
    assert [f.item() for f in result.flags] == [0.0, 1.0, 1.0]
    assert result.found_nonfinite.tolist() == [0.0, 1.0, 1.0]


def test_plan_dispatches_seven_ops_whatever_the_modules_tensors_and_heads():
    """The norm pass is a fixed launch group: seven dispatched ops (``OpCounter``) for 1 module of 2
    tensors as for 8 modules of 3 tensors with row-split heads, once the pattern's buffers exist;
    none of them reads the host.  A per-tensor or per-module op in the pass makes the counts grow."""
    from gradmon_ray.telemetry.head_norms import ParamRows
    from gradmon_ray.telemetry.op_counts import OpCounter

    counts = {}
    for modules in (1, 8):
        spec = []
        for m in range(modules):
            w, b, trunk = (torch.nn.Parameter(torch.zeros(shape)) for shape in [(4, 3), (4,), (3, 3)])
            for p in (w, b, trunk):
                p.grad = torch.randn(p.shape)
            rows = m % 2 == 1
            groups = {"x": [ParamRows(w, slice(0, 2))], "y": [ParamRows(w, slice(2, 4)), b]} if rows else {"x": [w]}
            spec.append((groups, [w, b, trunk] if rows or modules > 1 else [w, trunk]))
        plan = GradientNormPlan.for_modules(spec)
        plan.compute_all()  # the pattern's buffers and index
        with OpCounter() as counter:
            plan.compute_all()
        counts[modules] = (counter.ops, counter.num_host_reads)
    assert counts == {1: (7, 0), 8: (7, 0)}, counts


def test_per_head_grad_norms_without_any_gradient_are_nan_on_the_parameters_device():
    """No part has a gradient: every head is NaN ("no data", never 0); the device comes from the first
    part, which may be a row split (``ParamRows``) or a whole parameter."""
    from gradmon_ray.telemetry.head_norms import ParamRows

    w = torch.nn.Parameter(torch.zeros(4, 3))
    b = torch.nn.Parameter(torch.zeros(4))
    out = per_head_grad_norms({"op": [ParamRows(w, slice(0, 2))], "slot": [ParamRows(w, slice(2, 4)), b]})
    assert out.shape == (2,) and out.device == w.device and torch.isnan(out).tolist() == [True, True]
    out = per_head_grad_norms({"op": [b]})
    assert out.shape == (1,) and torch.isnan(out).tolist() == [True]
    assert per_head_grad_norms({}).shape == (0,)
    # rows 2..3 of w's gradient [[0,0,0],[0,0,0],[1,2,2],[0,3,4]]: sqrt(9 + 25) for "slot" with b's [0,0,0,0]
    w.grad = torch.tensor([[7.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 2.0, 2.0], [0.0, 3.0, 4.0]])
    b.grad = torch.zeros(4)
    out = per_head_grad_norms({"op": [ParamRows(w, slice(0, 2))], "slot": [ParamRows(w, slice(2, 4)), b]})
    assert out.tolist() == [7.0, pytest.approx(math.sqrt(34.0), rel=1e-6)]


def test_a_parameter_in_two_heads_is_refused_word_for_word():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"^a parameter belongs to two heads; head groups must be disjoint$"):
        GradientNormPlan({"a": [p], "b": [p]}, [p])
