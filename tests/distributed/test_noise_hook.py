"""``NoiseScaleHook`` without a process group: bucket -> head mapping, unscaling, bookkeeping."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradmon_ray.distributed import NoiseScaleHook
from gradmon_ray.telemetry.head_norms import ParamRows
from gradmon_ray.telemetry.noise_scale import noise_lane_count


def _params():
    a1, a2, b, trunk = (nn.Parameter(torch.zeros(n)) for n in (2, 3, 1, 4))
    return {"a": [a1, a2], "b": [b]}, trunk


def test_local_squares_land_in_their_head_trunk_and_global_lanes():
    groups, trunk = _params()
    (a1, a2), (b,) = groups["a"], groups["b"]
    hook = NoiseScaleHook(groups)
    assert hook.lanes.shape == (noise_lane_count(2),) and hook.lanes.dtype == torch.float64
    # Two "buckets" mixing heads and trunk, in DDP's (reversed) order.
    hook.add_local([trunk, b, a2], [torch.full((4,), 1.0), torch.tensor([3.0]), torch.full((3,), 2.0)])
    hook.add_local([a1], [torch.tensor([1.0, 1.0])])
    # [a | b | trunk | global | big a | big b | big global]; norms are float32 like the gradients
    expected = torch.tensor([14.0, 9.0, 4.0, 27.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(hook.lanes, expected, rtol=1e-6, atol=0.0)
    hook.add_big(torch.tensor([2.0, 1.0]), torch.tensor(3.0), rows=16)
    hook.add_big(torch.tensor([1.0, 0.0]), torch.tensor(1.0), rows=8)
    torch.testing.assert_close(hook.lanes[4:], torch.tensor([5.0, 1.0, 10.0], dtype=torch.float64))
    assert hook.take_rows() == 24 and hook.take_rows() == 0
    hook.zero_()
    assert not hook.lanes.any()


def test_local_squares_are_unscaled_with_a_loss_scale():
    groups, _ = _params()
    hook = NoiseScaleHook(groups, scale=lambda: torch.tensor(4.0))
    hook.add_local([groups["b"][0]], [torch.tensor([8.0])])  # scaled gradient 8 = 4 x 2
    assert hook.lanes[1].item() == 4.0 and hook.lanes[3].item() == 4.0


def test_register_needs_ddp():
    groups, _ = _params()
    hook = NoiseScaleHook(groups)
    assert not hook.register(nn.Linear(2, 2)) and not hook.enabled


def test_row_heads_take_their_rows_and_leave_the_rest_to_the_trunk():
    """A layer W [4, 2], b [4] split as rows 0:1 -> "a", 1:3 -> "b" (row 3: trunk), bucketed with
    a trunk tensor.  Worked answer: W grads rows [1,1], [2,0], [0,2], [3,0]; b grads [1, 2, 2, 4];
    a = 1+1 + 1 = 3; b = 4+4 + 4+4 = 16; trunk = row 3 (9 + 16) + other (4) = 29; global = 48."""
    w, b, other = nn.Parameter(torch.zeros(4, 2)), nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(1))
    groups = {
        "a": [ParamRows(w, slice(0, 1)), ParamRows(b, slice(0, 1))],
        "b": [ParamRows(w, slice(1, 3)), ParamRows(b, slice(1, 3))],
    }
    hook = NoiseScaleHook(groups, scale=lambda: torch.tensor(2.0))  # the grads below are scaled by 2
    gw = torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
    gb = torch.tensor([1.0, 2.0, 2.0, 4.0])
    for _ in range(2):  # the second bucket call reuses the cached layout
        hook.add_local([other, b, w], [torch.tensor([4.0]), 2 * gb, 2 * gw])
    expected = 2 * torch.tensor([3.0, 16.0, 29.0, 48.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(hook.lanes, expected, rtol=1e-6, atol=1e-9)


def test_row_heads_through_real_ddp_buckets(tmp_path):
    """A one-process gloo world: DDP hands the hook its real buckets (``bucket.parameters()`` /
    ``bucket.gradients()``, views into the flat bucket buffer).  Oracle: the squares of the
    rows of ``p.grad`` after backward, sliced here; trunk = every other element."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a torch.distributed world is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5))
        out = model[2]
        groups = {
            "x": [ParamRows(out.weight, slice(0, 2)), ParamRows(out.bias, slice(0, 2))],
            "y": [ParamRows(out.weight, slice(2, 4)), ParamRows(out.bias, slice(2, 4))],
        }
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1e-4)  # ~100 bytes: several buckets
        hook = NoiseScaleHook(groups)
        assert hook.register(ddp)
        for _ in range(2):  # the second backward runs on DDP's rebuilt buckets
            hook.zero_()
            ddp.zero_grad(set_to_none=True)
            ddp(torch.randn(16, 4)).pow(2).mean().backward()
        gw, gb = out.weight.grad.double(), out.bias.grad.double()
        x = float(gw[0:2].pow(2).sum() + gb[0:2].pow(2).sum())
        y = float(gw[2:4].pow(2).sum() + gb[2:4].pow(2).sum())
        total = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
        expected = torch.tensor([x, y, total - x - y, total, 0.0, 0.0, 0.0], dtype=torch.float64)
        torch.testing.assert_close(hook.lanes, expected, rtol=1e-5, atol=1e-9)
        assert x > 0 and y > 0
    finally:
        dist.destroy_process_group()
