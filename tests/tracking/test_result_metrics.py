"""``tracking/result_metrics.py``: RLlib's results flattened into gradmon metrics, and the progress line.

The copied metrics (``loss/*``, ``env/*``, ``perf/*``) against RLlib's own values: gradmon's
learner and STOCK RLlib ``PPOTorchLearner`` take the same minibatch from the same (perturbed, so
that the KL term is non-zero) weights, and the losses stock RLlib logs are what
``result_to_metrics`` must report for gradmon's result; ``env/*`` and ``perf/*`` from a result
dict keyed by RLlib's and Tune's own constants, not by strings typed here.
"""

from __future__ import annotations

import copy
import math

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
from gradmon_ray.tracking import heads_in, latched_heads, progress_line, result_to_metrics

MID = DEFAULT_MODULE_ID


def _result(**learner):
    return {
        "env_runners": {"episode_return_mean": 1.5, "episode_len_mean": 16.0, "num_env_steps_sampled_lifetime": 2048},
        "learners": {
            "default_policy": {"policy_loss": -0.1, "vf_loss": 0.3, "entropy": 9.0, "not_ours": 5, **learner},
            "__all_modules__": {"num_env_steps_trained": 4096.0},
        },
        "fault_tolerance": {"num_healthy_workers": 2, "num_remote_worker_restarts": 0},
        "time_this_iter_s": 1.25,
    }


def test_result_to_metrics_keeps_ours_and_maps_progress():
    metrics = result_to_metrics(
        _result(**{"grad/head/op/norm": 0.5, "latch/nan/op": 1, "update/skipped": 0, "grad/weird": "text"})
    )
    assert metrics == {
        "grad/head/op/norm": 0.5,
        "latch/nan/op": 1.0,
        "update/skipped": 0.0,
        mn.LEARNERS_UPDATED: 1.0,
        mn.EPISODE_RETURN_MEAN: 1.5,
        mn.EPISODE_LEN_MEAN: 16.0,
        mn.ENV_STEPS_SAMPLED_LIFETIME: 2048.0,
        mn.POLICY_LOSS: -0.1,
        mn.VF_LOSS: 0.3,
        mn.ENTROPY: 9.0,
        mn.ITERATION_TIME_S: 1.25,
        mn.ENV_RUNNERS_HEALTHY: 2.0,
        mn.ENV_RUNNER_RESTARTS: 0.0,
    }


def test_an_iteration_without_an_update_logs_no_learner_metrics():
    """What RLlib returns while its only EnvRunner is being restarted: NaN learner windows."""
    nan = float("nan")
    result = _result(**{"grad/head/op/norm": nan, "update/telemetry_iteration": nan, "update/skipped": nan})
    result["learners"]["__all_modules__"]["num_env_steps_trained"] = nan
    result["fault_tolerance"] = {"num_healthy_workers": 0, "num_remote_worker_restarts": 0}
    metrics = result_to_metrics(result)
    assert metrics == {
        mn.LEARNERS_UPDATED: 0.0,
        mn.EPISODE_RETURN_MEAN: 1.5,
        mn.EPISODE_LEN_MEAN: 16.0,
        mn.ENV_STEPS_SAMPLED_LIFETIME: 2048.0,
        mn.ITERATION_TIME_S: 1.25,
        mn.ENV_RUNNERS_HEALTHY: 0.0,
        mn.ENV_RUNNER_RESTARTS: 0.0,
    }
    assert progress_line(4, 9, metrics) == (
        "iter 4/9 | env steps 2048 | return 1.500 | "
        "no update: nothing to train on (0 EnvRunners healthy) | latched: none"
    )
    del result["learners"]["__all_modules__"]  # no learner results at all: the same
    assert result_to_metrics(result)[mn.LEARNERS_UPDATED] == 0.0


def test_missing_return_is_left_out_not_invented():
    result = _result()
    result["env_runners"]["episode_return_mean"] = float("nan")
    del result["env_runners"]["episode_len_mean"]
    metrics = result_to_metrics(result)
    assert mn.EPISODE_RETURN_MEAN not in metrics and mn.EPISODE_LEN_MEAN not in metrics


