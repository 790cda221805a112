"""``rllib.shared_gradients``: each policy's gradient on a shared encoder, RLlib's own example's modules.

``multi_agent/shared_encoder_cartpole.py``: VPG, an encoder module with no loss of its own under
two policy modules, one optimizer.  Oracle: after the update, each policy's VPG loss written by hand
(``tests.peer.rllib_examples.vpg_oracle_loss``, ``torch.distributions.Categorical``) on the same
batch, differentiated alone with ``torch.autograd.grad`` on the encoder module's own parameters
(fetched by attribute name), norms and cosine in numpy float64.

Bugs this catches: the summed gradient reported for each policy, a policy's own head counted as
shared, the cosine of another pair, the analysis touching the learner's ``.grad`` or weights.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.env.multi_agent_env_runner import MultiAgentEnvRunner

from gradmon_ray import compat
from gradmon_ray import metric_names as mn
from gradmon_ray.rllib import with_gradmon
from gradmon_ray.tracking.diagnosis_tags import SHARED_COSINES_KEY
from tests.peer.rllib_examples import SharedOptimizerVPGLearner, vpg_oracle_loss
from tests.peer.test_rllib_examples import SHARED_ENCODER_GRADMON, SHARED_ENCODER_ID, _shared_encoder_config


def _value(results, module_id, key):
    value = results[module_id][key]
    return value.peek() if hasattr(value, "peek") else value


def test_each_policys_gradient_on_the_shared_encoder_and_their_cosine_against_autograd():
    settings = {**SHARED_ENCODER_GRADMON, "shared_gradients_every": 1}
    config = (
        _shared_encoder_config()
        .learners(learner_class=with_gradmon(SharedOptimizerVPGLearner))
        .training(learner_config_dict={"gradmon": settings})
    )
    from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole

    learner = config.build_learner(env=MultiAgentCartPole({"num_agents": 2}))
    runner = MultiAgentEnvRunner(config=config)
    try:
        runner.module.set_state(learner.module.get_state(inference_only=True))
        episodes = runner.sample(num_episodes=4, random_actions=False)
    finally:
        runner.stop()
    batch = compat.make_train_batch(learner, TrainingData(episodes=episodes))
    columns = {mid: dict(part) for mid, part in learner._convert_batch_type(batch).policy_batches.items()}
    results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    encoder = list(learner.module[SHARED_ENCODER_ID].parameters())  # the shared module's own parameters
    vectors = {}
    for policy in ("p0", "p1"):
        batch_copy = {mid: dict(cols) for mid, cols in columns.items()}
        fwd = learner.module.forward_train(batch_copy)
        loss = vpg_oracle_loss(learner, policy, columns[policy], fwd[policy])
        grads = torch.autograd.grad(loss, encoder)
        vectors[policy] = np.concatenate([g.detach().double().numpy().ravel() for g in grads])
    for policy, other in (("p0", "p1"), ("p1", "p0")):
        norm = np.linalg.norm(vectors[policy])
        cosine = vectors[policy] @ vectors[other] / (norm * np.linalg.norm(vectors[other]))
        assert _value(results, policy, mn.SHARED_GRAD_NORM) == pytest.approx(norm, rel=1e-4)
        assert _value(results, policy, mn.SHARED_GRAD_COSINE_MIN) == pytest.approx(cosine, rel=1e-4, abs=1e-6)
    (pairs,) = _value(results, "__all_modules__", SHARED_COSINES_KEY)
    cosine = vectors["p0"] @ vectors["p1"] / (np.linalg.norm(vectors["p0"]) * np.linalg.norm(vectors["p1"]))
    assert json.loads(pairs) == {"p0_vs_p1": pytest.approx(cosine, rel=1e-4, abs=1e-6)}
