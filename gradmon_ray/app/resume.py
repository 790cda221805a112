"""``gradmon-ray train --resume RUN_ID``: continue an interrupted run in the same MLflow run.

With ``checkpoint_every: N``, ``train`` saves resumable checkpoints into
``<checkpoint_dir>/<run id>/`` (``checkpointing``) and tags the run with the checkpoint root
(``gradmon.checkpoint_dir``).  ``--resume RUN_ID`` finds the run's newest complete checkpoint,
restores it (the learner-state digest is checked, as for Tune trial restarts), reopens the same
MLflow run and trains the remaining iterations; iterations the interrupted attempt had already
logged after its last checkpoint are trained again but not logged twice.

**Only under the checkpoint root.** A checkpoint is a pickle, and anyone who can write a tag on
the tracking server can point ``gradmon.checkpoint_dir`` anywhere: the tag alone never decides
what is loaded.  The allowed root is ``checkpoint_dir`` (given by the caller: ``--checkpoint-dir``), else
``$GRADMON_CHECKPOINT_DIR``, else ``./gradmon-checkpoints``.  The run's checkpoints are looked
for in the directory given (the root, or the run's own directory in it), then where the run's
tag points if that is inside the allowed root.  Every path is compared after resolving symlinks and
``..``, the checkpoint finally loaded (a run directory may be a symlink) included.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray.app.checkpointing import DEFAULT_CHECKPOINT_DIR, versions
from gradmon_ray.app.train import ResumePoint, last_logged_iteration
from gradmon_ray.config import ConfigError, GradmonConfig, config_from_dict

CHECKPOINT_ROOT_ENV = "GRADMON_CHECKPOINT_DIR"
"""Environment variable naming the checkpoint root ``--resume`` may load from."""


def allowed_root(checkpoint_dir: str | Path | None = None) -> Path:
    """The directory ``--resume`` may load checkpoints from, resolved (symlinks and ``..``)."""
    chosen = checkpoint_dir or os.environ.get(CHECKPOINT_ROOT_ENV) or DEFAULT_CHECKPOINT_DIR
    return Path(chosen).expanduser().resolve()


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root)


def find_checkpoint(where: Path, run_id: str) -> tuple[Path, dict[str, Any]]:
    """``run_id``'s newest complete checkpoint version in ``where`` (the root or the run's own
    directory) and its resume state; ``ConfigError`` naming what is there otherwise."""
    others = []
    for run_dir in (where / run_id, where):
        found = versions(run_dir)
        mine = [(v, s) for v, s in found if s.get("run_id") == run_id]
        if mine:
            return mine[-1]
        others += found
    if others:  # e.g. a directory copied in by hand, or another run's checkpoint in the old shared layout
        version, state = others[-1]
        raise ConfigError("--resume", f"the checkpoint in {version} belongs to run {state.get('run_id')}, not {run_id}")
    raise ConfigError("--resume", f"no complete checkpoint of run {run_id} in {where}")


def resume_point(
    tracking_uri: str, run_id: str, checkpoint_dir: str | Path | None = None
) -> tuple[GradmonConfig, ResumePoint]:
    """The config and checkpoint ``run_id`` can continue from (``ConfigError`` when it cannot).

    ``checkpoint_dir``: the checkpoint root (or the run's directory in it) to load from; default
    ``$GRADMON_CHECKPOINT_DIR``, else where the run's tag points if that is inside
    ``./gradmon-checkpoints``.
    """
    from mlflow.tracking import MlflowClient

    from gradmon_ray.tracking.redact import redact_uri
    from gradmon_ray.tracking.store_uri import absolute_tracking_uri

    try:
        run = MlflowClient(absolute_tracking_uri(tracking_uri)).get_run(run_id)
    except Exception as exc:
        raise ConfigError(
            "--resume", f"no run {run_id!r} at {redact_uri(tracking_uri)}: {str(exc).splitlines()[0][:200]}"
        ) from None
    tag = run.data.tags.get(mn.TAG_CHECKPOINT_DIR)
    if not tag:
        raise ConfigError("--resume", f"run {run_id} has no resumable checkpoint (train with checkpoint_every > 0)")
    given = checkpoint_dir or os.environ.get(CHECKPOINT_ROOT_ENV)
    root = allowed_root(given)
    tagged = Path(tag).resolve()  # searched as resolved, so `x/..` works whether or not x exists
    places = [Path(given).expanduser().resolve()] if given else []  # the root, or the run's directory
    places += [tagged] if _inside(tagged, root) and tagged not in places else []
    outside = ConfigError(
        "--resume",
        f"run {run_id}'s checkpoints are in {tag}, outside the allowed checkpoint root {root}; "
        f"give --checkpoint-dir {tag} (or set {CHECKPOINT_ROOT_ENV}={tag}) to load from there",
    )
    found, missing = None, None
    for where in places:
        try:
            found = find_checkpoint(where, run_id)
            break
        except ConfigError as exc:
            missing = missing or exc
    if found is None:
        raise missing if _inside(tagged, root) and missing is not None else outside
    version, state = found
    if not _inside(version, root):  # e.g. a `latest` or run directory symlinked out of the root
        raise ConfigError("--resume", f"checkpoint {version} resolves to {version.resolve()}, outside {root}")
    if not state.get("state_digest"):
        raise ConfigError("--resume", f"checkpoint {version} records no learner state digest; it cannot be checked")
    cfg = config_from_dict(state["config"])
    # <root>/<run id>/ckpt-*, or <root>/latest from before per-run directories
    run_root = (version.parent.parent if version.parent.name == run_id else version.parent).absolute()
    if cfg.checkpoint_dir:  # may be relative to the interrupted run's working directory
        cfg.checkpoint_dir = str(run_root)
    point = ResumePoint(
        str(version / "algo"),
        int(state["iterations_done"]),
        state.get("health", {}),
        state_digest=state["state_digest"],
        logged_through=last_logged_iteration(tracking_uri, run_id),
        checkpoint_root=str(run_root),
    )
    return cfg, point
