"""Any env with a MultiDiscrete or Discrete action space trains through the gradmon learner."""

from __future__ import annotations

import math

import pytest

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch


@pytest.mark.parametrize(
    ("env_id", "head_names", "expected"),
    [
        ("tests.fixtures.user_envs:MatchTwoEnv", ["colour", "shape"], ("colour", "shape", "value")),
        ("tests.fixtures.user_envs:MatchTwoEnv", None, ("head_0", "head_1", "value")),
        ("CartPole-v1", None, ("action", "value")),
    ],
)
def test_user_env_heads_are_reported(env_id, head_names, expected):
    """The heads of a user's env under their names, each norm equal to the oracle's: autograd of
    stock RLlib PPO's loss (same weights, same full-batch minibatch) w.r.t. the module's parameters
    fetched by attribute (``module.heads[name]``, ``module.value_head``): nothing of gradmon's."""
    import torch
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
    from ray.rllib.core import DEFAULT_MODULE_ID

    cfg = config_from_dict(
        {
            "env": {"id": env_id},
            "model": {"trunk_hiddens": [16], "head_names": head_names},
            "ppo": {"train_batch_size": 128, "minibatch_size": 128, "num_epochs": 1, "grad_clip": None},
        }
    )
    learner = build_local_learner(cfg)
    batch = train_batch(learner, sample_episodes(cfg, learner, 128))
    stock = build_local_learner(cfg, learner_class=PPOTorchLearner)
    stock.module[DEFAULT_MODULE_ID].set_state(learner.module[DEFAULT_MODULE_ID].get_state())
    tensors = dict(stock._convert_batch_type(batch).policy_batches[DEFAULT_MODULE_ID])
    module = stock.module[DEFAULT_MODULE_ID].unwrapped()
    loss = stock.compute_loss_for_module(
        module_id=DEFAULT_MODULE_ID,
        config=stock.config.get_config_for_module(DEFAULT_MODULE_ID),
        batch=tensors,
        fwd_out=module.forward_train(tensors),
    )
    owners = {name: list(head.parameters()) for name, head in module.heads.items()}
    owners["value"] = list(module.value_head.parameters())
    oracle = {}
    for head, params in owners.items():
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        oracle[head] = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    tele = learner.last_telemetry
    assert learner.head_names == expected and set(oracle) == set(expected)
    assert tele.head_norms == pytest.approx(oracle, rel=1e-4)
    assert set(tele.nan_latched) == set(expected) - {"value"}


def test_unknown_env_class_is_a_config_error():
    from gradmon_ray.config import ConfigError
    from gradmon_ray.rllib import build_ppo_config

    with pytest.raises(ConfigError, match=r"env\.id: cannot import"):
        build_ppo_config(config_from_dict({"env": {"id": "no.such.module:Env"}}))
