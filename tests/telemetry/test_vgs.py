"""VarianceGradientScaler: the seed's six tests (test 2's flaw fixed), worked answers, properties."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry import VarianceGradientScaler
from gradmon_ray.vgs import kernels
from gradmon_ray.vgs.scaler import DEVICE_METRICS, OLD_CHECKPOINT_WARNING, analytic_normalized_variance_of_abs
from tests.telemetry.vgs_oracle import assert_vgs_metrics_close, numpy_vgs_metrics

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
    assert torch.isfinite(vgs.state_dict()["param_grad_mean_ema"]).all()
    assert math.isfinite(vgs.get_normalized_variance())


def test_before_any_update_everything_is_zero_and_finite():
    vgs = VarianceGradientScaler([torch.nn.Parameter(torch.zeros(4))], warmup_steps=0)
    metrics = vgs.get_metrics()
    assert set(metrics) == {*DEVICE_METRICS, "vgs/step_count", "vgs/warmup_active"}
    assert vgs.get_normalized_variance() == 0.0 and vgs.get_scaling_factor() == 1.0
    assert all(math.isfinite(v) for v in metrics.values())


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


# --- seed test 5 and state -------------------------------------------------------------------
def test_5_old_checkpoint_warns_resets_and_training_continues():
    p = torch.nn.Parameter(torch.zeros(3))
    vgs = VarianceGradientScaler([p], warmup_steps=0)
    old = {
        "enabled": True,
        "beta": 0.9,
        "alpha": 0.2,
        "eps": 1e-8,
        "warmup_steps": 5,
        "step_count": 40,
        "grad_mean_ema": 0.1,
        "grad_var_ema": 0.2,
        "grad_norm_ema": 0.3,
        "grad_max_ema": 0.4,
    }
    with pytest.warns(UserWarning) as record:
        vgs.load_state_dict(old)
    assert str(record[0].message) == OLD_CHECKPOINT_WARNING
    assert vgs.beta == 0.9 and vgs.step_count == 40
    assert vgs._mean_ema.abs().sum().item() == 0.0 and vgs.state_dict()["stat_steps"] == 0.0
    assert vgs.get_metrics()["vgs/grad_norm_ema"] == pytest.approx(0.3)
    for i in range(5):
        p.grad = torch.tensor([1.0, 2.0, 3.0]) * (1 + 0.1 * i)
        vgs.scale_gradients()
        vgs.step()
    assert 0.0 < vgs.get_normalized_variance() < 1.0 and vgs.state_dict()["stat_steps"] == 5.0


@pytest.mark.parametrize("granularity", ["element", "tensor"])
def test_state_round_trip_is_exact(granularity):
    torch.manual_seed(3)
    ps = [torch.nn.Parameter(torch.zeros(4, 2)), torch.nn.Parameter(torch.zeros(3))]
    vgs = VarianceGradientScaler(ps, granularity=granularity, warmup_steps=1)
    _feed(vgs, ps, [(torch.randn(4, 2), torch.randn(3)) for _ in range(7)])
    clone = VarianceGradientScaler(ps, granularity=granularity)
    clone.load_state_dict(vgs.state_dict())
    assert clone.get_metrics() == vgs.get_metrics()


def test_mismatched_checkpoint_raises_clear_errors():
    vgs = VarianceGradientScaler([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))])
    other = VarianceGradientScaler([torch.nn.Parameter(torch.zeros(5))])
    with pytest.raises(
        ValueError, match=r"1 parameter tensors with sizes \[5\]; this scaler has 2 with sizes \[4, 3\]"
    ):
        vgs.load_state_dict(other.state_dict())
    tensorwise = VarianceGradientScaler(
        [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))], granularity="tensor"
    )
    with pytest.raises(ValueError, match="granularity 'tensor'"):
        vgs.load_state_dict(tensorwise.state_dict())


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


# --- undefined entries: NaN ignored, +Inf as the cap, none left -> the cautious fallback ----------
MAX_NV = 1e6


def _numpy_nv(mean_ema: np.ndarray, sq_ema: np.ndarray, steps: float, beta: float, eps: float) -> np.ndarray:
    """The normalized variance per entry from a state's EMAs, in float64 (NaN propagates), capped at 1e6."""
    with np.errstate(invalid="ignore", over="ignore"):
        correction = 1 - beta**steps
        a, b = mean_ema / correction, sq_ema / correction
        nv = np.maximum(b - a * a, 0.0) / (a * a + eps)
    return np.where(np.isnan(nv), np.nan, np.minimum(nv, MAX_NV))


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
