"""The learners' Ray collective group and the packed per-iteration reduction."""

from gradmon_ray.distributed.agreement import CollectiveTimeoutError, LearnerCollectiveError, LearnerDisagreementError
from gradmon_ray.distributed.collective import (
    LearnerCollective,
    ModuleLanes,
    ReducedIteration,
    Segments,
    new_group_name,
    reduce_iteration,
    reduce_modules,
    resolve_backend,
)
from gradmon_ray.distributed.noise_hook import NoiseScaleHook
from gradmon_ray.distributed.replica_checksum import ReplicaDivergenceError, parameter_checksum

__all__ = [
    "CollectiveTimeoutError",
    "LearnerCollective",
    "LearnerCollectiveError",
    "LearnerDisagreementError",
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