def test_heads_latches_and_progress_line():
    metrics = {
        "grad/head/op/norm": 0.5,
        "grad/head/slot/norm": 7.5,
        "grad/head/value/norm": 1.0,
        "grad/head/op/norm_prev": 0.4,
        "latch/nan/op": 0.0,
        "latch/nan/slot": 1.0,
        "latch/nan/slot/first_iteration": 3.0,
        "latch/inf/op": 1.0,
        mn.ENV_STEPS_SAMPLED_LIFETIME: 3072.0,
        mn.EPISODE_RETURN_MEAN: 2.25,
    }
    assert heads_in(metrics) == ["op", "slot", "value"]
    assert latched_heads(metrics, "nan") == ["slot"] and latched_heads(metrics, "inf") == ["op"]
    assert progress_line(3, 10, metrics) == (
        "iter 3/10 | env steps 3072 | return 2.250 | worst head slot 7.500 (exploding) | latched: op, slot"
    )
    assert progress_line(1, 2, {}) == "iter 1/2 | env steps ? | return n/a | telemetry off | latched: none"


def _norms(**norms: float) -> dict[str, float]:
    out = {mn.head_metric(mn.HEAD_GRAD_NORM, h): v for h, v in norms.items()}
    out.update({mn.ENV_STEPS_SAMPLED_LIFETIME: 1024.0, mn.EPISODE_RETURN_MEAN: 1.0})
    return out


def test_progress_line_names_the_weak_action_head_not_the_value_head():
    """value 3.0 is elevated only by the action heads' edges; the weak action head is the news."""
    line = progress_line(2, 20, _norms(op=0.05, slot=1.0, value=3.0))
    assert "worst head op 0.050 (weak)" in line
    line = progress_line(2, 20, _norms(op=0.09, slot=1.0, value=3.6))  # value further from 0.447 than op
    assert "worst head op 0.090 (weak)" in line


def test_progress_line_of_a_healthy_run_names_an_action_head():
    """The reported run: every action head healthy, value at 2.0-3.6, 'value' named worst (elevated)."""
    for value in (2.1, 2.8, 3.6):
        line = progress_line(5, 20, _norms(op=0.4, slot=1.2, tempo=0.3, value=value))
        assert "worst head slot 1.200 (healthy)" in line, line


def test_progress_line_can_include_the_value_head_judged_by_its_own_bands():
    metrics = _norms(op=0.4, slot=1.2, value=3.6)
    assert "worst head value 3.600 (healthy)" in progress_line(1, 2, metrics, include_value_head=True)
    metrics = _norms(op=0.4, slot=1.2, value=60.0)
    assert "worst head slot" in progress_line(1, 2, metrics)
    assert "worst head value 60.000 (exploding)" in progress_line(1, 2, metrics, include_value_head=True)
    from gradmon_ray.telemetry import BandSet

    tight = BandSet.from_dict({"value": {"healthy_max": 1.0, "elevated_max": 2.0}})
    assert "worst head value 3.600 (exploding)" in progress_line(
        1, 2, _norms(op=0.4, value=3.6), bands=tight, include_value_head=True
    )
    wide = BandSet.from_dict({"action": {"weak_below": 0.01, "dead_below": 0.001}})
    assert "worst head op 0.050 (healthy)" in progress_line(1, 2, _norms(op=0.05, slot=0.3, value=3.0), bands=wide)


def test_a_noise_scale_the_learner_left_out_stays_out_although_rllib_refills_it_with_nan():
    """RLlib reports a key missing from this iteration as NaN; an undefined noise scale is left
    out (never a NaN point), while a NaN norm ("no gradient") is kept: it means something."""
    nan = float("nan")
    metrics = result_to_metrics(
        _result(
            **{
                "grad/head/op/noise_scale": nan,
                "grad/head/slot/noise_scale": 12.5,
                "grad/noise_scale": nan,
                "grad/head/op/norm": nan,
            }
        )
    )
    assert "grad/head/op/noise_scale" not in metrics and "grad/noise_scale" not in metrics
    assert metrics["grad/head/slot/noise_scale"] == 12.5
    assert math.isnan(metrics["grad/head/op/norm"])


# --- copied from RLlib: against stock RLlib's own values and keys -------------------------------


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
