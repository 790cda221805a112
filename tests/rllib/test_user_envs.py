"""Any env with a MultiDiscrete or Discrete action space trains through the gradmon learner."""

from __future__ import annotations

import math

import pytest

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update


@pytest.mark.parametrize(
    ("env_id", "head_names", "expected"),
    [
        ("tests.fixtures.user_envs:MatchTwoEnv", ["colour", "shape"], ("colour", "shape", "value")),
        ("tests.fixtures.user_envs:MatchTwoEnv", None, ("head_0", "head_1", "value")),
        ("CartPole-v1", None, ("action", "value")),
    ],
)
def test_user_env_heads_are_reported(env_id, head_names, expected):
    cfg = config_from_dict(
        {
            "env": {"id": env_id},
            "model": {"trunk_hiddens": [16], "head_names": head_names},
            "ppo": {"train_batch_size": 128, "minibatch_size": 64, "num_epochs": 1},
        }
    )
    learner = build_local_learner(cfg)
    update(learner, train_batch(learner, sample_episodes(cfg, learner, 128)), cfg)
    tele = learner.last_telemetry
    assert learner.head_names == expected
    assert all(math.isfinite(v) and v > 0 for v in tele.head_norms.values())
    assert set(tele.nan_latched) == set(expected) - {"value"}


def test_unknown_env_class_is_a_config_error():
    from gradmon_ray.config import ConfigError
    from gradmon_ray.rllib import build_ppo_config

    with pytest.raises(ConfigError, match=r"env\.id: cannot import"):
        build_ppo_config(config_from_dict({"env": {"id": "no.such.module:Env"}}))
