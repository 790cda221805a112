"""Oracles for the learner's bookkeeping and VGS metrics, as the learner LOGS them (by name).

Every expected value is counted by the test itself: the gradients of each minibatch are
captured by tensor hooks on ``module.parameters()`` (NaN/Inf elements, non-finite minibatches
and backward passes counted in numpy), the iteration clock is the test's own loop counter,
latches come from a known construction (a NaN bias on one head, a -inf logit on one action),
and the ``vgs/*`` metrics come from the numpy re-implementation in ``tests/vgs/vgs_oracle.py``.
Nothing here reads ``head_parameter_groups``, ``GradientNormPlan`` or the tracker.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update
from tests.vgs.vgs_oracle import assert_vgs_metrics_close, numpy_vgs_metrics

MID = DEFAULT_MODULE_ID
ACTION_HEADS = ("alpha_curve", "alpha_speed", "alpha_target", "blueprint", "op", "slot", "style", "tempo")


def _cfg(**extra):
    data = {
        "seed": 5,
        "ppo": {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 2},
        "model": {"trunk_hiddens": [16, 16]},
    }
    data.update(extra)
    return config_from_dict(data)


def _module(learner):
    return learner.module[MID].unwrapped()


class GradientRecorder:
    """Tensor hooks on every parameter: each backward pass's gradients, as float64 numpy."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = list(module.parameters())
        self.captured: dict[int, list[np.ndarray]] = {}
        self.handles = [p.register_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def _hook(self, slot: int):
        def hook(grad: torch.Tensor) -> None:
            self.captured.setdefault(slot, []).append(grad.detach().double().numpy().copy())

        return hook

    def take(self) -> list[list[np.ndarray]]:
        """The minibatches since the last call: per minibatch, one array per parameter."""
        counts = {len(v) for v in self.captured.values()}
        assert len(counts) == 1 and len(self.captured) == len(self.params), "a parameter missed a backward"
        (count,) = counts
        out = [[self.captured[slot][k] for slot in range(len(self.params))] for k in range(count)]
        self.captured.clear()
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _logged(results) -> dict[str, float]:
    out = {}
    for key, value in results[MID].items():
        if isinstance(key, str) and "/" in key:
            out[key] = float(value.peek() if hasattr(value, "peek") else value)
    return out


def _first_valid_row(batch) -> int:
    mask = batch.policy_batches[MID].get(Columns.LOSS_MASK)
    return 0 if mask is None else int(np.flatnonzero(np.asarray(mask))[0])


VALUE_EDGES = (0.01, 0.1, 10.0, 50.0)  # dead < 0.01 <= weak < 0.1 <= healthy <= 10 < elevated <= 50 < exploding


def _value_band_code(x: float) -> int:
    dead, weak, healthy, elevated = VALUE_EDGES
    return 0 if x < dead else 1 if x < weak else 2 if x <= healthy else 3 if x <= elevated else 4


def test_latches_first_iteration_skips_counts_and_clock_across_a_checkpoint_restore():
    """Five iterations, the fifth on a learner restored from the fourth's state:
    1 clean, 2 tempo's bias NaN, 3 one slot logit -inf, 4 poisoned gradients, 5 clean again."""
    # vf_loss_coeff 5: the value head's norm lands between the action heads' healthy_max (2) and
    # its own (10), so judging it by the wrong edges would show.
    cfg = _cfg(ppo={"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 2, "vf_loss_coeff": 5.0})
    learner = build_local_learner(cfg)
    batch = train_batch(learner, sample_episodes(cfg, learner, 256))
    row = _first_valid_row(batch)
    value_norms = []
    taken_slot = int(batch.policy_batches[MID][Columns.ACTIONS]["slot"][row])

    expected_nan = {h: 0.0 for h in ACTION_HEADS}
    expected_inf = {h: 0.0 for h in ACTION_HEADS}
    first_nan: dict[str, int] = {}
    first_inf: dict[str, int] = {}
    skipped_total = 0

    def run(learner, iteration: int) -> None:
        nonlocal skipped_total
        recorder = GradientRecorder(_module(learner))
        try:
            logged = _logged(update(learner, batch, cfg))
            minibatches = recorder.take()
        finally:
            recorder.remove()
        nonfinite = [not all(np.isfinite(g).all() for g in mb) for mb in minibatches]
        skipped_total += sum(nonfinite)
        assert logged[mn.TELEMETRY_ITERATION] == iteration
        assert logged[mn.MINIBATCH_UPDATES] == len(minibatches) >= 2 * (256 // 64)
        assert logged[mn.SKIPPED_UPDATES] == sum(nonfinite), iteration
        assert logged[mn.SKIPPED_UPDATES_TOTAL] == skipped_total, iteration
        assert logged[mn.NAN_GRAD_COUNT] == sum(int(np.isnan(g).sum()) for mb in minibatches for g in mb)
        assert logged[mn.INF_GRAD_COUNT] == sum(int(np.isinf(g).sum()) for mb in minibatches for g in mb)
        for head in ACTION_HEADS:
            assert logged[mn.head_metric(mn.HEAD_NAN_LATCH, head)] == expected_nan[head], (iteration, head)
            assert logged[mn.head_metric(mn.HEAD_INF_LATCH, head)] == expected_inf[head], (iteration, head)
            for template, first in (
                (mn.HEAD_NAN_LATCH_FIRST_ITERATION, first_nan),
                (mn.HEAD_INF_LATCH_FIRST_ITERATION, first_inf),
            ):
                name = mn.head_metric(template, head)
                if head in first:
                    assert logged[name] == first[head], (iteration, name)
                else:
                    assert name not in logged, (iteration, name)
        # The value head has no log-probs, hence no latch.
        assert mn.head_metric(mn.HEAD_NAN_LATCH, "value") not in logged
        if all(np.isfinite(g).all() for mb in minibatches for g in mb):
            # The value head, judged by its own edges (written out here): mean over minibatches of
            # the norm over module.value_head's parameters, fetched by attribute name.
            value_ids = {id(p) for p in _module(learner).value_head.parameters()}
            slots = [i for i, p in enumerate(recorder.params) if id(p) in value_ids]
            norm = float(np.mean([np.sqrt(sum(float((mb[i] ** 2).sum()) for i in slots)) for mb in minibatches]))
            assert logged[mn.head_metric(mn.HEAD_GRAD_NORM, "value")] == pytest.approx(norm, rel=1e-4)
            assert logged[mn.head_metric(mn.HEAD_GRAD_HEALTH, "value")] == _value_band_code(norm)
            value_norms.append(norm)

    run(learner, 1)

    bias = _module(learner).heads["tempo"][-1].bias
    saved = bias.detach().clone()
    with torch.no_grad():
        bias.fill_(float("nan"))
    expected_nan["tempo"], first_nan["tempo"] = 1.0, 2
    run(learner, 2)
    with torch.no_grad():
        bias.copy_(saved)

    bias = _module(learner).heads["slot"][-1].bias
    saved = bias.detach().clone()
    with torch.no_grad():
        bias[taken_slot] = float("-inf")  # that action's log-prob is -inf: an Inf, not a NaN
    expected_inf["slot"], first_inf["slot"] = 1.0, 3
    run(learner, 3)
    with torch.no_grad():
        bias.copy_(saved)

    # Iteration 4: +Inf, -Inf and NaN written into one gradient by a tensor hook (registered
    # before the recorder's, so the recorder sees the poisoned gradient): counts, not latches.
    def poison(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone().reshape(-1)
        out[:4] = torch.tensor([float("inf"), float("-inf"), float("-inf"), float("nan")])
        return out.reshape(grad.shape)

    handle = _module(learner).heads["op"][0].weight.register_hook(poison)
    try:
        run(learner, 4)
    finally:
        handle.remove()
    assert skipped_total >= 2 * 2 * (256 // 64)  # iterations 2 and 4 skipped every minibatch

    restored = build_local_learner(cfg)
    restored.set_state(learner.get_state())
    run(restored, 5)  # latches, first iterations, skipped_total and the clock carry on
    assert len(value_norms) >= 2 and any(2.0 < v <= 10.0 for v in value_norms), value_norms


@pytest.mark.parametrize(
    ("granularity", "method"), [("element", "p90"), ("tensor", "mean")], ids=["element-p90", "tensor-mean"]
)
def test_logged_vgs_metrics_equal_numpy_vgs_on_hook_captured_gradients(granularity, method):
    """Two iterations of 8 minibatches with warmup 10: iteration 1 logs warmup, iteration 2 the
    factor; every ``vgs/*`` metric equals the numpy VGS fed the raw (pre-scaling) gradients."""
    settings = {"beta": 0.9, "alpha": 2.0, "eps": 1e-8, "warmup_steps": 10}
    cfg = _cfg(vgs={"enabled": True, "aggregation_method": method, "granularity": granularity, **settings})
    learner = build_local_learner(cfg)
    module = _module(learner)
    assert sum(p.numel() for p in module.parameters()) <= learner.vgs.quantile_sample_size  # exact percentiles
    batch = train_batch(learner, sample_episodes(cfg, learner, 256))
    recorder = GradientRecorder(module)
    seen: list[list[np.ndarray]] = []
    try:
        for iteration in (1, 2):
            logged = _logged(update(learner, batch, cfg))
            seen += recorder.take()
            expected = numpy_vgs_metrics(seen, aggregation_method=method, granularity=granularity, **settings)
            assert expected[mn.VGS_WARMUP_ACTIVE] == float(iteration == 1)
            assert_vgs_metrics_close(logged, expected)
    finally:
        recorder.remove()
    assert expected[mn.VGS_SCALING_FACTOR] < 0.999  # the factor acted in iteration 2
