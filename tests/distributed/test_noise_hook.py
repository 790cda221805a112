"""``distributed/noise_hook.py``: the DDP comm hook behind the per-head gradient noise scale.

Without a process group: bucket -> head mapping, unscaling, bookkeeping (worked answers); in a
one-process gloo world, DDP's real buckets.  Then the k-learner noise scale through the real
reduction path, against an independent closed-form oracle (``e2e``: it starts k processes):

k real processes (``torch.multiprocessing`` spawn) form a gloo ``torch.distributed`` world.
Each wraps a tiny model with known head groups in DDP (buckets of ~100 bytes, so after DDP's
bucket rebuild at the end of the first backward the heads are spread over several buckets),
registers the product's ``NoiseScaleHook`` as its comm hook, computes the all-reduced norms
with ``GradientNormPlan``, fills the real ``IterationAccumulator``, reduces once per iteration
with ``reduce_iteration`` over the real ``LearnerCollective`` and turns the reduced lanes
into metrics with ``noise_scales`` and ``telemetry.noise_scale.noise_scale_metrics`` -- the functions the
learner calls.

The model's loss is ``sum_p <p, c_p>``, so each rank's gradient is exactly the vector ``c``
this test constructs: per minibatch, rank r's gradient is the mean ``m_r`` of B per-sample
gradients ``G + std * z`` drawn here (known |G|^2 and tr(Sigma) = sum std^2 per head).  The
oracle never looks at lanes: from the ``m_r`` alone (numpy, float64), with ``M = mean_r m_r``,
``|G|^2 ~ (k|M|^2 - mean_r|m_r|^2)/(k-1)`` and ``tr(Sigma) ~ B k/(k-1) (mean_r|m_r|^2 - |M|^2)``,
averaged over the iteration's minibatches and smoothed with the same EMA.

Not covered here: the transport.  ``ray.util.collective`` only works inside Ray actors, so
``LearnerCollective._allreduce`` is swapped for ``torch.distributed.all_reduce`` on a gloo
sub-group (what Ray's gloo group runs underneath); the learner's glue (``add_big`` called from
``postprocess_gradients_for_module`` with the batch's row count, RLlib's DDP wrapping, the
GradScaler unscale) is covered by tests/rllib and the two-learner e2e tests.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gradmon_ray import metric_names as mn
from gradmon_ray.distributed import LearnerCollective, NoiseScaleHook, parameter_checksum, reduce_iteration
from gradmon_ray.telemetry import GradientNormPlan, IterationAccumulator, NoiseScaleTracker, TelemetryLayout
from gradmon_ray.telemetry.head_norms import ParamRows
from gradmon_ray.telemetry.noise_scale import GLOBAL_ENTRY, noise_lane_count, noise_scale_metrics, noise_scales
from tests.distributed.two_ranks import ALWAYS_PRELOADED


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


# --- k learners: the real hook, accumulator and reduction vs a closed form ---------------------

# Head -> parameter shapes; "trunk" parameters belong to no head (global norm only).
HEAD_SHAPES: dict[str, list[tuple[int, ...]]] = {
    "a": [(3, 4), (3,)],
    "b": [(5,)],
    "weak": [(6,)],
    "value": [(2, 3), (2,)],
}
TRUNK_SHAPES: list[tuple[int, ...]] = [(7,), (4, 2)]
# Known per-sample gradient distribution per head: mean G (all entries equal) and std.
# "weak" is built apart: its learners' gradients cancel exactly (true |G|^2 = 0).
SIGNAL = {"a": (1.0, 4.0), "b": (-2.0, 6.0), "value": (0.5, 1.0), "trunk": (0.3, 2.0)}
ROWS = 16  # samples per learner per minibatch (b_small)
MINIBATCHES = 24
ITERATIONS = 3
BETA = 0.5
BUCKET_MB = 1e-4  # ~100 bytes: after the rebuild, about one parameter per bucket


def _param_layout() -> list[tuple[str, tuple[int, ...]]]:
    """(owner, shape) per parameter, in the model's registration order."""
    layout = [("trunk", s) for s in TRUNK_SHAPES]
    for head, shapes in HEAD_SHAPES.items():
        layout += [(head, s) for s in shapes]
    return layout


