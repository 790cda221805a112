"""``GradmonMLflowCallback``'s settings, and where its store and spill directory are pinned.

A relative store or spill path means "relative to the DRIVER's working directory" (where the user
runs ``gradmon-ray watch``): ``pinned_settings`` resolves them in the process that runs it, which
the callback arranges to be the driver (``callback``'s pickling hook).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gradmon_ray.config import MlflowSection
from gradmon_ray.config.sections import durable_job_path
from gradmon_ray.tracking.mlflow_sink import PlotFn
from gradmon_ray.tracking.store_uri import absolute_tracking_uri
from gradmon_ray.tracking.uri_credentials import credentials_to_environment

DEFAULT_EXPERIMENT: str = MlflowSection.model_fields["experiment"].default
"""The CLI's default experiment (``gradmon-ray``): what ``gradmon-ray watch`` shows without ``--experiment``."""


@dataclass(frozen=True)
class CallbackSettings:
    """What ``GradmonMLflowCallback.configured(**settings)`` takes."""

    tracking_uri: str | None = None
    """MLflow tracking URI; None: ``mlflow.get_tracking_uri()`` (``sqlite:///mlflow.db`` unless set),
    taken on the driver.  Relative ``sqlite:///`` / file paths are made absolute against the driver's
    working directory (Tune moves a trial's)."""
    experiment: str = DEFAULT_EXPERIMENT
    """Experiment name, created when missing (default: the CLI's, so ``gradmon-ray watch`` finds the run)."""
    run_name: str | None = None
    """Run name; None: the Tune trial's directory name, or MLflow's choice outside Tune."""
    tags: Mapping[str, str] = field(default_factory=dict)
    """Extra run tags."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Extra run params (on top of the algorithm config's scalar settings, see ``log_config``)."""
    log_config: bool = True
    """Log the scalar top-level settings of ``algorithm.config`` (lr, gamma, ...) as run params."""
    module_id: str | None = None
    """The RLModule whose learner results are read (``result["learners"][module_id]``); None: every
    module with gradmon telemetry (several modules: ``module/<id>/<name>`` metrics, as the CLI writes)."""
    plots_every: int = 0
    """Draw the plots every this many iterations and at the end (0: never); needs ``plot_fn``."""
    plot_fn: PlotFn | None = None
    """The plotter, e.g. ``gradmon_ray.viz.report.log_plots`` (tracking never imports viz)."""
    max_pending: int = 1000
    """Iterations buffered while MLflow is unreachable; older ones go to the spill file."""
    spill_dir: str | None = "gradmon-spill"
    """Where iterations MLflow could not take are kept (None: dropped); relative to the driver's cwd."""
    close_timeout_s: float = 30.0
    """How long ``algo.stop()`` waits for MLflow to take what is pending (then it spills)."""

    def __post_init__(self) -> None:
        if self.plots_every < 0:
            raise ValueError(f"plots_every must be >= 0, got {self.plots_every}")
        if self.plots_every > 0 and self.plot_fn is None:
            raise ValueError("plots_every > 0 needs plot_fn=gradmon_ray.viz.report.log_plots (or your own plotter)")
        if self.close_timeout_s < 0 or self.max_pending < 1:
            raise ValueError("close_timeout_s must be >= 0 and max_pending >= 1")


def pinned_settings(settings: CallbackSettings) -> CallbackSettings:
    """``settings`` with the store and spill paths fixed in THIS process: the tracking URI (None:
    ``mlflow.get_tracking_uri()``) and a relative spill directory made absolute against its cwd.

    The URI's ``user:password@`` moves into ``MLFLOW_TRACKING_USERNAME/PASSWORD`` here
    (``uri_credentials``): the settings are pickled into Tune's and RLlib's files, the environment
    is not, and the trial actors Ray starts afterwards inherit it."""
    uri = settings.tracking_uri
    if uri is None:
        import mlflow  # only to read the default (env var or sqlite:///mlflow.db); starts nothing

        uri = mlflow.get_tracking_uri()
    # In a ray job submit job, a relative spill_dir is under the driver node's home (Ray deletes the job's directory).
    spill = os.path.abspath(os.path.expanduser(durable_job_path(settings.spill_dir))) if settings.spill_dir else None
    uri = credentials_to_environment(absolute_tracking_uri(uri))
    return dataclasses.replace(settings, tracking_uri=uri, spill_dir=spill)
