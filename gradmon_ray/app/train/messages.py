"""What ``gradmon-ray train`` prints besides the iteration lines: the MLflow run as soon as it exists,
and after Ctrl-C the run id and the command that resumes it, as it can be run."""

from __future__ import annotations

import shlex
import socket
from pathlib import Path
from typing import Any

from gradmon_ray.app.cli_common import TrackingUri
from gradmon_ray.app.train.mlflow_run import RunStarted
from gradmon_ray.app.train.resume import allowed_root, find_checkpoint
from gradmon_ray.config import ConfigError, default_tracking_uri
from gradmon_ray.config.sections import in_ray_job_package
from gradmon_ray.tracking.redact import MASK, uri_secrets

PREFIX = "gradmon-ray: "


class ProgressPrinter:
    """``run_training``'s ``progress`` for the CLI: prints each line, and the run once it exists
    (``tracking``: the command's tracking URI, the run's)."""

    def __init__(self, tracking: TrackingUri) -> None:
        self.tracking = tracking

    def __call__(self, line: str) -> None:
        print(line, flush=True)

    def run_started(self, run: RunStarted) -> None:
        print(started_line(run, self.tracking.shown), flush=True)


def started_line(run: RunStarted, shown: str) -> str:
    """``gradmon-ray: MLflow run <id> (<name>) in experiment '<exp>' at <store>`` (``shown``: the run's
    tracking URI, credentials masked)."""
    if run.run_id is None:
        return f"{PREFIX}MLflow at {shown} has not created the run yet; its iterations wait (spilled) until it does"
    name = f" ({run.run_name})" if run.run_name else ""
    return f"{PREFIX}MLflow run {run.run_id}{name} in experiment '{run.experiment}' at {shown}"


def job_spill_line(spill_dir: str, cwd: Path | None = None) -> str | None:
    """Under ``ray job submit --working-dir`` (``cwd``, default the working directory, is Ray's copy
    of it, deleted after the job): where the run keeps what MLflow cannot take, and on which node
    (a cluster's job driver runs on one of its nodes, not on your machine).  None: not such a job."""
    if not in_ray_job_package(Path.cwd() if cwd is None else cwd):
        return None
    place = Path(spill_dir).expanduser().absolute()
    node = socket.gethostname()
    return f"{PREFIX}iterations MLflow cannot take are kept in {place} on node {node} (Ray deletes the job's directory)"


def done_lines(outcome: Any, experiment: str, shown: str) -> list[str]:
    """What ``train`` prints once a run has ended (``outcome``: a ``TrainingOutcome``; ``shown``: the
    store, credentials masked): the run, its end-of-run checkpoint (where the next ``restore_from``
    finds it) and how to view it; a run MLflow never took is named by its spill file instead."""
    checkpoint = f"; checkpoint {outcome.checkpoint_path}" if outcome.checkpoint_path else ""
    if outcome.run_id is None:  # MLflow never answered (mlflow.offline_ok): everything is in the spill file
        where = f"; replay it with: gradmon-ray replay {outcome.spill_path}" if outcome.spill_path else ""
        return [f"{PREFIX}done, but MLflow at {shown} never took the run{where}{checkpoint}"]
    incomplete = "" if outcome.mlflow_complete else " (MLflow did not receive everything; see warnings)"
    hint = (
        f"open {shown} in a browser"
        if shown.startswith(("http://", "https://"))
        else f"mlflow ui --backend-store-uri {shown}"
    )
    return [
        f"{PREFIX}done. MLflow run {outcome.run_id} in experiment '{experiment}'{incomplete}{checkpoint}",
        f"{PREFIX}view it with: {hint}",
    ]


def resume_argv(run_id: str, tracking: TrackingUri, checkpoint_root: str | Path) -> list[str]:
    """``gradmon-ray train --resume RUN_ID``, plus ``--mlflow-uri`` when the store is not the one a bare
    ``train`` uses here (``default_tracking_uri``; its password masked) and ``--checkpoint-dir`` when
    the checkpoints are not under the root ``--resume`` allows by default (``resume.allowed_root``)."""
    argv = ["gradmon-ray", "train", "--resume", run_id]
    if tracking.uri != default_tracking_uri():
        argv += ["--mlflow-uri", tracking.shown]
    if Path(checkpoint_root).resolve() != allowed_root():
        argv += ["--checkpoint-dir", str(Path(checkpoint_root).absolute())]
    return argv


def interrupted_lines(outcome: Any, tracking: TrackingUri, iterations: int) -> list[str]:
    """What to print after Ctrl-C ended a run (``outcome``: a ``TrainingOutcome``): the run id and
    how it ended, and either the command that resumes it or why it cannot be resumed.  The command
    is given only when ``--resume`` will find a complete checkpoint of the run (looked up on disk
    the way ``--resume`` does); with it, where the iterations an outage kept are, which the resume
    delivers first (``resume.deliver_spill``)."""
    run_id, done = outcome.run_id, outcome.iterations_done
    if run_id is None:
        spill = f"; its iterations are in {outcome.spill_path} (gradmon-ray replay)" if outcome.spill_path else ""
        return [
            f"{PREFIX}interrupted after iteration {done}; MLflow never created the run, it cannot be resumed{spill}"
        ]
    head = f"{PREFIX}interrupted: MLflow run {run_id} ended KILLED after iteration {done} of {iterations}"
    if outcome.checkpoint_root is None:
        return [f"{head}; checkpoints are off (checkpoint_every: 0), so it cannot be resumed"]
    try:
        _, state = find_checkpoint(Path(outcome.checkpoint_root), run_id)
    except ConfigError:
        return [f"{head}; no checkpoint of it was saved yet, so it cannot be resumed: start it again"]
    argv = resume_argv(run_id, tracking, outcome.checkpoint_root)
    lines = [
        f"{head}, checkpointed at iteration {state['iterations_done']}",
        f"{PREFIX}resume it (from this directory) with: {shlex.join(argv)}",
    ]
    if outcome.spill_path:  # what the outage kept: resume replays it into the run before anything else
        lines.append(
            f"{PREFIX}iterations MLflow did not take are kept in {outcome.spill_path}: the resume delivers "
            f"them first (or now: gradmon-ray replay {shlex.quote(outcome.spill_path)}); leave the file there till then"
        )
    if uri_secrets(tracking.uri) and "--mlflow-uri" in argv:
        lines.append(
            f"{PREFIX}the tracking URI's credentials are masked as {MASK} there: put them back in its place, "
            "or set MLFLOW_TRACKING_URI to the URI and leave out --mlflow-uri"
        )
    return lines
