"""Oracles for the metrics copied from RLlib's result dict (``loss/*``, ``env/*``, ``perf/*``).

``loss/*``: gradmon's learner and STOCK RLlib ``PPOTorchLearner`` take the same minibatch from
the same (perturbed, so that the KL term is non-zero) weights; the losses stock RLlib logs
are what ``result_to_metrics`` must report for gradmon's result.  ``env/*`` and ``perf/*``:
a result dict keyed by RLlib's and Tune's own constants, not by strings typed here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from ray.rllib.algorithms.ppo.ppo import LEARNER_RESULTS_KL_KEY
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.learner.learner import ENTROPY_KEY, POLICY_LOSS_KEY, VF_LOSS_KEY, Learner
from ray.rllib.utils.metrics import (
    ALL_MODULES,
    ENV_RUNNER_RESULTS,
    EPISODE_LEN_MEAN,
    EPISODE_RETURN_MEAN,
    FAULT_TOLERANCE_STATS,
    LEARNER_RESULTS,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    NUM_ENV_STEPS_TRAINED,
)
from ray.tune.result import TIME_THIS_ITER_S

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch
from gradmon_ray.tracking import result_to_metrics

MID = DEFAULT_MODULE_ID


def _plain(results) -> dict:
    """RLlib's reduced learner results as plain floats (they may be Stats or tensors)."""

    def value(v):
        v = v.peek() if hasattr(v, "peek") else v
        return float(v) if not isinstance(v, dict) else {k: value(x) for k, x in v.items()}

    return {mid: {k: value(v) for k, v in d.items()} for mid, d in results.items()}


def test_loss_metrics_equal_what_stock_rllib_ppo_logs_for_the_same_minibatch():
    cfg = config_from_dict(
        {
            "seed": 11,
            "ppo": {
                "train_batch_size": 128,
                "minibatch_size": 128,
                "num_epochs": 1,
                "use_kl_loss": True,
                "kl_coeff": 0.3,
            },
            "model": {"trunk_hiddens": [16]},
        }
    )
    gradmon = build_local_learner(cfg)
    stock = build_local_learner(cfg, learner_class=PPOTorchLearner)
    episodes = sample_episodes(cfg, gradmon, 128)
    gen = torch.Generator().manual_seed(0)
    state = {
        k: torch.as_tensor(v) + 0.05 * torch.randn(tuple(v.shape), generator=gen)
        for k, v in gradmon.module[MID].get_state().items()
    }
    for learner in (gradmon, stock):
        learner.module[MID].set_state(state)  # off the sampling policy: KL and clipping matter
    logged = {}
    for name, learner in (("gradmon", gradmon), ("stock", stock)):
        batch = train_batch(learner, copy.deepcopy(episodes))  # the connector edits episodes in place
        logged[name] = _plain(learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None))
    theirs = logged["stock"][MID]
    assert abs(theirs[LEARNER_RESULTS_KL_KEY]) > 1e-5  # the KL term is really exercised

    metrics = result_to_metrics({LEARNER_RESULTS: logged["gradmon"]})
    assert metrics[mn.LEARNERS_UPDATED] == 1.0
    expected = {
        mn.POLICY_LOSS: theirs[POLICY_LOSS_KEY],
        mn.VF_LOSS: theirs[VF_LOSS_KEY],
        mn.ENTROPY: theirs[ENTROPY_KEY],
        mn.MEAN_KL: theirs[LEARNER_RESULTS_KL_KEY],
        mn.TOTAL_LOSS: theirs[Learner.TOTAL_LOSS_KEY],
    }
    for name, want in expected.items():
        assert metrics[name] == pytest.approx(want, rel=1e-4, abs=1e-7), name


def test_progress_metrics_are_copied_from_rllibs_own_result_keys():
    """Distinct values under RLlib's and Tune's constants: each lands in its own metric."""
    result = {
        ENV_RUNNER_RESULTS: {EPISODE_RETURN_MEAN: 1.25, EPISODE_LEN_MEAN: 17.0, NUM_ENV_STEPS_SAMPLED_LIFETIME: 4096},
        LEARNER_RESULTS: {ALL_MODULES: {NUM_ENV_STEPS_TRAINED: 512.0}, MID: {POLICY_LOSS_KEY: -0.5}},
        # Algorithm._run_one_training_iteration_and_evaluation_in_parallel / training_step spell these
        FAULT_TOLERANCE_STATS: {"num_healthy_workers": 3, "num_remote_worker_restarts": 2},
        TIME_THIS_ITER_S: 0.75,
    }
    metrics = result_to_metrics(result)
    assert {k: metrics[k] for k in metrics if not k.startswith("loss/")} == {
        mn.LEARNERS_UPDATED: 1.0,
        mn.EPISODE_RETURN_MEAN: 1.25,
        mn.EPISODE_LEN_MEAN: 17.0,
        mn.ENV_STEPS_SAMPLED_LIFETIME: 4096.0,
        mn.ENV_RUNNERS_HEALTHY: 3.0,
        mn.ENV_RUNNER_RESTARTS: 2.0,
        mn.ITERATION_TIME_S: 0.75,
    }
    assert metrics[mn.POLICY_LOSS] == -0.5
