"""On CUDA, the per-minibatch telemetry path must not synchronise with the host.

``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronising call, so these tests
fail if a ``.item()``, ``.cpu()``, ``bool(tensor)`` or size-dependent indexing sneaks into the
hot path.  Skipped without CUDA (CI has none).
"""

from __future__ import annotations

import pytest
import torch

from gradmon_ray.telemetry import GradientNormPlan, IterationAccumulator, TelemetryTracker, logp_nonfinite_flags

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_norms_flags_accumulate_and_fused_skip_do_not_sync():
    dev = torch.device("cuda")
    heads = {f"h{i}": [torch.nn.Parameter(torch.randn(8, 8, device=dev))] for i in range(3)}
    trunk = torch.nn.Parameter(torch.randn(16, device=dev))
    params = [p for ps in heads.values() for p in ps] + [trunk]
    for p in params:
        p.grad = torch.randn_like(p)
    heads["h1"][0].grad[0, 0] = float("nan")
    plan = GradientNormPlan(heads, params)
    plan.compute()  # first call builds (and caches) the index tensors from host data
    tracker = TelemetryTracker([*heads, "value"][:3], ["h0", "h1"])
    acc = IterationAccumulator(tracker.layout, device=dev)
    opt = torch.optim.Adam(params, fused=True)
    before = [p.detach().clone() for p in params]
    logp = torch.randn(32, 2, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norms = plan.compute()
        nan_flags, inf_flags = logp_nonfinite_flags(logp)
        opt.found_inf = norms.found_nonfinite
        opt.step()
        del opt.found_inf
        acc.add_minibatch(norms, nan_flags, inf_flags, norms.found_nonfinite)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    lanes = acc.drain()[0]
    summary = tracker.finish_iteration(lanes)
    assert summary.skipped == 1 and summary.nan_grad_count == 1
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.detach(), b)  # the fused kernel skipped the NaN step


def test_learner_update_on_cuda_reports_finite_telemetry():
    from gradmon_ray.config import config_from_dict
    from gradmon_ray.rllib.standalone import build_local_learner, sample_episodes, train_batch, update

    cfg = config_from_dict(
        {
            "ppo": {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 2},
            "resources": {"num_gpus_per_learner": 1},
        }
    )
    learner = build_local_learner(cfg)
    assert str(learner._device).startswith("cuda")
    update(learner, train_batch(learner, sample_episodes(cfg, learner, 256)), cfg)
    tele = learner.last_telemetry
    assert len(tele.head_norms) == 9 and all(v > 0 for v in tele.head_norms.values())
    assert tele.skipped == 0


@pytest.mark.parametrize("granularity", ["element", "tensor"])
@pytest.mark.parametrize("aggregation", ["p90", "mean", "weighted_mean"])
def test_vgs_update_and_scale_do_not_sync(granularity, aggregation):
    from gradmon_ray.telemetry import VarianceGradientScaler

    dev = torch.device("cuda")
    params = [torch.nn.Parameter(torch.randn(64, 64, device=dev)), torch.nn.Parameter(torch.randn(64, device=dev))]
    vgs = VarianceGradientScaler(
        params, warmup_steps=0, granularity=granularity, aggregation_method=aggregation, quantile_sample_size=512
    )
    for p in params:
        p.grad = torch.randn_like(p)
    vgs.scale_gradients()  # first call allocates work buffers
    skip = torch.zeros((), device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            vgs.update_statistics(skip)
            vgs.scale_gradients(skip)
            vgs.step()
            vgs.metrics_tensor()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert 0.0 < vgs.get_scaling_factor() <= 1.0
