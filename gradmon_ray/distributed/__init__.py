"""The learners' Ray collective group and the packed per-iteration reduction."""

from gradmon_ray.distributed.collective import (
    LearnerCollective,
    ReplicaDivergenceError,
    new_group_name,
    parameter_checksum,
    resolve_backend,
)

__all__ = ["LearnerCollective", "ReplicaDivergenceError", "new_group_name", "parameter_checksum", "resolve_backend"]
