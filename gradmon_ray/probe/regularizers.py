"""Moved to ``gradmon_ray.rllib.regularizers`` (the learner adds them to its loss)."""

from gradmon_ray.rllib.regularizers import BUILTIN_REGULARIZERS, RegularizerSpec, resolve_regularizer

__all__ = ["BUILTIN_REGULARIZERS", "RegularizerSpec", "resolve_regularizer"]
