"""Per-row group ids in the learner's train batch, checked against the observation."""

from __future__ import annotations

import numpy as np
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns

from gradmon_ray.config import config_from_dict
from gradmon_ray.probe.connectors import EPISODE_COLUMN, GROUP_ID_COLUMN, NO_GROUP, _as_int
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update


def _batch(env_id: str = "gradmon/FactoredOps-v0"):
    cfg = config_from_dict(
        {
            "seed": 4,
            "env": {"id": env_id},
            "model": {"trunk_hiddens": [16]},
            "ppo": {"train_batch_size": 200, "minibatch_size": 50, "num_epochs": 1},
        }
    )
    learner = build_local_learner(cfg)
    episodes = sample_episodes(cfg, learner, 200)
    return cfg, learner, episodes, train_batch(learner, episodes)


def test_every_row_carries_its_episodes_group_and_index():
    cfg, learner, episodes, batch = _batch()
    data = batch.policy_batches[DEFAULT_MODULE_ID]
    groups = np.asarray(data[GROUP_ID_COLUMN])
    episode_index = np.asarray(data[EPISODE_COLUMN])
    obs = np.asarray(data[Columns.OBS])
    assert groups.shape == episode_index.shape == (obs.shape[0],)
    # The built-in env also one-hot encodes the task in the first 8 observation entries.
    assert np.array_equal(groups, obs[:, :8].argmax(axis=1))
    # PPO's AddOneTsToEpisodesAndTruncate extended each chunk in place by one (masked) step:
    # rows == sum of the (extended) chunk lengths == sampled steps + one per chunk.
    assert obs.shape[0] == sum(len(e) for e in episodes)
    assert int(np.asarray(data[Columns.LOSS_MASK]).sum()) == obs.shape[0] - len(episodes)
    assert list(np.unique(episode_index)) == list(range(len(episodes)))
    update(learner, batch, cfg)  # the extra columns do not disturb training
    assert learner.last_telemetry.skipped == 0


def test_env_without_group_ids_gets_no_group():
    _, _, _, batch = _batch("CartPole-v1")
    assert set(np.asarray(batch.policy_batches[DEFAULT_MODULE_ID][GROUP_ID_COLUMN]).tolist()) == {NO_GROUP}


def test_non_integer_group_ids_hash_stably():
    assert _as_int("task-a") == _as_int("task-a") != _as_int("task-b")
    assert _as_int(7) == 7 and _as_int(np.int64(3)) == 3
