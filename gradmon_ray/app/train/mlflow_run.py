"""The MLflow run of a ``gradmon-ray train`` job: its name, params and tags, the sink that writes it,
what is announced once it exists, and the count of what MLflow did not get at its end."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray.app.run_names import default_run_name
from gradmon_ray.app.train.checkpoints import checkpoint_root
from gradmon_ray.config import GradmonConfig
from gradmon_ray.tracking import MlflowSink
from gradmon_ray.tracking.mlflow_sink import PlotFn
from gradmon_ray.tracking.redact import redact_text
from gradmon_ray.tracking.spill import default_spill_path
from gradmon_ray.tracking.store_uri import absolute_tracking_uri

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunStarted:
    """What ``run_training`` announces once the MLflow run exists, before the first iteration."""

    run_id: str | None
    """None: MLflow has not created the run in time (``mlflow.offline_ok`` with the store away)."""
    run_name: str | None
    experiment: str
    tracking_uri: str


def plotter(plots_every: int) -> PlotFn | None:
    """The sink's ``plot_fn`` when plots are on: viz's ``log_plots``, wired here because tracking never imports viz."""
    if plots_every <= 0:
        return None
    from gradmon_ray.viz.report import log_plots  # matplotlib: only when plots are drawn

    return log_plots


def mlflow_params(cfg: GradmonConfig) -> dict[str, Any]:
    """``cfg.to_flat_dict()`` as the run's MLflow params (and spill header): credentials masked."""
    return {k: redact_text(v) if isinstance(v, str) else v for k, v in cfg.to_flat_dict().items()}


def checkpoint_tags(cfg: GradmonConfig) -> dict[str, str]:
    """The tag ``--resume`` finds the run's checkpoints by (none when checkpoints are off)."""
    return {mn.TAG_CHECKPOINT_DIR: str(checkpoint_root(cfg))} if cfg.checkpoint_every > 0 else {}


def named(cfg: GradmonConfig) -> GradmonConfig:
    """``cfg`` with a run name: its own, else a copy named ``default_run_name(env)`` (so the params and
    the checkpoints' config record the name the run got; the caller's config is left alone)."""
    if cfg.mlflow.run_name is not None:
        return cfg
    copy = cfg.model_copy(deep=True)
    copy.mlflow.run_name = default_run_name(cfg.env.id)
    return copy


def open_run_sink(cfg: GradmonConfig) -> MlflowSink:
    """The sink of a new run of ``cfg`` (named: see ``named``); MLflow creates the run on the sink's thread."""
    return MlflowSink(
        cfg.mlflow.tracking_uri,
        cfg.mlflow.experiment,
        run_name=cfg.mlflow.run_name,
        params=mlflow_params(cfg),
        tags={mn.TAG_STATUS: "running", **checkpoint_tags(cfg)},
        max_pending=cfg.mlflow.queue_size,
        plots_every=cfg.mlflow.plots_every,
        plot_fn=plotter(cfg.mlflow.plots_every),
        spill_path=default_spill_path(cfg.mlflow.spill_dir, cfg.mlflow.run_name),
    )


def last_logged_iteration(tracking_uri: str, run_id: str) -> int:
    """The last step of ``run_id``'s ``update/trained`` history in MLflow (0: none, or unreadable)."""
    from mlflow.tracking import MlflowClient

    try:
        history = MlflowClient(absolute_tracking_uri(tracking_uri)).get_metric_history(run_id, mn.LEARNERS_UPDATED)
    except Exception as exc:  # MLflow down: at worst some iterations get a second point
        why = redact_text(str(exc))
        logger.warning("could not read run %s's history (%s): recomputed iterations may be logged twice", run_id, why)
        return 0
    return max((point.step for point in history), default=0)


def warn_undelivered(sink: MlflowSink) -> None:
    """The warning at the end of a run MLflow did not get all of: iterations kept for ``replay``, lost, why."""
    logger.warning("%s", sink.undelivered_summary())
