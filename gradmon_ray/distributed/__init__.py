"""The learners' Ray collective group and the packed per-iteration reduction."""

from gradmon_ray.distributed.collective import (
    LearnerCollective,
    ModuleLanes,
    ReducedIteration,
    ReplicaDivergenceError,
    Segments,
    new_group_name,
    parameter_checksum,
    reduce_iteration,
    reduce_modules,
    resolve_backend,
)
from gradmon_ray.distributed.noise_hook import NoiseScaleHook

__all__ = [
    "LearnerCollective",
    "ModuleLanes",
    "NoiseScaleHook",
    "ReducedIteration",
    "ReplicaDivergenceError",
    "Segments",
    "new_group_name",
    "parameter_checksum",
    "reduce_iteration",
    "reduce_modules",
    "resolve_backend",
]
