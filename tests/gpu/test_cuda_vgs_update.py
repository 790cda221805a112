"""On CUDA: VGS update mode (a tensor learning rate) and the accumulator's records, without host syncs.

Skipped without CUDA (CI has none); run on a lent GPU with ``pytest tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from gradmon_ray.optim.scaled_step import UpdateScaler
from gradmon_ray.telemetry import GradientNorms, IterationAccumulator, TelemetryLayout, logp_sums

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_update_mode_scales_the_cuda_step_without_a_sync(kind):
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(64, 32), (32,)]
    scaled = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dev)) for s in shapes]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in scaled]
    make = {"fused": dict(fused=True), "foreach": dict(foreach=True)}[kind]
    opt, twin = torch.optim.Adam(scaled, lr=1e-2, **make), torch.optim.Adam(plain, lr=1e-2, **make)
    grads = [torch.randn(s, generator=gen).to(dev) for s in shapes]
    for ps in (scaled, plain):
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
    before = [p.detach().clone() for p in scaled]
    factor = torch.tensor(0.3, device=dev)
    scaler = UpdateScaler([opt])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with scaler.scaled(factor):
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    twin.step()
    for p, q, b in zip(scaled, plain, before, strict=True):
        torch.testing.assert_close(p.detach() - b, 0.3 * (q.detach() - b), rtol=1e-4, atol=1e-6)


def test_recording_minibatches_does_not_sync():
    dev = torch.device("cuda")
    layout = TelemetryLayout(num_reported=3, num_action_heads=2)
    acc = IterationAccumulator(layout, device=dev)
    norms = GradientNorms(
        torch.rand(3, device=dev), torch.rand((), device=dev), torch.zeros((), device=dev), torch.zeros((), device=dev)
    )
    sums = logp_sums(torch.randn(16, 2, device=dev))
    acc.add_minibatch_logp_sums(norms, sums, torch.zeros((), device=dev))  # the first row: warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            acc.add_minibatch_logp_sums(norms, logp_sums(torch.randn(16, 2, device=dev)), torch.zeros((), device=dev))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    lanes, _, _ = acc.drain()
    assert lanes[layout.minibatches] == 4.0
