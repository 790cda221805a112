"""``gradmon-ray train --resume RUN_ID``: continue an interrupted run in the same MLflow run.

With ``checkpoint_every: N``, ``train`` saves resumable checkpoints (``checkpointing``) and
tags the run with ``gradmon.checkpoint_dir``.  ``--resume RUN_ID`` reads that tag from MLflow, restores the
checkpoint (the digest is checked, as for Tune trial restarts), reopens the same MLflow run
and trains the remaining iterations; iterations the interrupted attempt had already logged
after its last checkpoint are trained again but not logged twice.
"""

from __future__ import annotations

import json
from pathlib import Path

from gradmon_ray import metric_names as mn
from gradmon_ray.checkpointing import LATEST, RESUME_FILE
from gradmon_ray.config import ConfigError, GradmonConfig, config_from_dict
from gradmon_ray.train import ResumePoint, last_logged_iteration


def resume_point(tracking_uri: str, run_id: str) -> tuple[GradmonConfig, ResumePoint]:
    """The config and checkpoint ``run_id`` can continue from (``ConfigError`` when it cannot)."""
    from mlflow.tracking import MlflowClient

    try:
        run = MlflowClient(tracking_uri).get_run(run_id)
    except Exception as exc:
        raise ConfigError(
            "--resume", f"no run {run_id!r} at {tracking_uri}: {str(exc).splitlines()[0][:200]}"
        ) from None
    directory = run.data.tags.get(mn.TAG_CHECKPOINT_DIR)
    if not directory:
        raise ConfigError("--resume", f"run {run_id} has no resumable checkpoint (train with checkpoint_every > 0)")
    latest = Path(directory) / LATEST
    state_file = latest / RESUME_FILE
    if not state_file.is_file():
        raise ConfigError("--resume", f"run {run_id}'s checkpoint {latest} is missing or incomplete")
    state = json.loads(state_file.read_text())
    if state.get("run_id") != run_id:
        raise ConfigError("--resume", f"the checkpoint in {latest} belongs to run {state.get('run_id')}, not {run_id}")
    cfg = config_from_dict(state["config"])
    if cfg.checkpoint_dir:  # may be relative to the interrupted run's working directory: the tag is absolute
        cfg.checkpoint_dir = directory
    point = ResumePoint(
        str(latest / "algo"),
        int(state["iterations_done"]),
        state.get("health", {}),
        state_digest=state.get("state_digest"),
        logged_through=last_logged_iteration(tracking_uri, run_id),
        checkpoint_root=directory,
    )
    return cfg, point
