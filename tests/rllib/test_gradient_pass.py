"""``rllib/gradient_pass.py``: each module's step flag and VGS on a two-module learner.

Fused optimizer: each module's non-finite flag goes to ITS optimizer as ``found_inf``
(``apply_gradients``), never another module's.  Two modules, fused Adam,
``torch_skip_nan_gradients=True``, one module's rows poisoned (a NaN observation: its loss and
gradients are NaN, the other module's are clean), one update.  Oracles: stock RLlib's learner with
the same weights and fused Adam, fed the clean module's rows only (the clean module must move
exactly as there), and the poisoned module's weights of before the update (a skipped step moves
nothing).

A module with no rows in a minibatch (sparse multi-agent batches: no gradient, every ``p.grad``
None) is left out of VGS and of ``GradScaler.unscale_``: after an update of both modules, updates
with one module's rows only leave the other's VGS state (statistics, counters, warm-up clock,
factor) and weights exactly as they were, in every VGS mode, and the trained module's VGS equals
the numpy VGS (``tests/vgs/vgs_oracle.py``) fed its own minibatches' gradients (tensor hooks).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import pytest
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
from ray.rllib.policy.sample_batch import MultiAgentBatch

from gradmon_ray import metric_names as mn
from gradmon_ray.rllib import with_gradmon
from tests.peer.pairs import HEADS, build_pair, cartpole_config, fused_adam, sample_batch, spaces_of
from tests.vgs.vgs_oracle import assert_same_vgs_state, assert_vgs_metrics_close, numpy_vgs_metrics


def _weights(learner: Any, mid: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.module[mid].unwrapped().parameters()]


@pytest.mark.parametrize("poisoned", ["p0", "p1"])
def test_fused_adam_skips_only_the_module_whose_gradient_is_not_finite(poisoned):
    clean = "p1" if poisoned == "p0" else "p0"
    stock_cls = fused_adam(PPOTorchLearner)
    skip = {"torch_skip_nan_gradients": True}
    stock_config = cartpole_config("ppo", stock_cls, agents=2, framework=skip)
    config = cartpole_config("ppo", with_gradmon(stock_cls), agents=2, gradmon={"heads": HEADS}, framework=skip)
    stock, learner = build_pair(stock_config, config)
    try:
        assert all(g.get("fused") for _, o in learner.get_optimizers_for_module(clean) for g in o.param_groups)
        batch = sample_batch(stock_config, stock, num_timesteps=128)
        clean_only = MultiAgentBatch({clean: batch.policy_batches[clean]}, env_steps=batch.env_steps())
        batch.policy_batches[poisoned][Columns.OBS][0] = float("nan")
        before = {mid: _weights(learner, mid) for mid in ("p0", "p1")}
        stock.update(batch=clean_only, timesteps={}, num_epochs=1, minibatch_size=None)
        results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        assert float(results[poisoned][mn.NAN_GRAD_COUNT].peek()) > 0
        assert float(results[clean][mn.NAN_GRAD_COUNT].peek()) == 0
        for got, want in zip(_weights(learner, clean), _weights(stock, clean), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert any(not torch.equal(a, b) for a, b in zip(_weights(learner, clean), before[clean], strict=True))
        for got, was in zip(_weights(learner, poisoned), before[poisoned], strict=True):
            torch.testing.assert_close(got, was, rtol=0, atol=0, msg=f"{poisoned} stepped on NaN gradients")
    finally:
        stock.shutdown()
        learner.shutdown()


VGS = {"enabled": True, "warmup_steps": 1, "alpha": 5.0, "beta": 0.9}
"""Past its warm-up after the first update (factor < 1), beta 0.9: a few minibatches move it."""
SMALL = DefaultModelConfig(fcnet_hiddens=[32, 32])
"""~2,700 parameters a module: fewer than the default ``quantile_sample_size`` (exact percentiles,
the unsampled path) unless a case asks for a smaller sample (the one-pass sampled step)."""


def _small_two_modules(learner_class: type, **kwargs: Any) -> Any:
    return cartpole_config("ppo", learner_class, agents=2, **kwargs).rl_module(model_config=SMALL)


def _capture(params: list[torch.nn.Parameter]) -> tuple[list[list[np.ndarray]], list[Any]]:
    """Every backward pass's raw gradient of ``params`` (tensor hooks), and the hooks."""
    captured: list[list[np.ndarray]] = [[] for _ in params]
    hooks = [
        p.register_hook(lambda g, mine=mine: mine.append(g.detach().double().numpy().copy()))
        for p, mine in zip(params, captured, strict=True)
    ]
    return captured, hooks


@pytest.fixture(scope="module")
def two_module_batch() -> MultiAgentBatch:
    """One train batch of both modules (sampled with stock RLlib's seed-0 weights: any batch will do)."""
    config = _small_two_modules(PPOTorchLearner)
    learner = config.build_learner(spaces=spaces_of(config))
    try:
        return sample_batch(config, learner, num_timesteps=128)
    finally:
        learner.shutdown()


