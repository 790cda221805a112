"""``rllib/gradient_pass.py``'s step with a fused optimizer: each module's non-finite flag goes to
ITS optimizer as ``found_inf`` (``apply_gradients``), never another module's.

Two modules, fused Adam, ``torch_skip_nan_gradients=True``, one module's rows poisoned (a NaN
observation: its loss and gradients are NaN, the other module's are clean), one update.
Oracles: stock RLlib's learner with the same weights and fused Adam, fed the clean module's
rows only (the clean module must move exactly as there), and the poisoned module's weights of
before the update (a skipped step moves nothing).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.columns import Columns
from ray.rllib.policy.sample_batch import MultiAgentBatch

from gradmon_ray import metric_names as mn
from gradmon_ray.rllib import with_gradmon
from tests.peer.pairs import HEADS, build_pair, cartpole_config, fused_adam, sample_batch


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
