"""RLlib 2.60's APPO multi-agent data-balance scenario
(``rllib/algorithms/appo/tests/test_appo_multi_agent_data_balance.py``) with ``with_gradmon``.

Five CartPole agents, four mapped to ``policy_a`` and one to ``policy_b``: without a minibatch
size APPO trains each module on all of its own (unequal) rows; with one, RLlib's
``MiniBatchCyclicIterator`` hands every module the same number of rows.  RLlib's expectations
(ratio above 1.5, then equal counts) are premises here, asserted on the batch and on RLlib's own
iterator, not on the learner.  What is tested is the wrapped learner: the rows it trained per
module (RLlib's counter of ITS update) equal the batch's own row counts, then the iterator's; and
gradmon's per-module minibatch count equals the iterator's.  Catches a wrapper that drops or
repeats a module's minibatch, or counts another module's.  RLlib's test runs ``algo.train()``
with one EnvRunner; this one samples in-process and updates the learner directly (the learner thread needs Ray: e2e).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
from ray.rllib.utils.metrics import NUM_MODULE_STEPS_TRAINED
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

from gradmon_ray.rllib import with_gradmon
from tests.peer.pairs import HEADS, peek, sample_batch, shutdown_all

NUM_AGENTS = 5


def policy_mapping_fn(agent_id: Any, *args: Any, **kwargs: Any) -> str:
    """RLlib's test mapping: agents 0-3 -> ``policy_a``, agent 4 -> ``policy_b``."""
    return "policy_a" if agent_id in (0, 1, 2, 3) else "policy_b"


def _config() -> APPOConfig:
    return (
        APPOConfig()
        .environment(MultiAgentCartPole, env_config={"num_agents": NUM_AGENTS})
        .multi_agent(policies={"policy_a", "policy_b"}, policy_mapping_fn=policy_mapping_fn)
        .env_runners(num_env_runners=0, rollout_fragment_length=50)
        .learners(
            num_learners=0,
            learner_class=with_gradmon(APPOTorchLearner),
            learner_config_dict={"gradmon": {"heads": HEADS}},
        )
        # One reduction per update (each update waits for its batch); the simple queue trains
        # each batch exactly once (the circular buffer would re-sample it).
        .training(train_batch_size_per_learner=200, broadcast_interval=1, use_circular_buffer=False)
        .debugging(seed=0)
    )


def _spaces() -> dict[str, Any]:
    env = MultiAgentCartPole({"num_agents": NUM_AGENTS})
    return {
        "policy_a": (env.get_observation_space(0), env.get_action_space(0)),
        "policy_b": (env.get_observation_space(4), env.get_action_space(4)),
    }


@pytest.mark.e2e
def test_appo_data_balance_without_and_with_minibatches(ray_session) -> None:
    config = _config()
    learner = None
    try:
        learner = config.build_learner(spaces=_spaces())
        batch = sample_batch(config, learner, num_timesteps=100)  # env steps: ~4 agent steps of a per b
        rows = {mid: len(b) for mid, b in batch.policy_batches.items()}
        assert rows["policy_a"] / rows["policy_b"] > 1.5  # the premise: unequal data

        # RLlib's test_default_appo_unequal_data: each module trains on all of its own rows.
        results = learner.update(training_data=TrainingData(batch=copy.deepcopy(batch)), timesteps={})
        trained = {mid: peek(results, mid)[NUM_MODULE_STEPS_TRAINED] for mid in rows}
        assert trained == {mid: float(n) for mid, n in rows.items()}
        assert {mid: peek(results, mid)["update/minibatches"] for mid in rows} == {mid: 1.0 for mid in rows}

        # RLlib's test_minibatch_equalizes_data: minibatch_size=50, num_epochs=4.
        minibatches = list(
            MiniBatchCyclicIterator(
                copy.deepcopy(batch), num_epochs=4, minibatch_size=50, shuffle_batch_per_epoch=False
            )
        )
        expected_rows = {mid: sum(len(mb.policy_batches[mid]) for mb in minibatches) for mid in rows}
        assert expected_rows["policy_a"] == expected_rows["policy_b"]  # the premise: RLlib balances
        results = learner.update(
            training_data=TrainingData(batch=copy.deepcopy(batch)), timesteps={}, minibatch_size=50, num_epochs=4
        )
        trained = {mid: peek(results, mid)[NUM_MODULE_STEPS_TRAINED] for mid in rows}
        assert trained == {mid: float(n) for mid, n in expected_rows.items()}
        assert {mid: peek(results, mid)["update/minibatches"] for mid in rows} == {
            mid: float(len(minibatches)) for mid in rows
        }
        assert len(minibatches) >= 4 * rows["policy_a"] // 50  # a covers 4 epochs; b cycles more often
    finally:
        shutdown_all([learner])
