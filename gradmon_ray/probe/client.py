"""Moved to ``gradmon_ray.rllib.probe_client`` (the learner's side lives with the learner)."""

from gradmon_ray.rllib.probe_client import ProbeClient

__all__ = ["ProbeClient"]