def _make_gradients(k: int, seed: int = 1234) -> np.ndarray:
    """``[iteration, minibatch, rank, flat parameter vector]`` gradients (float64)."""
    rng = np.random.default_rng(seed)
    layout = _param_layout()
    sizes = [int(np.prod(s)) for _, s in layout]
    out = np.zeros((ITERATIONS, MINIBATCHES, k, sum(sizes)))
    angles = 2 * np.pi * np.arange(k) / k
    for t in range(ITERATIONS):
        for j in range(MINIBATCHES):
            offset = 0
            for (owner, _), n in zip(layout, sizes, strict=True):
                if owner == "weak":
                    # sum_r m_r = 0 and |m_r| equal: every pairwise dot product < 0, so the
                    # |G|^2 estimate is negative (pure noise, as a weakly rewarded head).
                    u, w = rng.normal(size=n), rng.normal(size=n)
                    w -= u * (u @ w) / (u @ u)
                    w *= np.linalg.norm(u) / np.linalg.norm(w)
                    grads = np.cos(angles)[:, None] * u + np.sin(angles)[:, None] * w
                else:
                    mean, std = SIGNAL[owner]
                    samples = mean + std * rng.normal(size=(k, ROWS, n))
                    grads = samples.mean(axis=1)
                out[t, j, :, offset : offset + n] = grads
                offset += n
    return out


def _entries() -> dict[str, np.ndarray]:
    """Oracle entry -> boolean mask over the flat parameter vector (heads, then global)."""
    owners = np.concatenate([[owner] * int(np.prod(s)) for owner, s in _param_layout()])
    masks = {head: owners == head for head in HEAD_SHAPES}
    masks[GLOBAL_ENTRY] = np.ones(owners.shape, dtype=bool)
    return masks


def _oracle(grads: np.ndarray) -> list[dict[str, tuple[float, float, float]]]:
    """Per iteration ``{entry: (EMA |G|^2, EMA tr Sigma, B_simple or NaN)}`` from the gradients alone."""
    k = grads.shape[2]
    ema = {e: [0.0, 0.0] for e in _entries()}
    history = []
    for t in range(grads.shape[0]):
        row = {}
        for entry, mask in _entries().items():
            m = grads[t][..., mask]  # [minibatch, rank, dims]
            big = m.mean(axis=1)  # M per minibatch
            small_sq = (m**2).sum(axis=2).mean(axis=1)  # mean_r |m_r|^2
            big_sq = (big**2).sum(axis=1)
            g2 = float(((k * big_sq - small_sq) / (k - 1)).mean())
            trace = float((ROWS * k / (k - 1) * (small_sq - big_sq)).mean())
            ema[entry][0] = BETA * ema[entry][0] + (1 - BETA) * g2
            ema[entry][1] = BETA * ema[entry][1] + (1 - BETA) * trace
            g2_ema, trace_ema = ema[entry]
            row[entry] = (g2_ema, trace_ema, trace_ema / g2_ema if g2_ema > 0 else math.nan)
        history.append(row)
    return history


class _Tiny(nn.Module):
    """Loss ``sum_p <p, c_p>``: the gradient of parameter p is exactly ``c_p``."""

    def __init__(self) -> None:
        super().__init__()
        layout = _param_layout()
        self.params = nn.ParameterList([nn.Parameter(torch.zeros(s, dtype=torch.float64)) for _, s in layout])
        self.owners = [owner for owner, _ in layout]

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        total, offset = flat.new_zeros(()), 0
        for p in self.params:
            total = total + (p * flat[offset : offset + p.numel()].view_as(p)).sum()
            offset += p.numel()
        return total

    def head_parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        return {h: [p for p, o in zip(self.params, self.owners, strict=True) if o == h] for h in HEAD_SHAPES}


