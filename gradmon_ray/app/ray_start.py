"""Starting Ray for a run or a sweep, and refusing one the cluster can never place.

Ray is started locally unless it is already running or ``resources.ray_address`` / ``RAY_ADDRESS``
name a cluster.  What the run (or each trial) asks for is checked before the MLflow run exists
(``resource_wait.check_fits``): one that can never be placed leaves no MLflow run or store behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from gradmon_ray.app.resource_wait import check_fits, ray_address_problem
from gradmon_ray.config import ConfigError, GradmonConfig
from gradmon_ray.envs.tune_registry import tune_registry_follows_this_job


def ray_address_of(cfg: GradmonConfig) -> str | None:
    """The Ray cluster this run connects to (config, then ``RAY_ADDRESS``); None: a local Ray."""
    return cfg.resources.ray_address or os.environ.get("RAY_ADDRESS")


def _ensure_ray(cfg: GradmonConfig, address: str | None) -> bool:
    """Start (or connect to) Ray; True if this call started it (so it should shut it down)."""
    import ray

    tune_registry_follows_this_job()  # Ray Tune's registry would keep an earlier job's id: see envs.tune_registry
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if address:
        problem = ray_address_problem(address)  # ray.init would retry silently until Ctrl-C
        if problem:
            raise ConfigError("resources.ray_address" if cfg.resources.ray_address else "RAY_ADDRESS", problem)
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=cfg.resources.num_cpus, **kwargs)
    return True


def start_ray(cfg: GradmonConfig, request: Callable[[], dict[str, float]]) -> bool:
    """Start (or connect to) Ray and check that ``request()`` (what the run asks for) can be placed;
    a Ray this call started is shut down again when it cannot.  True if this call started Ray (so
    the caller shuts it down at its end)."""
    import ray

    address = ray_address_of(cfg)
    started_ray = _ensure_ray(cfg, address)
    try:
        here = started_ray and not address
        check_fits(request(), ray_started_here=here, wait_s=cfg.resources.wait_for_resources_s)
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    return started_ray