def _vgs_sparse_run(batch: MultiAgentBatch, vgs: dict[str, Any], scale: float | None = None) -> None:
    """One update of both modules, then three of p0's rows only."""
    experimental = None
    if scale is not None:  # mixed precision: RLlib scales each module's loss by its GradScaler
        grad_scaler = functools.partial(torch.amp.GradScaler, "cpu", init_scale=scale, growth_interval=10**6)
        experimental = {"_torch_grad_scaler_class": grad_scaler}
    gradmon = {"heads": HEADS, "vgs": {**VGS, **vgs}}
    config = _small_two_modules(with_gradmon(PPOTorchLearner), gradmon=gradmon, experimental=experimental)
    learner = config.build_learner(spaces=spaces_of(config))
    try:
        p0_only = MultiAgentBatch({"p0": batch.policy_batches["p0"]}, env_steps=batch.env_steps())
        p0, p1 = (learner.gradmon_modules[mid] for mid in ("p0", "p1"))
        captured, hooks = _capture(p0.params)
        one = {"timesteps": {}, "num_epochs": 1, "minibatch_size": 64}
        learner.update(batch=copy.deepcopy(batch), **one)
        first = len(captured[0])
        before = copy.deepcopy(p1.vgs.state_dict()), p1.vgs.get_metrics(), _weights(learner, "p1")
        scaler_before = copy.deepcopy(p1.grad_scaler.state_dict()) if scale is not None else None
        assert before[1][mn.VGS_SCALING_FACTOR] < 1.0  # p1's factor acts: a change would show
        for _ in range(3):
            learner.update(batch=copy.deepcopy(p0_only), **one)
        for hook in hooks:
            hook.remove()
        assert_same_vgs_state(p1.vgs.state_dict(), before[0], "p1 (no rows) VGS")
        assert p1.vgs.get_metrics() == before[1]
        for got, was in zip(_weights(learner, "p1"), before[2], strict=True):
            torch.testing.assert_close(got, was, rtol=0, atol=0, msg="p1 (no rows) moved")
        if scale is not None:
            assert p1.grad_scaler.state_dict() == scaler_before, "p1's GradScaler stepped"
        steps = [[c[k] / (scale or 1.0) for c in captured] for k in range(len(captured[0]))]
        settings = {k: v for k, v in {**VGS, **vgs}.items() if k not in ("enabled", "apply_to", "quantile_sample_size")}
        sample = p0.vgs._sample.cpu().numpy() if p0.vgs._sample is not None else None
        assert (sample is not None) == ("quantile_sample_size" in vgs)  # the path the case names
        expected = numpy_vgs_metrics(steps, sample=sample, **settings)
        assert len(steps) - first >= 3  # p0's own minibatches while p1 had no rows
        assert expected[mn.VGS_STEP_COUNT] == len(steps)  # p0 stepped in every minibatch
        assert expected[mn.VGS_SCALING_FACTOR] < 0.999  # p0's factor acts
        assert_vgs_metrics_close(p0.vgs.get_metrics(), expected)
    finally:
        learner.shutdown()


@pytest.mark.parametrize(
    "vgs",
    [
        {"apply_to": "gradient", "aggregation_method": "mean"},
        {"apply_to": "gradient", "aggregation_method": "weighted_mean", "granularity": "tensor"},
        {"apply_to": "update", "aggregation_method": "p90", "quantile_sample_size": 512},
        {"apply_to": "update", "aggregation_method": "p90"},
    ],
    ids=["gradient-mean-exact", "gradient-weighted_mean-tensor", "update-p90-sampled", "update-p90-exact"],
)
def test_a_module_without_rows_is_left_out_of_vgs(two_module_batch, vgs):
    """Before: the unsampled gradient path died (``Tensor list must have at least one tensor``);
    elsewhere p1's statistics took zeros and its warm-up clock advanced (its factor fell).  Every
    mode of the scaler itself: ``tests/vgs/test_scaler.py::test_a_step_without_any_gradient_is_left_out_entirely``."""
    _vgs_sparse_run(two_module_batch, vgs)


def test_a_module_without_rows_is_left_out_of_unscale_and_vgs_under_mixed_precision(two_module_batch):
    """A ``GradScaler`` per module (scale 1024: exact in float32): p1's scaler, VGS and weights stay
    as they were (before: RLlib's ``GradScaler.step`` asserted "No inf checks were recorded for
    this optimizer", stock RLlib's too); p0's VGS saw its unscaled gradients (hooks' / 1024)."""
    vgs = {"apply_to": "gradient", "aggregation_method": "p90", "quantile_sample_size": 512}
    _vgs_sparse_run(two_module_batch, vgs, scale=1024.0)
