"""Thin adapters to RLlib's new API stack: the drop-in monitor, the multi-head RLModule, PPO.

``with_gradmon(learner_cls)`` adds gradmon's telemetry to any RLlib ``TorchLearner``
subclass.  Exports are resolved lazily (PEP 562) so that importing one of them does not
import RLlib's learners for the others.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_ppo_config": "gradmon_ray.rllib.config",
    "resolve_env": "gradmon_ray.rllib.config",
    "FactoredCategorical": "gradmon_ray.losses.distribution",
    "GradmonPPOTorchLearner": "gradmon_ray.rllib.learner",
    "GradmonSettings": "gradmon_ray.rllib.settings",
    "VALUE_HEAD": "gradmon_ray.rllib.module",
    "FactoredActorCritic": "gradmon_ray.rllib.module",
    "HeadLayout": "gradmon_ray.rllib.module",
    "resolve_heads": "gradmon_ray.rllib.module",
    "with_gradmon": "gradmon_ray.rllib.monitor",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
