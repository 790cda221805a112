"""A learner and an EnvRunner in the current process, without a Ray cluster.

For benchmarks, tests and debugging: build exactly the learner a training run would build
(``build_ppo_config(cfg).build_learner``), sample real episodes with RLlib's own
``SingleAgentEnvRunner``, and turn them into the postprocessed train batch (GAE included)
that ``Learner.update(batch=...)`` consumes.
"""

from __future__ import annotations

from typing import Any

from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.learner.learner import Learner
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.env.multi_agent_env_runner import MultiAgentEnvRunner
from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner
from ray.rllib.policy.sample_batch import MultiAgentBatch
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME

from gradmon_ray import compat
from gradmon_ray.config import GradmonConfig
from gradmon_ray.rllib.config import build_ppo_config


def local_ppo_config(cfg: GradmonConfig, learner_class: type[Learner] | None = None) -> PPOConfig:
    """``build_ppo_config(cfg)`` for in-process use (no remote learners or env runners)."""
    config = build_ppo_config(cfg).env_runners(num_env_runners=0).learners(num_learners=0)
    if learner_class is not None:
        config = config.learners(learner_class=learner_class)
    return config


def env_spaces(cfg: GradmonConfig) -> tuple[Any, Any]:
    """The (observation, action) spaces of ``cfg``'s env, as an EnvRunner sees them."""
    runner = SingleAgentEnvRunner(config=local_ppo_config(cfg))
    try:
        return runner.env.single_observation_space, runner.env.single_action_space
    finally:
        runner.stop()


def module_spaces(cfg: GradmonConfig) -> dict[str, tuple[Any, Any]]:
    """``{module_id: (observation, action) space}`` of ``cfg``'s env, as its EnvRunners see them:
    ``DEFAULT_MODULE_ID`` for a single-agent env, one module per agent for a multi-agent one."""
    config = local_ppo_config(cfg)
    if not config.is_multi_agent:
        return {DEFAULT_MODULE_ID: env_spaces(cfg)}
    runner = MultiAgentEnvRunner(config=config)
    try:
        return {mid: (module.observation_space, module.action_space) for mid, module in runner.module.items()}
    finally:
        runner.stop()


def build_local_learner(cfg: GradmonConfig, learner_class: type[Learner] | None = None) -> Learner:
    """A built learner (gradmon's unless ``learner_class`` says otherwise) in this process."""
    return local_ppo_config(cfg, learner_class).build_learner(spaces=module_spaces(cfg))


def sample_episodes(cfg: GradmonConfig, learner: Learner, num_timesteps: int) -> list[Any]:
    """Episodes sampled by RLlib's EnvRunner with the learner's current weights."""
    config = local_ppo_config(cfg)
    runner = (MultiAgentEnvRunner if config.is_multi_agent else SingleAgentEnvRunner)(config=config)
    try:
        if config.is_multi_agent:
            runner.module.set_state(learner.module.get_state(inference_only=True))
        else:
            runner.module.set_state(learner.module[DEFAULT_MODULE_ID].get_state(inference_only=True))
        return runner.sample(num_timesteps=num_timesteps, random_actions=False)
    finally:
        runner.stop()


def train_batch(learner: Learner, episodes: list[Any]) -> MultiAgentBatch:
    """The learner connector's output (advantages, value targets, loss mask) as a batch."""
    data = TrainingData(episodes=episodes)
    data.validate()
    return compat.make_train_batch(learner, data)


def update(learner: Learner, batch: MultiAgentBatch, cfg: GradmonConfig) -> dict[str, Any]:
    """One training iteration's update on ``batch`` with the run's epochs/minibatch size."""
    return learner.update(
        batch=batch,
        timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: 0},
        num_epochs=cfg.ppo.num_epochs,
        minibatch_size=cfg.ppo.minibatch_size,
        shuffle_batch_per_epoch=True,
    )
