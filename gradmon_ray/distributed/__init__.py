"""The learners' Ray collective group and the packed per-iteration reduction."""

from gradmon_ray.distributed.collective import (
    LearnerCollective,
    ReducedIteration,
    ReplicaDivergenceError,
    Segments,
    new_group_name,
    parameter_checksum,
    reduce_iteration,
    resolve_backend,
)
from gradmon_ray.distributed.noise_hook import NoiseScaleHook

__all__ = [
    "LearnerCollective",
    "NoiseScaleHook",
    "ReducedIteration",
    "ReplicaDivergenceError",
    "Segments",
    "new_group_name",
    "parameter_checksum",
    "reduce_iteration",
    "resolve_backend",
]
