"""``vgs/checkpoint.py``: the seed's checkpoint format (seed test 5: an old spatial state warns and
resets), exact round trips, and the errors of a checkpoint that does not fit."""

from __future__ import annotations

import pytest
import torch

from gradmon_ray import metric_names as mn
from gradmon_ray.vgs import VarianceGradientScaler
from gradmon_ray.vgs.scaler import OLD_CHECKPOINT_WARNING
from tests.vgs.vgs_oracle import numpy_vgs_metrics


def _feed(vgs, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        vgs.scale_gradients()
        vgs.step()


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
    stream = []
    for i in range(5):
        g = torch.tensor([1.0, 2.0, 3.0]) * (1 + 0.1 * i)
        p.grad = g.clone()
        vgs.scale_gradients()
        vgs.step()
        stream.append([g.numpy()])
    assert vgs.state_dict()["stat_steps"] == 5.0  # the statistics restarted from zero ...
    # ... with the checkpoint's settings (beta 0.9, alpha 0.2): the numpy VGS on those 5 steps alone
    want = numpy_vgs_metrics(stream, beta=0.9, alpha=0.2, eps=1e-8, warmup_steps=5)
    assert vgs.get_normalized_variance() == pytest.approx(want[mn.VGS_NORMALIZED_VARIANCE], rel=1e-4)
    assert vgs.get_scaling_factor() == pytest.approx(want[mn.VGS_SCALING_FACTOR], rel=1e-6)


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


def test_settings_travel_with_the_checkpoint_into_a_default_scaler():
    """A scaler saved with non-default alpha, eps and aggregation, restored into a default one, takes
    those settings from the checkpoint (not from its constructor) and reports what the source reports."""
    torch.manual_seed(5)
    ps = [torch.nn.Parameter(torch.zeros(4, 2)), torch.nn.Parameter(torch.zeros(3))]
    src = VarianceGradientScaler(ps, alpha=0.3, eps=1e-3, aggregation_method="mean", warmup_steps=1)
    _feed(src, ps, [(torch.randn(4, 2), torch.randn(3)) for _ in range(6)])
    dst = VarianceGradientScaler(ps)
    assert (dst.alpha, dst.eps, dst.aggregation_method) == (0.1, 1e-8, "p90")
    dst.load_state_dict(src.state_dict())
    assert (dst.alpha, dst.eps, dst.aggregation_method, dst.warmup_steps) == (0.3, 1e-3, "mean", 1)
    assert dst.get_metrics() == src.get_metrics()


def test_a_state_without_granularity_is_a_seed_tensor_state():
    """The seed's format has no ``granularity`` key: its statistics are per tensor, so it loads into a
    ``granularity="tensor"`` scaler and is refused by an element one."""
    torch.manual_seed(6)
    ps = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))]
    src = VarianceGradientScaler(ps, granularity="tensor", warmup_steps=0)
    _feed(src, ps, [(torch.randn(4), torch.randn(3)) for _ in range(5)])
    seed_state = {k: v for k, v in src.state_dict().items() if k != "granularity"}
    dst = VarianceGradientScaler(ps, granularity="tensor")
    dst.load_state_dict(seed_state)
    assert dst.get_metrics() == src.get_metrics()
    with pytest.raises(ValueError, match=r"^VGS checkpoint has granularity 'tensor', this scaler uses 'element'$"):
        VarianceGradientScaler(ps).load_state_dict(seed_state)


@pytest.mark.parametrize(("count", "shown"), [(8, "[1, 1, 1, 1, 1, 1, 1, 1]"), (9, "[1, 1, 1, 1, 1, 1, 1, 1]...")])
def test_size_mismatch_message_elides_only_past_eight_tensors(count, shown):
    ckpt = VarianceGradientScaler([torch.nn.Parameter(torch.zeros(1)) for _ in range(count)]).state_dict()
    with pytest.raises(ValueError) as err:
        VarianceGradientScaler([torch.nn.Parameter(torch.zeros(5))]).load_state_dict(ckpt)
    assert (
        str(err.value)
        == f"VGS checkpoint is for {count} parameter tensors with sizes {shown}; this scaler has 1 with sizes [5]"
    )
    many = VarianceGradientScaler([torch.nn.Parameter(torch.zeros(2)) for _ in range(count)])
    with pytest.raises(ValueError) as err:
        many.load_state_dict(VarianceGradientScaler([torch.nn.Parameter(torch.zeros(5))]).state_dict())
    this = shown.replace("1", "2")
    assert (
        str(err.value)
        == f"VGS checkpoint is for 1 parameter tensors with sizes [5]; this scaler has {count} with sizes {this}"
    )


def test_a_state_without_the_applied_update_counters_reads_them_as_the_seed_did():
    """The seed's state has no ``stat_steps``/``spatial_steps``: the statistics count ``step_count``
    updates (the same thing when none was skipped) and the stored spatial EMAs are taken as already
    bias-free, so the restored scaler reports them as stored."""
    torch.manual_seed(7)
    ps = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))]
    src = VarianceGradientScaler(ps, granularity="tensor", warmup_steps=0)
    _feed(src, ps, [(torch.randn(4), torch.randn(3)) for _ in range(5)])
    state = src.state_dict()
    seed_state = {k: v for k, v in state.items() if k not in ("stat_steps", "spatial_steps")}
    dst = VarianceGradientScaler(ps, granularity="tensor")
    dst.load_state_dict(seed_state)
    assert dst.state_dict()["stat_steps"] == 5.0 and dst.state_dict()["spatial_steps"] == 1e9
    assert dst.get_normalized_variance() == src.get_normalized_variance()
    assert dst.get_scaling_factor() == src.get_scaling_factor()
    metrics = dst.get_metrics()
    for key in ("grad_mean_ema", "grad_var_ema", "grad_norm_ema", "grad_max_ema"):
        assert metrics[f"vgs/{key}"] == pytest.approx(state[key], rel=1e-6)


def test_missing_settings_keep_the_scalers_own_and_a_missing_step_count_is_zero():
    ps = [torch.nn.Parameter(torch.zeros(3))]
    src = VarianceGradientScaler(ps, warmup_steps=0)
    _feed(src, ps, [(torch.tensor([1.0, 2.0, 3.0]),), (torch.tensor([2.0, 1.0, 0.5]),)])
    state = {k: v for k, v in src.state_dict().items() if k not in ("enabled", "warmup_steps", "step_count")}
    dst = VarianceGradientScaler(ps, warmup_steps=7)
    dst.load_state_dict(state)
    assert (dst.enabled, dst.warmup_steps, dst.step_count) == (True, 7, 0)
    assert dst.state_dict()["stat_steps"] == 2.0  # the statistics' own counter is in the state
    assert dst.warmup_active and dst.get_scaling_factor() == 1.0