class _TorchGlooCollective(LearnerCollective):
    """The product's collective with only its transport swapped (see the module docstring)."""

    def __init__(self, world_size: int, rank: int) -> None:
        super().__init__("gradmon-test", world_size, rank, "gloo", torch.device("cpu"))
        self._group = None

    def _allreduce(self, tensor: torch.Tensor) -> None:
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group)


def _learn(rank: int, k: int) -> dict:
    """One learner: the real hook / accumulator / reduction / metrics, per iteration."""
    grads = torch.from_numpy(_make_gradients(k))
    model = _Tiny()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    groups = model.head_parameter_groups()
    hook = NoiseScaleHook(groups, "cpu")
    assert hook.register(ddp)
    buckets: list[int] = []  # comm hook calls per minibatch
    inner = hook.add_local

    def counting_add_local(params, grads_):  # type: ignore[no-untyped-def]
        buckets[-1] += 1
        inner(params, grads_)

    hook.add_local = counting_add_local  # type: ignore[method-assign]
    plan = GradientNormPlan(groups, list(model.parameters()))
    layout = TelemetryLayout(num_reported=len(groups), num_action_heads=len(groups) - 1)
    accumulator = IterationAccumulator(layout)
    collective = _TorchGlooCollective(k, rank)
    tracker = NoiseScaleTracker([*groups, GLOBAL_ENTRY], beta=BETA)
    no_flags = torch.zeros(layout.num_action_heads)
    history = []
    for t in range(ITERATIONS):
        for j in range(MINIBATCHES):
            buckets.append(0)
            ddp.zero_grad(set_to_none=True)
            ddp(grads[t, j, rank]).backward()
            norms = plan.compute()
            hook.add_big(norms.head_norms, norms.global_norm, ROWS)
            accumulator.add_minibatch(norms, no_flags, no_flags, torch.zeros(()))
        digits = parameter_checksum(list(model.parameters()))
        reduced = reduce_iteration(accumulator, collective, checksum=digits, noise=hook.lanes, local=digits)
        hook.zero_()
        per_head, global_scale = noise_scales(
            tracker,
            reduced.noise,
            world_size=k,
            minibatches=int(reduced.lanes[layout.minibatches]),
            rows=hook.take_rows(),
        )
        metrics = noise_scale_metrics(per_head, global_scale)
        history.append(
            {
                "metrics": metrics,
                "g2_ema": list(tracker.g2_ema),
                "trace_ema": list(tracker.trace_ema),
                "checksum_ok": bool(np.array_equal(reduced.checksum, k * reduced.local)),
                "minibatches": float(reduced.lanes[layout.minibatches]),
            }
        )
    dist.barrier()
    return {"history": history, "buckets": buckets, "calls": collective.calls}


def _learner(rank: int, k: int, init_file: str, out_dir: str) -> None:
    """Process entry point: the result (or the traceback) goes to a file, then a hard exit.

    The hard exit skips interpreter teardown: deallocating DDP's reducer there can deadlock
    against gloo's worker thread releasing the Python comm hook's future callback.
    """
    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=k, timeout=timedelta(seconds=60)
        )
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(_learn(rank, k)))
        code = 0
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
    finally:
        os._exit(code)


def _run_learners(k: int, tmp_path: Path) -> list[dict]:
    # Fresh processes (never forked from a pytest process that may hold Ray's threads), forked
    # from one forkserver that imported torch and DDP's torch._dynamo once for all learners: the one
    # of two_ranks.py (this process's only forkserver, whichever module starts it) preloads them.
    multiprocessing.set_forkserver_preload([*ALWAYS_PRELOADED, __name__])
    args = (k, str(tmp_path / "rendezvous"), str(tmp_path))
    context = mp.start_processes(_learner, args=args, nprocs=k, join=False, start_method="forkserver")
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{k} learner processes still running after 120 s")
    except mp.ProcessExitedException:
        errors = "\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.error")))
        pytest.fail(f"a learner process failed:\n{errors}")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(k)]


