"""Two real learner actors (DDP over gloo): VGS must apply the identical scale on both."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib import build_ppo_config

pytestmark = pytest.mark.e2e


def _replica_fingerprint(learner) -> dict:
    module = learner.module["default_policy"].unwrapped()
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    vgs = learner.vgs.state_dict()
    return {
        "params": digest.hexdigest(),
        "vgs_mean_ema": vgs["param_grad_mean_ema"].numpy(),
        "vgs_sq_ema": vgs["param_grad_sq_ema"].numpy(),
        "scale": learner.vgs.get_scaling_factor(),
        "steps": vgs["step_count"],
    }


def test_two_learners_apply_identical_vgs_scale_and_stay_identical(ray_session):
    cfg = config_from_dict(
        {
            "seed": 3,
            "optimizer": "upgd",
            "vgs": {"enabled": True, "warmup_steps": 0, "alpha": 2.0},
            "resources": {"num_learners": 2, "num_env_runners": 0},  # sampled here: no EnvRunner process to start
            "ppo": {"train_batch_size": 400, "minibatch_size": 50, "num_epochs": 2, "lr": 1e-3},
            "model": {"trunk_hiddens": [32, 32]},
        }
    )
    algo = build_ppo_config(cfg).build_algo()
    try:
        for _ in range(2):
            result = algo.train()
        fingerprints = algo.learner_group.foreach_learner(_replica_fingerprint)
    finally:
        algo.stop()
    values = [r.get() for r in fingerprints]  # CallResult.get() re-raises a failed call
    assert len(values) == 2
    first, second = values
    assert first["steps"] == second["steps"] > 0
    assert first["scale"] == second["scale"] < 1.0
    assert np.array_equal(first["vgs_mean_ema"], second["vgs_mean_ema"])
    assert np.array_equal(first["vgs_sq_ema"], second["vgs_sq_ema"])
    assert first["params"] == second["params"]  # UPGD's seeded noise keeps replicas identical
    assert result["learners"]["default_policy"][mn.VGS_SCALING_FACTOR] == pytest.approx(first["scale"], rel=1e-6)
