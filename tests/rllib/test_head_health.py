"""``rllib/head_health.py``: per-head policy entropy and KL against RLlib's OWN loss code, in a real run.

The drop-in ``with_gradmon(PPOTorchLearner)`` on RLlib's default module with a
``MultiDiscrete([3, 4])`` action space: RLlib's ``TorchMultiCategorical`` and its stock PPO loss
compute ``entropy`` and ``mean_kl_loss`` (KL(sampling || current), masked mean, logged with
window=1, so the result holds the iteration's last minibatch).  For a factored distribution both
are sums over the heads, so the sum of gradmon's per-head values of the same (last) minibatch
must equal them.  The metrics must then be in a real MLflow sqlite store at the same steps.

Bugs this catches: the KL direction swapped (KL(current || sampling) differs once the policy
moved), the wrong minibatch (the first instead of the last: entropy moves across 8 updates),
wrong head slices or sizes, log base, the mask, entropy_norm normalised by the wrong size, a
dropped ``policy/`` prefix on the way to MLflow, and ``vf_explained_var`` not reaching MLflow.
"""

from __future__ import annotations

import math

import gymnasium as gym
import pytest
from mlflow.tracking import MlflowClient
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

from gradmon_ray import metric_names as mn
from gradmon_ray.rllib import with_gradmon
from gradmon_ray.rllib.head_health import head_sizes
from gradmon_ray.rllib.heads import latch_heads
from gradmon_ray.tracking import GradmonMLflowCallback
from tests.fixtures.user_envs import MatchTwoEnv
from tests.rllib.user_module import default_ppo_module

SIZES = {"a0": 3, "a1": 4}  # MatchTwoEnv's MultiDiscrete([3, 4]): zero-config names a0, a1


@pytest.mark.parametrize(
    ("space", "sizes"),
    [
        (gym.spaces.MultiDiscrete([3, 4]), (3, 4)),
        (gym.spaces.Dict({"b": gym.spaces.Discrete(4), "a": gym.spaces.Discrete(2)}), (2, 4)),  # sorted keys
        (gym.spaces.Discrete(5), (5,)),
        (gym.spaces.Box(-1.0, 1.0, (2,)), None),  # a Gaussian: no per-head categorical entropy
    ],
)
def test_head_sizes_follow_the_latch_heads_of_rllibs_default_module(space, sizes):
    module = default_ppo_module(space)
    assert head_sizes(module, latch_heads(module)) == sizes


@pytest.mark.e2e  # a real algorithm on a local Ray
def test_dropin_head_entropy_and_kl_sum_to_rllibs_own_entropy_and_mean_kl_loss(ray_session, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = (
        PPOConfig()
        .environment(MatchTwoEnv)
        .env_runners(num_env_runners=0)
        .learners(
            num_learners=0,
            learner_class=with_gradmon(PPOTorchLearner),
            learner_config_dict={"gradmon": {"heads": {"pi": r"^pi\.", "vf": r"^vf\."}}},
        )
        .training(
            train_batch_size_per_learner=256,
            minibatch_size=64,
            num_epochs=2,
            lr=3e-3,  # the policy moves: KL of the last minibatch is far from 0
            use_kl_loss=True,
            kl_coeff=0.2,
        )
        .callbacks(GradmonMLflowCallback.configured(tracking_uri=uri, experiment="head-health"))
        .debugging(seed=0)
    )
    algo = config.build_algo()
    try:
        learners = [dict(algo.train()["learners"]["default_policy"]) for _ in range(2)]
        callback = next(c for c in algo.callbacks if isinstance(c, GradmonMLflowCallback))
        run_id = callback.sink.wait_for_run(30)
    finally:
        algo.stop()

    for learner in learners:
        entropy = {h: learner[mn.head_metric(mn.HEAD_ENTROPY, h)] for h in SIZES}
        kl = {h: learner[mn.head_metric(mn.HEAD_KL, h)] for h in SIZES}
        assert sum(entropy.values()) == pytest.approx(learner["entropy"], rel=1e-5)
        assert sum(kl.values()) == pytest.approx(learner["mean_kl_loss"], rel=1e-5, abs=1e-9)
        assert learner["mean_kl_loss"] > 1e-4  # a real KL, not two zeros agreeing
        for head, n in SIZES.items():
            assert 0.0 < entropy[head] <= math.log(n) + 1e-6
            norm = learner[mn.head_metric(mn.HEAD_ENTROPY_NORM, head)]
            assert norm == pytest.approx(entropy[head] / math.log(n), rel=1e-12)
            assert learner[mn.head_metric(mn.HEAD_COLLAPSE_LATCH, head)] == 0.0  # default 0.05: not collapsed

    client = MlflowClient(uri)
    for step, learner in enumerate(learners, 1):
        for template in (mn.HEAD_ENTROPY, mn.HEAD_ENTROPY_NORM, mn.HEAD_KL, mn.HEAD_COLLAPSE_LATCH):
            for head in SIZES:
                name = mn.head_metric(template, head)
                history = {m.step: m.value for m in client.get_metric_history(run_id, name)}
                assert history[step] == pytest.approx(learner[name], rel=1e-12), (name, step)
        explained = {m.step: m.value for m in client.get_metric_history(run_id, mn.VF_EXPLAINED_VAR)}
        assert explained[step] == pytest.approx(learner["vf_explained_var"], rel=1e-12)