K = 3
"""Learners in the world: 3, so that the estimators' k/(k-1) is not k (at k = 2 it is, and a k for
k/(k-1) would pass).  Two learners' B_simple against a closed form: ``tests/telemetry/test_noise_scale.py``
(``noise_scales`` at world_size 2); two real learner actors logging it identically on both ranks:
``tests/e2e/test_multi_learner_collective.py``."""


@pytest.mark.e2e  # K learner processes
def test_k_learner_noise_scale_matches_closed_form_oracle(tmp_path):
    k = K
    ranks = _run_learners(k, tmp_path)
    oracle = _oracle(_make_gradients(k))
    names = [*HEAD_SHAPES, GLOBAL_ENTRY]
    for rank, result in enumerate(ranks):
        assert result["calls"] == ITERATIONS  # one reduction per iteration
        # One bucket until DDP rebuilds them after the first backward, then heads and trunk
        # spread over several buckets (the hook maps each bucket's parameters to heads).
        assert result["buckets"][0] == 1 and min(result["buckets"][1:]) >= 3, result["buckets"]
        for t, (got, want) in enumerate(zip(result["history"], oracle, strict=True)):
            where = f"rank {rank}, iteration {t + 1}"
            assert got["checksum_ok"] and got["minibatches"] == MINIBATCHES, where
            for i, name in enumerate(names):
                g2, trace, b_simple = want[name]
                assert got["g2_ema"][i] == pytest.approx(g2, rel=1e-5), f"|G|^2 {name}, {where}"
                assert got["trace_ema"][i] == pytest.approx(trace, rel=1e-5), f"tr(Sigma) {name}, {where}"
                key = mn.GLOBAL_NOISE_SCALE if name == GLOBAL_ENTRY else mn.head_metric(mn.HEAD_NOISE_SCALE, name)
                if math.isnan(b_simple):
                    assert key not in got["metrics"], f"{key} must be left out while undefined, {where}"
                else:
                    assert got["metrics"][key] == pytest.approx(b_simple, rel=1e-5), f"{key}, {where}"
            assert all(math.isfinite(v) for v in got["metrics"].values()), where
        # The weak head's learners disagree every minibatch: undefined, so never logged; the
        # others are always defined here.
        expected = {mn.head_metric(mn.HEAD_NOISE_SCALE, h) for h in ("a", "b", "value")} | {mn.GLOBAL_NOISE_SCALE}
        assert all(set(h["metrics"]) == expected for h in result["history"])
    # Every learner logs the same numbers (the reduced lanes are identical).
    assert all(r["history"] == ranks[0]["history"] for r in ranks)

    # Statistical check against the TRUE distribution: |G|^2 = n mean^2 and tr(Sigma) = n std^2
    # per head (n parameters).  The EMA's bias factor 1 - beta^T is divided out (it cancels in
    # B_simple).  The estimators are unbiased; over 400 seeds of this setup (3 x 24 minibatches
    # of k x 16 samples) their relative standard deviation is at most 7% (|G|^2) and 9%
    # (tr Sigma) for heads a and b, so the 30% tolerance is more than 3 standard deviations.
    last = ranks[0]["history"][-1]
    bias = 1 - BETA**ITERATIONS
    for i, head in enumerate(names):
        if head not in ("a", "b"):
            continue
        n = sum(int(np.prod(s)) for s in HEAD_SHAPES[head])
        mean, std = SIGNAL[head]
        assert last["g2_ema"][i] / bias == pytest.approx(n * mean**2, rel=0.30), head
        assert last["trace_ema"][i] / bias == pytest.approx(n * std**2, rel=0.30), head
