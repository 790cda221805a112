"""Thin adapters to RLlib's new API stack: the multi-head RLModule, the learner, config."""

from gradmon_ray.rllib.config import build_ppo_config, resolve_env
from gradmon_ray.rllib.distribution import FactoredCategorical
from gradmon_ray.rllib.learner import GradmonPPOTorchLearner
from gradmon_ray.rllib.module import VALUE_HEAD, FactoredActorCritic, HeadLayout, resolve_heads

__all__ = [
    "VALUE_HEAD",
    "FactoredActorCritic",
    "FactoredCategorical",
    "GradmonPPOTorchLearner",
    "HeadLayout",
    "build_ppo_config",
    "resolve_env",
    "resolve_heads",
]
