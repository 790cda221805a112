"""Zero-config heads end to end: ``with_gradmon(PPOTorchLearner)`` on RLlib's default module for a
``MultiDiscrete([3, 4])`` env with NO gradmon settings at all, two real ``train()`` calls on local Ray
(``.ci/run`` runs this module on the oldest supported Ray too).

Values are checked against autograd of the sliced output layer in
``tests/rllib/test_zero_config_heads.py``; here: every component's norm, latch and head health
arrive under ONE name (``a0``, ``a1``) in RLlib's result, next to ``vf``, and the whole policy
head ``pi`` is not reported.  Bugs this catches: zero-config heads not reached from the learner
(it would refuse to build), latches still named ``head_0``, the value head missing.
"""

from __future__ import annotations

import math

import pytest
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

from gradmon_ray import metric_names as mn
from gradmon_ray.rllib import with_gradmon
from tests.fixtures.user_envs import MatchTwoEnv

pytestmark = pytest.mark.e2e

SIZES = {"a0": 3, "a1": 4}


def test_multidiscrete_default_module_reports_each_component_without_heads(ray_session):
    config = (
        PPOConfig()
        .environment(MatchTwoEnv)
        .env_runners(num_env_runners=0)
        .learners(num_learners=0, learner_class=with_gradmon(PPOTorchLearner))  # no learner_config_dict
        .training(train_batch_size_per_learner=128, minibatch_size=None, num_epochs=1)  # one minibatch
        .reporting(log_gradients=True)  # RLlib's own global norm of the (one) minibatch: the oracle
        .debugging(seed=0)
    )
    algo = config.build_algo()
    try:
        results = [dict(algo.train()["learners"]["default_policy"]) for _ in range(2)]  # .ci/run's oldest-Ray lane
    finally:
        algo.stop()
    logged = results[-1]
    assert [r[mn.MINIBATCH_UPDATES] for r in results] == [1.0, 1.0]  # both iterations trained
    norms = {head: logged[mn.head_metric(mn.HEAD_GRAD_NORM, head)] for head in ("a0", "a1", "vf")}
    assert logged[mn.MINIBATCH_UPDATES] == 1.0  # the premise: RLlib's window-1 norm is of the same minibatch
    # The values, through RLlib's real train(): the global norm is RLlib's own (log_gradients);
    # the heads are disjoint parameter sets (a0 and a1: row slices of one layer), so their squares
    # add up to at most its square.  Each head's value: autograd, in test_zero_config_heads.py.
    rllib_norm = logged["gradients_default_optimizer_global_norm"]
    assert logged[mn.GLOBAL_GRAD_NORM] == pytest.approx(rllib_norm, rel=1e-5)
    assert sum(v * v for v in norms.values()) <= rllib_norm**2 * (1 + 1e-6), norms
    assert mn.head_metric(mn.HEAD_GRAD_NORM, "pi") not in logged
    for head, n in SIZES.items():
        assert 0.0 < logged[mn.head_metric(mn.HEAD_ENTROPY, head)] <= math.log(n) + 1e-6, head
        assert logged[mn.head_metric(mn.HEAD_NAN_LATCH, head)] == 0.0
    # RLlib's own entropy of the same (last) minibatch is the sum over the components.
    entropies = sum(logged[mn.head_metric(mn.HEAD_ENTROPY, h)] for h in SIZES)
    assert entropies == pytest.approx(logged["entropy"], rel=1e-5)
