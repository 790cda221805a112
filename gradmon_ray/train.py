"""The main job: train PPO with the gradmon learner and stream telemetry to MLflow."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray.config import GradmonConfig
from gradmon_ray.tracking import MlflowSink, heads_in, latched_heads, progress_line, result_to_metrics

logger = logging.getLogger(__name__)


@dataclass
class TrainingOutcome:
    """What a finished (or failed) run leaves behind."""

    run_id: str | None
    iterations_done: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_path: str | None = None
    mlflow_complete: bool = False
    """True when every iteration reached MLflow before the sink was closed."""


def ensure_ray(cfg: GradmonConfig) -> bool:
    """Start (or connect to) Ray; True if this call started it (so it should shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.resources.ray_address or os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=cfg.resources.num_cpus, **kwargs)
    return True


def run_training(
    cfg: GradmonConfig,
    *,
    progress: Callable[[str], None] | None = print,
    sink: MlflowSink | None = None,
) -> TrainingOutcome:
    """Train ``cfg.iterations`` iterations; every iteration's telemetry goes to MLflow.

    Ray is started locally unless already running or ``resources.ray_address`` /
    ``RAY_ADDRESS`` name a cluster.  The sink is closed (flushed, run ended as FINISHED or
    FAILED) on the way out, whatever happens.
    """
    import ray

    from gradmon_ray.rllib import build_ppo_config

    started_ray = ensure_ray(cfg)
    if sink is None:
        sink = MlflowSink(
            cfg.mlflow.tracking_uri,
            cfg.mlflow.experiment,
            run_name=cfg.mlflow.run_name,
            params=cfg.to_flat_dict(),
            tags={mn.TAG_STATUS: "running"},
            max_pending=cfg.mlflow.queue_size,
        )
    outcome = TrainingOutcome(run_id=None, iterations_done=0)
    status = "FAILED"
    algo = None
    try:
        algo = build_ppo_config(cfg).build_algo()
        for iteration in range(1, cfg.iterations + 1):
            result = algo.train()
            metrics = result_to_metrics(result)
            sink.log_iteration(iteration, metrics, _latch_tags(metrics, iteration))
            outcome.iterations_done = iteration
            outcome.last_metrics = metrics
            if progress is not None:
                progress(progress_line(iteration, cfg.iterations, metrics))
        if cfg.checkpoint_dir:
            outcome.checkpoint_path = str(algo.save_to_path(os.path.abspath(cfg.checkpoint_dir)))
        status = "FINISHED"
        return outcome
    finally:
        if algo is not None:
            algo.stop()
        sink.log_iteration(outcome.iterations_done, {}, {mn.TAG_STATUS: status.lower()})
        outcome.mlflow_complete = sink.close(status=status)
        outcome.run_id = sink.run_id
        if not outcome.mlflow_complete:
            logger.warning(
                "MLflow at %s did not receive everything (dropped %d iterations, last error: %s)",
                sink.tracking_uri,
                sink.dropped_iterations,
                sink.last_error,
            )
        if started_ray:
            ray.shutdown()


def _latch_tags(metrics: dict[str, float], iteration: int) -> dict[str, str]:
    tags = {mn.TAG_HEAD_NAMES: ",".join(heads_in(metrics))} if iteration == 1 else {}
    for kind, tag in (("nan", mn.TAG_NAN_LATCHED_HEADS), ("inf", mn.TAG_INF_LATCHED_HEADS)):
        heads = latched_heads(metrics, kind)
        if heads:
            tags[tag] = ",".join(heads)
    return tags
