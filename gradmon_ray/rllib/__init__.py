"""Thin adapters to RLlib's new API stack: the multi-head RLModule, the learner, config.

Exports are resolved lazily (PEP 562): ``gradmon_ray.probe`` imports ``rllib.ppo_loss``
while the learner imports the probe's client, and an eager package import would make
that a cycle.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_ppo_config": "gradmon_ray.rllib.config",
    "resolve_env": "gradmon_ray.rllib.config",
    "FactoredCategorical": "gradmon_ray.rllib.distribution",
    "GradmonPPOTorchLearner": "gradmon_ray.rllib.learner",
    "VALUE_HEAD": "gradmon_ray.rllib.module",
    "FactoredActorCritic": "gradmon_ray.rllib.module",
    "HeadLayout": "gradmon_ray.rllib.module",
    "resolve_heads": "gradmon_ray.rllib.module",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
