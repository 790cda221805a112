"""``ParamRows`` heads (rows of a parameter) in ``GradientNormPlan`` and ``per_head_grad_norms``.

Oracle: numpy sums of squares over the same rows, sliced from the gradient arrays here (float64),
never through the product's slot assignment.  Bugs these catch: a row part's whole tensor
counted in its head (the rows of two heads then both see the full parameter), slices applied
to the wrong parameter after a gradient appears or disappears (index cache), the global norm
or the NaN/Inf counts taken over slices instead of whole tensors (double counting), a head
without any gradient reported as 0, overlapping heads accepted.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradmon_ray.telemetry import GradientNormPlan, per_head_grad_norms
from gradmon_ray.telemetry.head_norms import ParamRows


def _np_norm(*arrays: np.ndarray) -> float:
    return math.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in arrays))


def _grad_np(p: torch.nn.Parameter) -> np.ndarray:
    return p.grad.detach().double().numpy()


@pytest.fixture
def split_layer():
    """An output layer W [7, 3], b [7] split as rows 0:3 -> "a", 3:7 -> "b"; a whole parameter
    "c"; a trunk tensor.  Gradients seeded."""
    gen = torch.Generator().manual_seed(11)
    w, b = torch.nn.Parameter(torch.zeros(7, 3)), torch.nn.Parameter(torch.zeros(7))
    c, trunk = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(5))
    for p in (w, b, c, trunk):
        p.grad = torch.randn(p.shape, generator=gen)
    groups = {
        "a": [ParamRows(w, slice(0, 3)), ParamRows(b, slice(0, 3))],
        "b": [ParamRows(w, slice(3, 7)), ParamRows(b, slice(3, None))],
        "c": [c],
    }
    return groups, (w, b, c, trunk)


def test_row_heads_equal_numpy_and_global_norm_covers_whole_tensors(split_layer):
    groups, (w, b, c, trunk) = split_layer
    want_a = _np_norm(_grad_np(w)[0:3], _grad_np(b)[0:3])
    want_b = _np_norm(_grad_np(w)[3:7], _grad_np(b)[3:7])
    want_c = _np_norm(_grad_np(c))
    want_global = _np_norm(*(_grad_np(p) for p in (w, b, c, trunk)))
    result = GradientNormPlan(groups, [trunk, w, c, b]).compute()  # all_params in another order
    np.testing.assert_allclose(result.head_norms.numpy(), [want_a, want_b, want_c], rtol=1e-6)
    assert result.global_norm.item() == pytest.approx(want_global, rel=1e-6)
    assert result.nan_count.item() == 0 and result.inf_count.item() == 0
    np.testing.assert_allclose(per_head_grad_norms(groups).numpy(), [want_a, want_b, want_c], rtol=1e-6)


def test_global_norm_and_counts_do_not_depend_on_the_split(split_layer):
    groups, (w, b, c, trunk) = split_layer
    w.grad[5, 1] = float("inf")
    split = GradientNormPlan(groups, [w, b, c, trunk]).compute()
    whole = GradientNormPlan({"pi": [w, b], "c": [c]}, [w, b, c, trunk]).compute()
    assert (split.inf_count.item(), split.nan_count.item()) == (1.0, 0.0)  # counted once, not per row part
    assert split.global_norm.item() == whole.global_norm.item() == math.inf
    assert math.isinf(split.head_norms[1].item()) and math.isfinite(split.head_norms[0].item())


def test_nan_in_one_slice_poisons_that_head_only(split_layer):
    groups, (w, b, c, trunk) = split_layer
    b.grad[4] = float("nan")  # bias entry 4 belongs to head "b"
    result = GradientNormPlan(groups, [w, b, c, trunk]).compute()
    assert math.isnan(result.head_norms[1].item())
    assert result.head_norms[0].item() == pytest.approx(_np_norm(_grad_np(w)[0:3], _grad_np(b)[0:3]), rel=1e-6)
    assert result.head_norms[2].item() == pytest.approx(_np_norm(_grad_np(c)), rel=1e-6)
    assert math.isnan(result.global_norm.item()) and result.nan_count.item() == 1.0
    assert result.found_nonfinite.item() == 1.0
    reference = per_head_grad_norms(groups)
    assert math.isnan(reference[1].item()) and not math.isnan(reference[0].item())


def test_nan_in_rows_no_head_takes_is_trunk():
    w = torch.nn.Parameter(torch.zeros(6, 2))
    w.grad = torch.arange(12.0).reshape(6, 2)
    w.grad[5, 0] = float("nan")  # row 5: no head
    groups = {"a": [ParamRows(w, slice(0, 2))], "b": [ParamRows(w, slice(2, 4))]}
    result = GradientNormPlan(groups, [w]).compute()
    assert result.head_norms.tolist() == pytest.approx([math.sqrt(0 + 1 + 4 + 9), math.sqrt(16 + 25 + 36 + 49)])
    assert math.isnan(result.global_norm.item()) and result.nan_count.item() == 1.0


def test_a_head_without_gradients_is_nan_and_the_cache_follows_new_gradients(split_layer):
    groups, (w, b, c, trunk) = split_layer
    plan = GradientNormPlan(groups, [w, b, c, trunk])
    b_grad = b.grad
    w.grad, b.grad = None, None  # the split layer got no gradient: heads a and b have none
    first = plan.compute()
    assert math.isnan(first.head_norms[0].item()) and math.isnan(first.head_norms[1].item())
    assert first.head_norms[2].item() == pytest.approx(_np_norm(_grad_np(c)), rel=1e-6)
    assert first.global_norm.item() == pytest.approx(_np_norm(_grad_np(c), _grad_np(trunk)), rel=1e-6)
    b.grad = b_grad  # only the bias now: a and b from their bias entries alone
    second = plan.compute()
    np.testing.assert_allclose(
        second.head_norms.numpy(), [_np_norm(b_grad.numpy()[:3]), _np_norm(b_grad.numpy()[3:]), first.head_norms[2]]
    )
    per_head = per_head_grad_norms(groups)
    np.testing.assert_allclose(per_head.numpy(), second.head_norms.numpy(), rtol=1e-6)


def _module_with_a_split_layer(gen: torch.Generator, rows: int):
    """A module as a learner sees it: an output layer W [rows, 2] split by rows between "a" (the
    first two rows) and "b" (the rest), a whole head "c" and a trunk tensor; gradients seeded."""
    w, c, trunk = (torch.nn.Parameter(torch.zeros(shape)) for shape in ((rows, 2), (3,), (4,)))
    for p in (trunk, w, c):
        p.grad = torch.randn(p.shape, generator=gen)
    groups = {"a": [ParamRows(w, slice(0, 2))], "b": [ParamRows(w, slice(2, rows))], "c": [c]}
    return groups, [trunk, w, c]


def test_row_heads_of_every_module_of_a_batched_plan_take_their_own_modules_rows():
    """``GradientNormPlan.for_modules``: each module's row heads are sliced from that module's own
    layer (module 1's layer sits at a different position of the plan's parameters than at its
    module's), and its global norm and counts cover its own tensors.  Oracle: numpy per module."""
    gen = torch.Generator().manual_seed(5)
    modules = [_module_with_a_split_layer(gen, rows) for rows in (5, 5, 5)]
    modules[2][1][0].grad[1] = float("nan")  # module 2's trunk: one NaN, no head sees it
    result = GradientNormPlan.for_modules(modules).compute_all()
    assert result.head_norms.shape == (9,) and result.global_norm.shape == (3,)
    for m, (_, (_, w, c)) in enumerate(modules):
        want = [_np_norm(_grad_np(w)[:2]), _np_norm(_grad_np(w)[2:]), _np_norm(_grad_np(c))]
        np.testing.assert_allclose(result.head_norms[3 * m : 3 * m + 3].numpy(), want, rtol=1e-6, err_msg=str(m))
    for m in (0, 1):
        want_global = _np_norm(*(_grad_np(p) for p in modules[m][1]))
        assert result.global_norm[m].item() == pytest.approx(want_global, rel=1e-6), m
    assert math.isnan(result.global_norm[2].item())
    assert result.nan_count.tolist() == [0.0, 0.0, 1.0] and result.inf_count.tolist() == [0.0, 0.0, 0.0]


def test_param_rows_validate_and_normalise():
    w = torch.nn.Parameter(torch.zeros(4, 2))
    assert ParamRows(w, slice(None, 2)).rows == slice(0, 2)
    assert ParamRows(w, slice(1, None)).rows == slice(1, 4)
    for bad in (slice(2, 2), slice(3, 5), slice(-1, None), slice(0, 4, 2)):
        with pytest.raises(ValueError, match=r"non-empty slice\(start, stop\) within 0\.\.4"):
            ParamRows(w, bad)
    with pytest.raises(ValueError, match="at least one dimension"):
        ParamRows(torch.nn.Parameter(torch.tensor(1.0)), slice(0, 1))
    assert ParamRows(w, slice(0, 1)) != ParamRows(w, slice(0, 1))  # identity, not tensor, equality
    assert ParamRows(w, slice(0, 1)).grad() is None


def test_overlapping_or_mixed_row_heads_are_refused():
    w, other = torch.nn.Parameter(torch.zeros(5, 2)), torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"rows 0:3 \(head 'a'\) and 2:5 \(head 'b'\) .* overlap"):
        GradientNormPlan({"a": [ParamRows(w, slice(0, 3))], "b": [ParamRows(w, slice(2, 5))]}, [w])
    with pytest.raises(ValueError, match=r"taken whole by head 'a' and by rows by head 'b'"):
        GradientNormPlan({"a": [w], "b": [ParamRows(w, slice(0, 2))]}, [w])
    with pytest.raises(ValueError, match="all_params"):
        GradientNormPlan({"a": [ParamRows(w, slice(0, 2))]}, [other])
    adjacent = {"a": [ParamRows(w, slice(0, 2))], "b": [ParamRows(w, slice(2, 5))]}
    assert GradientNormPlan(adjacent, [w]).head_names == ("a", "b")


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(2, 9), cols=st.integers(1, 4), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_random_row_splits_equal_numpy(rows, cols, seed, data):
    """Property: any split of a layer's rows into heads (some rows left to the trunk) = numpy."""
    gen = torch.Generator().manual_seed(seed)
    w, b = torch.nn.Parameter(torch.zeros(rows, cols)), torch.nn.Parameter(torch.zeros(rows))
    w.grad, b.grad = torch.randn(rows, cols, generator=gen), torch.randn(rows, generator=gen)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, rows), min_size=2, max_size=5))))
    spans = [(lo, hi) for lo, hi in itertools.pairwise(cuts) if data.draw(st.booleans())] or [(0, rows)]
    groups = {f"h{i}": [ParamRows(w, slice(lo, hi)), ParamRows(b, slice(lo, hi))] for i, (lo, hi) in enumerate(spans)}
    result = GradientNormPlan(groups, [w, b]).compute()
    want = [_np_norm(_grad_np(w)[lo:hi], _grad_np(b)[lo:hi]) for lo, hi in spans]
    np.testing.assert_allclose(result.head_norms.numpy(), want, rtol=1e-5)
    np.testing.assert_allclose(per_head_grad_norms(groups).numpy(), want, rtol=1e-5)
    assert result.global_norm.item() == pytest.approx(_np_norm(_grad_np(w), _grad_np(b)), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_row_heads_on_cuda_do_not_sync():
    dev = torch.device("cuda")
    w, b = torch.nn.Parameter(torch.randn(7, 3, device=dev)), torch.nn.Parameter(torch.randn(7, device=dev))
    for p in (w, b):
        p.grad = torch.randn_like(p)
    groups = {"a": [ParamRows(w, slice(0, 3)), ParamRows(b, slice(0, 3))], "b": [ParamRows(w, slice(3, 7))]}
    plan = GradientNormPlan(groups, [w, b])
    plan.compute()  # builds (and caches) the index tensors from host data
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = plan.compute()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = [_np_norm(w.grad.cpu().numpy()[:3], b.grad.cpu().numpy()[:3]), _np_norm(w.grad.cpu().numpy()[3:])]
    np.testing.assert_allclose(result.head_norms.cpu().numpy(), want, rtol=1e-5)


def test_overlap_errors_name_the_heads_by_row_start_then_declaration_order():
    """Row parts are ordered by their start row only (a stable sort): two heads starting at the same
    row are named in the order the heads were declared, not by where their rows stop."""
    w = torch.nn.Parameter(torch.zeros(5, 2))
    with pytest.raises(ValueError) as err:
        GradientNormPlan({"a": [ParamRows(w, slice(0, 5))], "b": [ParamRows(w, slice(0, 3))]}, [w])
    assert str(err.value) == (
        "rows 0:5 (head 'a') and 0:3 (head 'b') of a parameter of shape (5, 2) overlap; head groups must be disjoint"
    )
