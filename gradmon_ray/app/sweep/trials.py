"""One Tune trial of a sweep: ``run_training`` with the sampled overrides, reporting to Tune.

It writes an MLflow run nested under the sweep's parent run (named ``trial_run_name``), reports
every iteration to Tune, and checkpoints the algorithm (learner state, telemetry latches included)
plus its MLflow run id and health streaks, so that Tune's ``FailureConfig`` retries resume the
trial where it stopped and in the same MLflow run.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray.app.sweep.progress import trial_run_name
from gradmon_ray.config import apply_overrides, config_from_dict
from gradmon_ray.tracking.redact import redact_uri

logger = logging.getLogger(__name__)

TRIAL_STATE_FILE = "gradmon_trial.json"
PARENT_RUN_TAG = "mlflow.parentRunId"  # MLflow's own tag: the UI nests runs under their parent


class MetricCarry:
    """Every result a trial reports to Tune carries the sweep's metric, or Tune fails the whole sweep.

    An iteration that trained nothing (its only EnvRunner lost with its node, and being restarted)
    has no episode return and no telemetry; it repeats the metric's last value of this attempt
    (NaN before there is one; a NaN never ranks a trial).  MLflow gets only what was measured.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.last = math.nan

    def fill(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.name in metrics:
            self.last = metrics[self.name]
            return metrics
        return {**metrics, self.name: self.last}


def run_trial(params: dict[str, Any], tracking_uri: str) -> None:
    """One Tune trial: ``run_training`` with the sampled overrides, reporting to Tune.

    ``tracking_uri``: the real URI (credentials and all), which the param space holds masked.
    """
    from ray import tune

    from gradmon_ray.app.ray_noise import discard_rllib_logdir
    from gradmon_ray.app.train.run import run_training

    meta = params["__gradmon__"]
    overrides = {k: v for k, v in params.items() if k != "__gradmon__"}
    cfg = config_from_dict(apply_overrides(copy.deepcopy(meta["base"]), overrides))
    if cfg.mlflow.tracking_uri == redact_uri(tracking_uri):  # the masked copy of the sweep's own URI
        cfg.mlflow.tracking_uri = tracking_uri
    resume, run_id = _resume_point(cfg, tune.get_checkpoint())
    sink = _trial_sink(cfg, meta, overrides, run_id)
    built: list[Any] = []  # the trial's algorithm, once it reported: its empty ~/ray_results/<dir> goes at the end
    metric = MetricCarry(meta.get("metric", mn.EPISODE_RETURN_MEAN))
    report = _tune_reporter(cfg, sink, int(meta["every"]), metric, built)
    try:
        run_training(cfg, progress=None, sink=sink, reporter=report, resume=resume)
    finally:
        for algo in built:  # stopped by run_training on its way out
            discard_rllib_logdir(algo)
        if resume is not None:
            shutil.rmtree(Path(resume.checkpoint_path).parent, ignore_errors=True)


def _resume_point(cfg: Any, checkpoint: Any) -> tuple[Any, str | None]:
    """A retried trial's ``ResumePoint`` and MLflow run id, from Tune's checkpoint copied to a local
    directory (removed when the trial ends); ``(None, None)`` for a first attempt.

    As ``train --resume`` does, what the failed attempt spilled (its MLflow lagged or was down) is
    delivered into the run first (``deliver_first``), and only then is "logged through" read: an
    iteration trained again is never logged beside its spilled value."""
    from gradmon_ray.app.train.mlflow_run import last_logged_iteration
    from gradmon_ray.app.train.resume import ResumePoint

    if checkpoint is None:
        return None, None
    local = tempfile.mkdtemp(prefix="gradmon-resume-")
    with checkpoint.as_directory() as directory:
        shutil.copytree(directory, local, dirs_exist_ok=True)
    state = json.loads((Path(local) / TRIAL_STATE_FILE).read_text())
    run_id = state["run_id"]
    still_spilled = deliver_first(cfg, run_id)
    resume = ResumePoint(
        str(Path(local) / "algo"),
        int(state["iterations_done"]),
        state.get("health", {}),
        state_digest=state.get("state_digest"),
        logged_through=max(last_logged_iteration(cfg.mlflow.tracking_uri, run_id), still_spilled),
    )
    return resume, run_id


def deliver_first(cfg: Any, run_id: str) -> int:
    """Replay the spill files in ``cfg.mlflow.spill_dir`` that hold iterations of ``run_id`` into it
    (``resume.deliver_spill``: each exactly once); 0 once they are in MLflow.  MLflow failing now
    never fails the retry (training goes on as it does through an outage): the files stay for
    ``gradmon-ray replay``, a warning says so, and the last step they hold is returned, so that the
    retry does not log those iterations a second time."""
    from gradmon_ray.app.cli_common import TrackingUri
    from gradmon_ray.app.train.resume import deliver_spill, run_spill_files
    from gradmon_ray.config import ConfigError
    from gradmon_ray.tracking.spill import SpillFormatError, read_spill

    files: list[Path] = []
    try:
        files = run_spill_files(run_id, [Path(cfg.mlflow.spill_dir).expanduser().absolute()])
        deliver_spill(TrackingUri.of(cfg.mlflow.tracking_uri), run_id, files, then="")
        return 0
    except ConfigError as exc:
        logger.warning("gradmon: %s; the retried trial trains on and does not log them again", exc.message)
    steps = [0]
    for path in (f for f in files if f.exists()):  # the ones delivered were renamed .replayed
        try:
            steps += [int(r["step"]) for r in read_spill(path)[1]]
        except (OSError, SpillFormatError):
            continue
    return max(steps)


def _trial_sink(cfg: Any, meta: dict[str, Any], overrides: dict[str, Any], run_id: str | None) -> Any:
    """The trial's MLflow sink: a run nested under the sweep's parent (``run_id``: a retry's own run)."""
    from ray import tune

    from gradmon_ray.app.train.mlflow_run import mlflow_params, plotter
    from gradmon_ray.tracking import MlflowSink
    from gradmon_ray.tracking.spill import default_spill_path

    context = tune.get_context()
    return MlflowSink(
        cfg.mlflow.tracking_uri,
        cfg.mlflow.experiment,
        run_name=trial_run_name(meta["sweep"], context.get_trial_id(), overrides),
        params={**mlflow_params(cfg), **{f"trial.{k}": v for k, v in overrides.items()}},
        tags={PARENT_RUN_TAG: meta["parent_run_id"], mn.TAG_SWEEP: meta["sweep"], mn.TAG_STATUS: "running"},
        max_pending=cfg.mlflow.queue_size,
        plots_every=cfg.mlflow.plots_every,
        plot_fn=plotter(cfg.mlflow.plots_every),
        spill_path=default_spill_path(cfg.mlflow.spill_dir, context.get_trial_name()),
        run_id=run_id,
        end_run=True,
    )


def _tune_reporter(cfg: Any, sink: Any, every: int, metric: MetricCarry, built: list[Any]) -> Any:
    """``run_training``'s reporter: every iteration to Tune, with a checkpoint every ``every`` and at
    the end (``built`` gets the algorithm at its first report)."""
    from ray import tune

    from gradmon_ray.app.train.checkpoints import RUN_ID_WAIT_S, resume_state

    def report(iteration: int, metrics: dict[str, float], algo: Any, monitor: Any, stop_reason: str | None) -> None:
        if not built:
            built.append(algo)
        stopping = stop_reason is not None
        payload: dict[str, Any] = {
            **metric.fill(metrics),
            "gradmon_iteration": iteration,
            "mlflow_run_id": sink.run_id_waiting_once(RUN_ID_WAIT_S),
        }
        if stopping:
            payload["stop_reason_text"] = stop_reason
        if not (iteration % every == 0 or iteration == cfg.iterations or stopping):
            tune.report(payload)
            return
        # tune.report copies the checkpoint into the trial's storage before it returns (Ray's own pattern).
        with tempfile.TemporaryDirectory(prefix="gradmon-ckpt-") as directory:
            algo.save_to_path(os.path.join(directory, "algo"))
            if torn_learner_state(Path(directory) / "algo"):  # a learner lost mid-save: keep Tune's last one
                logger.warning("gradmon: iteration %d's checkpoint lost its learner state; not kept", iteration)
                tune.report(payload)
                return
            state = resume_state(algo, iteration, sink.run_id, monitor)
            (Path(directory) / TRIAL_STATE_FILE).write_text(json.dumps(state))
            tune.report(payload, checkpoint=tune.Checkpoint.from_directory(directory))

    return report


def torn_learner_state(algo_dir: Path) -> bool:
    """Whether an ``Algorithm.save_to_path`` directory holds a learner-group folder without the learner's
    own state file: RLlib writes a learner's subcomponents first and ``state.pkl`` last, so a learner
    lost mid-save (its node preempted) leaves it out, and restoring that checkpoint fails every retry."""
    learner = Path(algo_dir) / "learner_group" / "learner"
    return learner.is_dir() and not any((learner / f"state{suffix}").is_file() for suffix in (".pkl", ".msgpack"))
