"""Two learners (DDP + the packed reduction) report the norms one learner computes on the whole batch."""

from __future__ import annotations

import hashlib

import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib import build_ppo_config
from gradmon_ray.rllib.local_learner import build_local_learner, env_spaces, sample_episodes, train_batch

pytestmark = pytest.mark.e2e


def _weights_hash(module) -> str:
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def _remote_view(learner) -> dict:
    return {
        "weights": _weights_hash(learner.module[DEFAULT_MODULE_ID].unwrapped()),
        "norms": dict(learner.last_telemetry.head_norms) if learner.last_telemetry else None,
        "global": learner.last_telemetry.global_norm if learner.last_telemetry else None,
        "minibatches": learner.last_telemetry.minibatches if learner.last_telemetry else None,
    }


def test_reduced_norms_equal_single_learner_on_the_same_global_batch(ray_session):
    data = {
        "seed": 11,
        "ppo": {"train_batch_size": 512, "minibatch_size": 512, "num_epochs": 1, "grad_clip": None},
        "model": {"trunk_hiddens": [32, 32]},
    }
    cfg = config_from_dict(data)
    single = build_local_learner(cfg)
    batch = train_batch(single, sample_episodes(cfg, single, 512))
    module_batch = batch.policy_batches[DEFAULT_MODULE_ID]
    rows = module_batch[Columns.OBS].shape[0] // 2 * 2
    for key in list(module_batch.keys()):  # an even row count: two equal shards
        module_batch[key] = (
            module_batch[key][:rows]
            if not isinstance(module_batch[key], dict)
            else {k: v[:rows] for k, v in module_batch[key].items()}
        )
    module_batch[Columns.LOSS_MASK] = torch.ones(rows, dtype=torch.bool)  # mean of shard means == global mean
    batch.policy_batches[DEFAULT_MODULE_ID].count = rows

    two = config_from_dict({**data, "resources": {"num_learners": 2, "num_env_runners": 0}})
    group = build_ppo_config(two).build_learner_group(spaces={DEFAULT_MODULE_ID: env_spaces(two)})
    try:
        before = [r.get() for r in group.foreach_learner(_remote_view)]
        assert {v["weights"] for v in before} == {_weights_hash(single.module[DEFAULT_MODULE_ID].unwrapped())}

        single.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        group.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        after = [r.get() for r in group.foreach_learner(_remote_view)]
    finally:
        group.shutdown()
    expected = single.last_telemetry
    assert expected.minibatches == 1
    for view in after:
        assert view["minibatches"] == 1
        for head, value in expected.head_norms.items():
            assert view["norms"][head] == pytest.approx(value, rel=1e-4), head
        assert view["global"] == pytest.approx(expected.global_norm, rel=1e-4)
    assert after[0]["weights"] == after[1]["weights"]
