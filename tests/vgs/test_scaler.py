"""``vgs/scaler.py``: the seed's tests 1-4 and 6 (test 2's flaw fixed), worked answers, properties.

Seed test 5 and the state round trip: ``test_checkpoint.py``; undefined (NaN/Inf) entries:
``test_aggregation.py``; every ``vgs/*`` metric against the numpy re-implementation: ``test_reporting.py``.
"""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradmon_ray import metric_names as mn
from gradmon_ray.vgs import VarianceGradientScaler
from gradmon_ray.vgs.scaler import analytic_normalized_variance_of_abs
from tests.vgs.vgs_oracle import assert_same_vgs_state, assert_vgs_metrics_close, numpy_vgs_metrics

ROOT = Path(__file__).resolve().parents[2]


def _seed_vgs_class():
    spec = importlib.util.spec_from_file_location("seed_vgs", ROOT / "bench" / "seed_vgs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SeedVarianceGradientScaler


def _per_tensor_nv(vgs):
    return vgs._per_tensor_means(vgs._normalized_entries())


def _feed(vgs, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        vgs.scale_gradients()
        vgs.step()


# --- seed test 1 ---------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["element", "tensor"])
def test_1_per_parameter_stochastic_variance(granularity):
    torch.manual_seed(0)
    p1, p2 = torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(100))
    vgs = VarianceGradientScaler([p1, p2], granularity=granularity)
    _feed(vgs, [p1, p2], [(torch.randn(100) * 0.1 + 1.0, torch.randn(100) * 2.0 + 1.0) for _ in range(20)])
    nv = _per_tensor_nv(vgs)
    assert nv.shape == (2,)
    assert nv[1] > nv[0]  # noisy param2 above stable param1


# --- seed test 2, flaw fixed ---------------------------------------------------------------
def test_2_stable_gradients_of_different_scales_low_stochastic_high_spatial():
    """The seed used noise std == mean for layer1 (temporal nv ~0.5, so its own assertion
    could not hold). Here both layers are genuinely stable over time (noise 1% of scale) but
    very uneven across elements and of opposite signs: temporal variance ~0, spatial high."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"layer1": torch.nn.Linear(10, 10), "layer2": torch.nn.Linear(10, 10)})
    vgs = VarianceGradientScaler(model.parameters(), warmup_steps=0)
    signs = {n: torch.randint(0, 2, p.shape).float() * 2 - 1 for n, p in model.named_parameters()}
    for _ in range(20):
        for name, p in model.named_parameters():
            scale = 0.01 if name.startswith("layer1") else 1.0
            p.grad = signs[name] * scale * (1 + 0.01 * torch.randn_like(p))
        vgs.scale_gradients()
        vgs.step()
    assert vgs.get_normalized_variance() < 0.1
    stats = vgs.compute_gradient_statistics()
    assert stats["grad_var"] / (stats["grad_mean"] ** 2 + 1e-8) > 1.0


def test_constant_uneven_gradients_have_zero_temporal_variance():
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.zeros(500))
    pattern = torch.randn(500) * torch.logspace(-3, 3, 500)  # six orders of magnitude apart
    for granularity in ("element", "tensor"):
        vgs = VarianceGradientScaler([p], granularity=granularity, warmup_steps=0)
        _feed(vgs, [p], [(pattern,)] * 30)
        assert vgs.get_normalized_variance() < 1e-5
        assert vgs.get_scaling_factor() == pytest.approx(1.0, abs=1e-6)


# --- seed test 3: all aggregation methods against hand-computed values ---------------------
# Two steps, beta = 0.5: a = (|g1| + 2|g2|)/3, b = (g1^2 + 2 g2^2)/3, nv = (b - a^2)/a^2.
# Tensor A = [(1,1), (1,-1)] -> nv 0, 0.  Tensor B = [(0,3), (3,0), (2,4)] -> nv 0.5, 2, 0.08.
STEP1 = (torch.tensor([1.0, 1.0]), torch.tensor([0.0, 3.0, 2.0]))
STEP2 = (torch.tensor([1.0, -1.0]), torch.tensor([3.0, 0.0, 4.0]))


@pytest.mark.parametrize(
    ("granularity", "method", "expected"),
    [
        ("element", "p90", 0.5 + 0.6 * (2.0 - 0.5)),  # sorted [0,0,.08,.5,2], rank 3.6
        ("element", "mean", (0.0 + (0.5 + 2.0 + 0.08) / 3) / 2),  # mean of per-tensor means
        ("element", "weighted_mean", (0.5 + 2.0 + 0.08) / 5),  # mean over all elements
        # tensor: s_A = 1, 1 -> 0;  s_B = 5/3, 7/3 -> a = 19/9, b = 41/9, nv = 8/361
        ("tensor", "p90", 0.9 * 8 / 361),
        ("tensor", "mean", (8 / 361) / 2),
        ("tensor", "weighted_mean", (8 / 361) * 3 / 5),
    ],
)
def test_3_aggregation_methods_hand_computed(granularity, method, expected):
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    vgs = VarianceGradientScaler(
        [a, b], beta=0.5, alpha=0.1, warmup_steps=0, aggregation_method=method, granularity=granularity
    )
    _feed(vgs, [a, b], [STEP1, STEP2])
    assert vgs.get_normalized_variance() == pytest.approx(expected, rel=1e-5)
    assert vgs.get_scaling_factor() == pytest.approx(1.0 / (1.0 + 0.1 * expected), rel=1e-5)


def test_scale_is_applied_to_grads_after_warmup_only_and_clamped():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    vgs = VarianceGradientScaler([a, b], beta=0.5, alpha=1e9, warmup_steps=2)
    a.grad, b.grad = STEP1[0].clone(), STEP1[1].clone()
    assert vgs.scale_gradients().item() == 1.0 and torch.equal(b.grad, STEP1[1])  # warmup
    vgs.step()
    a.grad, b.grad = STEP2[0].clone(), STEP2[1].clone()
    vgs.scale_gradients()
    vgs.step()
    assert torch.equal(b.grad, STEP2[1])  # step_count was 1 < 2: still warmup
    b.grad = STEP2[1].clone()
    scale = vgs.scale_gradients()
    assert scale.item() == pytest.approx(1e-4)  # 1/(1 + 1e9 * nv) clamped at 1e-4
    torch.testing.assert_close(b.grad, STEP2[1] * 1e-4)


def test_disabled_is_a_true_no_op():
    p = torch.nn.Parameter(torch.zeros(3))
    vgs = VarianceGradientScaler([p], enabled=False, warmup_steps=0)
    before = vgs.state_dict()
    p.grad = torch.tensor([1.0, float("nan"), 3.0])
    assert vgs.scale_gradients().item() == 1.0
    vgs.step()
    assert torch.equal(p.grad[[0, 2]], torch.tensor([1.0, 3.0]))
    after = vgs.state_dict()
    assert after["step_count"] == 0 and torch.equal(after["param_grad_mean_ema"], before["param_grad_mean_ema"])


def test_skipped_step_leaves_statistics_untouched_and_nan_never_poisons():
    p = torch.nn.Parameter(torch.zeros(3))
    vgs = VarianceGradientScaler([p], warmup_steps=0)
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    vgs.scale_gradients()
    snapshot = vgs.state_dict()
    p.grad = torch.tensor([float("nan"), float("inf"), 1.0])
    vgs.scale_gradients(skip=torch.tensor(1.0))
    after = vgs.state_dict()
    assert torch.equal(after["param_grad_mean_ema"], snapshot["param_grad_mean_ema"])
    assert after["stat_steps"] == snapshot["stat_steps"] == 1.0
    p.grad = torch.tensor([float("nan"), 1.0, 1.0])  # not flagged: NaN entry is zeroed, not stored
    vgs.scale_gradients()
    # Closed form, beta 0.99 from zero: two applied updates, |g| = [1, 2, 3] then [0, 1, 1].
    beta, eps = 0.99, 1e-8
    mean = beta * (1 - beta) * np.array([1.0, 2.0, 3.0]) + (1 - beta) * np.array([0.0, 1.0, 1.0])
    sq = beta * (1 - beta) * np.array([1.0, 4.0, 9.0]) + (1 - beta) * np.array([0.0, 1.0, 1.0])
    state = vgs.state_dict()
    np.testing.assert_allclose(state["param_grad_mean_ema"].double().numpy(), mean, rtol=1e-6)
    np.testing.assert_allclose(state["param_grad_sq_ema"].double().numpy(), sq, rtol=1e-6)
    a, b = mean / (1 - beta**2), sq / (1 - beta**2)
    nv = np.maximum(b - a * a, 0.0) / (a * a + eps)
    assert vgs.get_normalized_variance() == pytest.approx(float(np.quantile(nv, 0.9)), rel=1e-5)  # p90


def test_before_any_update_every_metric_is_zero_and_the_factor_one():
    vgs = VarianceGradientScaler([torch.nn.Parameter(torch.zeros(4))], warmup_steps=0)
    zero = (
        mn.VGS_STOCHASTIC_VAR_P10,
        mn.VGS_STOCHASTIC_VAR_P50,
        mn.VGS_STOCHASTIC_VAR_P90,
        mn.VGS_STOCHASTIC_VAR_MEAN,
        mn.VGS_GRAD_NORM_EMA,
        mn.VGS_GRAD_MEAN_EMA,
        mn.VGS_GRAD_VAR_EMA,
        mn.VGS_GRAD_MAX_EMA,
        mn.VGS_NORMALIZED_VARIANCE,
        mn.VGS_STEP_COUNT,
        mn.VGS_WARMUP_ACTIVE,  # warmup_steps 0: never in warmup
    )
    assert vgs.get_metrics() == {**dict.fromkeys(zero, 0.0), mn.VGS_SCALING_FACTOR: 1.0}
    assert vgs.get_normalized_variance() == 0.0 and vgs.get_scaling_factor() == 1.0


# --- property: converges to the analytic value; constants give 0 ----------------------------
@settings(max_examples=8, deadline=None)
@given(mean=st.floats(-2.0, 2.0), std=st.floats(0.2, 2.0), seed=st.integers(0, 1000))
def test_iid_gradients_converge_to_the_analytic_normalized_variance(mean, std, seed):
    """With beta=0.99 and 800 steps over 4000 elements, the element-mean of nv is within 8% of
    E[g^2]/E[|g|]^2 - 1 for g ~ N(mean, std^2) (the EMA's own bias is ~0.5%)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.zeros(4000))
    vgs = VarianceGradientScaler([p], beta=0.99, aggregation_method="weighted_mean", warmup_steps=10**9)
    for _ in range(800):
        p.grad = mean + std * torch.randn(4000, generator=gen)
        vgs.update_statistics()
    expected = analytic_normalized_variance_of_abs(mean, std)
    assert vgs.get_normalized_variance() == pytest.approx(expected, rel=0.08)


def test_analytic_helper_worked_values():
    assert analytic_normalized_variance_of_abs(0.0, 1.0) == pytest.approx(math.pi / 2 - 1)  # half-normal
    assert analytic_normalized_variance_of_abs(1.0, 0.0) == 0.0
    assert analytic_normalized_variance_of_abs(100.0, 1.0) == pytest.approx(1e-4, rel=1e-3)  # ~ (std/mean)^2


def test_percentiles_use_a_fixed_sample_when_large():
    p = torch.nn.Parameter(torch.zeros(5000))
    vgs = VarianceGradientScaler([p], quantile_sample_size=1000, warmup_steps=0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        p.grad = 1.0 + torch.randn(5000, generator=gen) * torch.linspace(0.0, 2.0, 5000)
        vgs.update_statistics()
    exact = torch.nanquantile(vgs._normalized_entries(), 0.9).item()
    assert vgs._sample.numel() == 1000
    assert vgs.get_normalized_variance() == pytest.approx(exact, rel=0.1)
    again = VarianceGradientScaler([p], quantile_sample_size=1000)
    assert torch.equal(again._sample, vgs._sample)  # same sample on every replica


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_one_pass_sampled_step_returns_the_factor_of_the_statistics_after_that_step(compile_mode):
    """Element granularity, p90 over a sample: the factor is computed BEFORE the single pass
    that folds and scales, from the sampled entries as they will be after it.  Every step's
    returned factor and scaled gradients must equal the numpy VGS fed the steps so far, with
    percentiles over the same sampled entries (a skipped non-finite step included)."""
    shapes = [(30, 20), (20,), (7, 20)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    settings = {"beta": 0.9, "alpha": 2.0, "eps": 1e-8, "warmup_steps": 3}
    vgs = VarianceGradientScaler(params, quantile_sample_size=97, compile=compile_mode, **settings)
    sample = vgs._sample.cpu().numpy()
    total = sum(p.numel() for p in params)
    assert len(set(sample.tolist())) == 97 and sample.min() >= 0 and sample.max() < total  # distinct, in range
    gen = torch.Generator().manual_seed(7)
    centre = [torch.randn(s, generator=gen) for s in shapes]
    fed, skipped = [], []
    for step in range(10):
        grads = [c + (0.3 + step % 4) * torch.randn(c.shape, generator=gen) for c in centre]
        if step == 6:
            grads[1][3] = float("nan")
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        skip = step == 6
        factor = float(vgs.scale_gradients(skip=torch.tensor(float(skip))))
        vgs.step()
        fed.append([g.numpy() for g in grads])
        skipped.append(skip)
        want = numpy_vgs_metrics(fed, skipped=skipped, sample=sample, **settings)[mn.VGS_SCALING_FACTOR]
        if step < settings["warmup_steps"]:  # the warmup clock advances after the step
            want = 1.0
        assert factor == pytest.approx(want, rel=1e-5), step
        if not skip:
            for p, g in zip(params, grads, strict=True):
                torch.testing.assert_close(p.grad, g * want, rtol=1e-5, atol=1e-7)
    assert factor < 0.9  # the factor really acts
    # Every reported metric too: percentiles and the legacy spatial statistics over the sample.
    assert_vgs_metrics_close(vgs.get_metrics(), numpy_vgs_metrics(fed, skipped=skipped, sample=sample, **settings))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"aggregation_method": "p95"}, "aggregation_method"),
        ({"granularity": "layer"}, "granularity"),
        ({"beta": 1.0}, "beta"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VarianceGradientScaler([torch.nn.Parameter(torch.zeros(1))], **kwargs)


# --- seed test 6: old vs new on the same run ---------------------------------------------------
def _run_both(grads_for_step, steps, params, warmup=10):
    seed_cls = _seed_vgs_class()
    old = seed_cls(params, warmup_steps=warmup)
    new = VarianceGradientScaler(params, warmup_steps=warmup)
    trace = []
    for step in range(steps):
        grads = grads_for_step(step)
        row = []
        for vgs in (old, new):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            row.append(float(vgs.scale_gradients()))
            vgs.step()
        trace.append(row)
    return old, new, trace


def test_6_old_vs_new_on_the_same_gradients():
    """Same gradients through the seed's VGS (bench/seed_vgs.py) and this one.

    Stable but uneven gradients (noise 2% of each element's value, scales 0.1 and 10): the
    seed reads the spread inside each tensor as noise once its bias correction has decayed,
    and shrinks every gradient; the temporal VGS sees ~0.  Noisy gradients (std = 2 x mean):
    the seed reports nv = 0 for the first hundreds of steps, because it initialises its EMAs
    with the first value *and* bias-corrects them (a^2 grows like 1/bc^2, b like 1/bc, the
    variance clamps to 0); the temporal VGS reports the analytic value from the start."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    params = list(model.parameters())
    base = [torch.randn_like(p) * (10.0 if i >= 2 else 0.1) for i, p in enumerate(params)]

    def stable(_):
        return [b * (1 + 0.02 * torch.randn_like(b)) for b in base]

    old, new, trace = _run_both(stable, 800, params)
    old_nv, new_nv = old.get_normalized_variance(), new.get_normalized_variance()
    print(
        f"\nstable, 800 steps: seed nv={old_nv:.4f} scale={trace[-1][0]:.4f} | "
        f"temporal nv={new_nv:.6f} scale={trace[-1][1]:.6f}"
    )
    assert old_nv > 0.3 and trace[-1][0] < 0.97
    assert new_nv < 0.01 and trace[-1][1] > 0.999

    def noisy(_):
        return [1.0 + 2.0 * torch.randn_like(b) for b in base]

    old, new, trace = _run_both(noisy, 60, params)
    old_nv, new_nv = old.get_normalized_variance(), new.get_normalized_variance()
    expected = analytic_normalized_variance_of_abs(1.0, 2.0)
    print(
        f"noisy, 60 steps: seed nv={old_nv:.4f} scale={trace[-1][0]:.4f} | temporal nv={new_nv:.4f} "
        f"scale={trace[-1][1]:.4f} | analytic {expected:.4f}"
    )
    assert old_nv == 0.0 and trace[-1][0] == 1.0
    assert new_nv == pytest.approx(expected, rel=0.25) and trace[-1][1] < 0.97


def test_alpha_zero_is_allowed_and_never_scales():
    """alpha = 0 is the documented lower end: the factor 1 / (1 + 0 * nv) is exactly 1 however noisy
    the gradients, and the gradients pass unscaled."""
    p = torch.nn.Parameter(torch.zeros(3))
    vgs = VarianceGradientScaler([p], alpha=0.0, warmup_steps=0)
    for g in ([1.0, -2.0, 3.0], [-4.0, 0.5, 0.0], [2.0, 2.0, -1.0]):
        p.grad = torch.tensor(g)
        factor = vgs.scale_gradients()
        vgs.step()
        assert factor.item() == 1.0 and p.grad.tolist() == g
    assert vgs.get_scaling_factor() == 1.0


@pytest.mark.parametrize("kwargs", [{"alpha": -0.1}, {"eps": 0.0}, {"warmup_steps": -1}, {"quantile_sample_size": 0}])
def test_bad_settings_are_refused_with_the_documented_message(kwargs):
    with pytest.raises(ValueError, match=r"^need alpha >= 0, eps > 0, warmup_steps >= 0, quantile_sample_size >= 1$"):
        VarianceGradientScaler([torch.nn.Parameter(torch.zeros(2))], **kwargs)


# --- a step without any gradient (a module absent from a sparse multi-agent minibatch) ---------
@pytest.mark.parametrize("scale_gradients", [True, False], ids=["gradient", "update"])
@pytest.mark.parametrize(
    "case",
    [
        {"aggregation_method": "p90"},  # exact percentiles (fewer entries than the sample)
        {"aggregation_method": "p90", "quantile_sample_size": 37},  # the one-pass sampled step
        {"aggregation_method": "mean"},
        {"aggregation_method": "weighted_mean", "granularity": "tensor"},
        {"aggregation_method": "p90", "granularity": "tensor"},
    ],
    ids=["p90-exact", "p90-sampled", "mean", "weighted_mean-tensor", "p90-tensor"],
)
def test_a_step_without_any_gradient_is_left_out_entirely(case, scale_gradients):
    """Steps in which every ``p.grad`` is None, between real ones: each leaves the state exactly as
    it was (statistics, applied-update counters, warmup clock: no zeros folded in, no warmup step),
    returns a factor of 1 and creates no gradient; after the stream every ``vgs/*`` metric equals
    the numpy VGS fed only the real steps.  (Before: ``RuntimeError: Tensor list must have at least
    one tensor`` on the unsampled gradient path; elsewhere zeros folded and the clock advanced.)"""
    shapes = [(6, 5), (5,), (3, 4)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    common = {"beta": 0.8, "alpha": 3.0, "eps": 1e-8, "warmup_steps": 3}
    vgs = VarianceGradientScaler(params, **common, **case)
    gen = torch.Generator().manual_seed(5)
    centre = [torch.randn(s, generator=gen) for s in shapes]
    fed = []
    for step in range(9):
        if step in (1, 3, 4, 7):  # no gradient at all
            for p in params:
                p.grad = None
            before = copy.deepcopy(vgs.state_dict())
            if step == 4:
                vgs.update_statistics()
            else:
                assert float(vgs.observe(scale_gradients=scale_gradients)) == 1.0
            vgs.step()
            assert_same_vgs_state(vgs.state_dict(), before, f"step {step}")
            assert all(p.grad is None for p in params)
            continue
        grads = [c * (1 + (0.2 + step % 3) * torch.randn(c.shape, generator=gen)) for c in centre]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        vgs.observe(scale_gradients=scale_gradients)
        vgs.step()
        fed.append([g.numpy() for g in grads])
    sample = vgs._sample.cpu().numpy() if vgs._sample is not None else None
    assert (sample is not None) == ("quantile_sample_size" in case)
    oracle = {k: v for k, v in case.items() if k != "quantile_sample_size"}
    expected = numpy_vgs_metrics(fed, sample=sample, **common, **oracle)
    assert expected[mn.VGS_STEP_COUNT] == 5 and expected[mn.VGS_SCALING_FACTOR] < 0.99  # past warmup: it acts
    assert_vgs_metrics_close(vgs.get_metrics(), expected)
