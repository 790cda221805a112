"""Two real learner actors (DDP over gloo), one build: they report the norms one learner computes on
the whole batch, and VGS applies the identical scale on both.

The module's fixture builds one two-learner algorithm (VGS on, UPGD) and records, in order: one
update of its learner group on a batch a local single learner of the same config updates too, then
one ``train()`` iteration (8 minibatch updates per learner); the tests read the record (a build
starts two actor processes).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib import build_ppo_config
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch

pytestmark = pytest.mark.e2e

DATA = {
    "seed": 3,
    "optimizer": "upgd",
    "vgs": {"enabled": True, "warmup_steps": 0, "alpha": 2.0},
    "ppo": {"train_batch_size": 400, "minibatch_size": 50, "num_epochs": 2, "lr": 1e-3, "grad_clip": None},
    "model": {"trunk_hiddens": [32, 32]},
}


def _weights_hash(module) -> str:
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def _remote_view(learner) -> dict:
    tele = learner.last_telemetry
    return {
        "weights": _weights_hash(learner.module[DEFAULT_MODULE_ID].unwrapped()),
        "norms": dict(tele.head_norms) if tele else None,
        "global": tele.global_norm if tele else None,
        "minibatches": tele.minibatches if tele else None,
    }


def _replica_fingerprint(learner) -> dict:
    vgs = learner.vgs.state_dict()
    return {
        "params": _weights_hash(learner.module[DEFAULT_MODULE_ID].unwrapped()),
        "vgs_mean_ema": vgs["param_grad_mean_ema"].numpy(),
        "vgs_sq_ema": vgs["param_grad_sq_ema"].numpy(),
        "scale": learner.vgs.get_scaling_factor(),
        "steps": vgs["step_count"],
    }


def _whole_batch(cfg, single) -> Any:
    """512 sampled rows cut to an even count, every row in the loss: two equal shards whose means'
    mean is the whole batch's mean."""
    batch = train_batch(single, sample_episodes(cfg, single, 512))
    module_batch = batch.policy_batches[DEFAULT_MODULE_ID]
    rows = module_batch[Columns.OBS].shape[0] // 2 * 2
    for key in list(module_batch.keys()):
        module_batch[key] = (
            module_batch[key][:rows]
            if not isinstance(module_batch[key], dict)
            else {k: v[:rows] for k, v in module_batch[key].items()}
        )
    module_batch[Columns.LOSS_MASK] = torch.ones(rows, dtype=torch.bool)
    batch.policy_batches[DEFAULT_MODULE_ID].count = rows
    return batch


@pytest.fixture(scope="module")
def record(ray_session) -> dict[str, Any]:
    single_cfg = config_from_dict(DATA)
    single = build_local_learner(single_cfg)
    initial = _weights_hash(single.module[DEFAULT_MODULE_ID].unwrapped())
    batch = _whole_batch(single_cfg, single)
    cfg = config_from_dict({**DATA, "resources": {"num_learners": 2, "num_env_runners": 0}})  # sampled here
    algo = build_ppo_config(cfg).build_algo()
    try:
        group = algo.learner_group
        before = [r.get() for r in group.foreach_learner(_remote_view)]
        single.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        group.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        after = [r.get() for r in group.foreach_learner(_remote_view)]  # CallResult.get() re-raises
        result = algo.train()  # 8 more updates per learner (a second iteration repeated them)
        fingerprints = [r.get() for r in group.foreach_learner(_replica_fingerprint)]
    finally:
        algo.stop()
    return {
        "single": single,
        "initial": initial,
        "before": before,
        "after": after,
        "fingerprints": fingerprints,
        "result": result,
    }


def test_reduced_norms_equal_single_learner_on_the_same_global_batch(record):
    expected = record["single"].last_telemetry
    assert {v["weights"] for v in record["before"]} == {record["initial"]}  # the single learner's weights
    assert expected.minibatches == 1
    for view in record["after"]:
        assert view["minibatches"] == 1
        for head, value in expected.head_norms.items():
            assert view["norms"][head] == pytest.approx(value, rel=1e-4), head
        assert view["global"] == pytest.approx(expected.global_norm, rel=1e-4)
    assert record["after"][0]["weights"] == record["after"][1]["weights"]


def test_two_learners_apply_identical_vgs_scale_and_stay_identical(record):
    first, second = record["fingerprints"]
    assert first["steps"] == second["steps"] > 0
    assert first["scale"] == second["scale"] < 1.0
    assert np.array_equal(first["vgs_mean_ema"], second["vgs_mean_ema"])
    assert np.array_equal(first["vgs_sq_ema"], second["vgs_sq_ema"])
    assert first["params"] == second["params"]  # UPGD's seeded noise keeps replicas identical
    result = record["result"]["learners"]["default_policy"]
    assert result[mn.VGS_SCALING_FACTOR] == pytest.approx(first["scale"], rel=1e-6)
