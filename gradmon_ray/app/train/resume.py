"""``gradmon-ray train --resume RUN_ID``: continue an interrupted run in the same MLflow run.

With ``checkpoint_every: N``, ``train`` saves resumable checkpoints into
``<checkpoint_dir>/<run id>/`` (``checkpoints``) and tags the run with the checkpoint root
(``gradmon.checkpoint_dir``).  ``--resume RUN_ID`` finds the run's newest complete checkpoint,
restores it (the learner-state digest is checked, as for Tune trial restarts), reopens the same
MLflow run and trains the remaining iterations; iterations the interrupted attempt had already
logged after its last checkpoint are trained again but not logged twice.  ``RUN_ID`` may also
be the run's name, when only one run has it (``resume_run_id``).

**The outage first.** Iterations the interrupted attempt spilled (its MLflow server was down) are
delivered into the run before anything else (``deliver_spill``: ``spill_replay.replay_spill``, which
renames each file ``.replayed``), and only then is "logged through" read from MLflow: a recomputed
iteration is never logged beside its spilled value, and a later ``gradmon-ray replay`` of the file
finds nothing to do.  A spill file that cannot be delivered refuses the resume, naming the replay
command.  The files are found in the run's ``mlflow.spill_dir`` (relative: here, and where the run
was started when its checkpoint root says so), by the run id in their records.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli_common import TrackingUri
from gradmon_ray.app.train.checkpoints import DEFAULT_CHECKPOINT_DIR, versions
from gradmon_ray.app.train.mlflow_run import last_logged_iteration
from gradmon_ray.config import ConfigError, GradmonConfig, config_from_dict
from gradmon_ray.config.sections import durable_job_path

CHECKPOINT_ROOT_ENV = "GRADMON_CHECKPOINT_DIR"
"""Environment variable naming the checkpoint root ``--resume`` may load from."""


@dataclass
class ResumePoint:
    """Where a resumed run starts: an RLlib checkpoint and the iterations already done."""

    checkpoint_path: str
    iterations_done: int
    health_state: dict[str, int] = field(default_factory=dict)
    state_digest: str | None = None
    """``learner_state_digest`` when the checkpoint was written: the restore is checked against it."""
    logged_through: int = 0
    """Last iteration the failed attempt logged to MLflow: iterations up to it are not logged again."""
    checkpoint_root: str | None = None
    """Where the interrupted run kept its resumable checkpoint (``train --resume``): the resumed run
    renews it there, wherever it is started from. None: ``checkpoint_root(cfg)``."""


def allowed_root(checkpoint_dir: str | Path | None = None) -> Path:
    """The directory ``--resume`` may load checkpoints from, resolved (symlinks and ``..``)."""
    chosen = checkpoint_dir or os.environ.get(CHECKPOINT_ROOT_ENV) or DEFAULT_CHECKPOINT_DIR
    return Path(durable_job_path(str(chosen))).expanduser().resolve()  # a job's: under the node's home


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


def resume_run_id(tracking: TrackingUri, ref: str) -> str:
    """The id of the run ``ref`` names: its id, or a name only one run has (``ConfigError`` otherwise)."""
    from mlflow.tracking import MlflowClient

    from gradmon_ray.tracking.store_uri import absolute_tracking_uri
    from gradmon_ray.viz.runs import RunLookupError, resolve_run

    try:
        return resolve_run(MlflowClient(absolute_tracking_uri(tracking.uri)), run_id=ref).info.run_id
    except RunLookupError as exc:
        if exc.ambiguous:
            raise ConfigError("--resume", str(exc)) from None
        why = "no run has that id or name" if not exc.unreachable else str(exc).split(": ", 1)[-1]
        raise ConfigError("--resume", f"no run {ref!r} at {tracking.shown}: {why}") from None


def spill_directories(spill_dir: str, checkpoint_dir: str | None, root: Path) -> list[Path]:
    """Where a run's spill files can be: ``spill_dir`` (the run's ``mlflow.spill_dir``); relative, both
    here and in the directory the run was started in, which a relative ``checkpoint_dir`` (the run's
    own setting, None: the default) tells from its checkpoint ``root``."""
    spill = Path(spill_dir).expanduser()
    if spill.is_absolute():
        return [spill]
    places = [spill.absolute()]
    relative = Path(checkpoint_dir or DEFAULT_CHECKPOINT_DIR)
    if not relative.is_absolute() and ".." not in relative.parts:
        started_in = root.absolute()
        for _ in relative.parts:
            started_in = started_in.parent
        places += [started_in / spill] if started_in / spill not in places else []
    return places


def run_spill_files(run_id: str, directories: list[Path]) -> list[Path]:
    """The spill files (not yet replayed) in ``directories`` whose records name ``run_id``, oldest first."""
    from gradmon_ray.tracking.spill import SpillFormatError, spill_records

    found: dict[Path, float] = {}
    for path in sorted(p for d in directories if d.is_dir() for p in d.glob("*.jsonl")):
        try:
            if run_id not in path.read_text(encoding="utf-8", errors="replace"):
                continue  # another run's file: cheap to tell before parsing it
            records = spill_records(path)
        except (OSError, SpillFormatError) as exc:
            raise ConfigError("--resume", f"cannot read {path}, which names run {run_id}: {exc}") from None
        named = {r.get(k) for r in records for k in ("run_id", "replayed_into")}
        if run_id in named:
            stamps = [int(r["timestamp_ms"]) for r in records if "timestamp_ms" in r]
            found[path.resolve()] = min(stamps) if stamps else path.stat().st_mtime * 1000
    return sorted(found, key=lambda p: found[p])  # the newest file's tags and status are the run's last


def deliver_spill(tracking: TrackingUri, run_id: str, files: list[Path], then: str = ", then resume") -> None:
    """Replay ``files`` into ``run_id`` at ``tracking``, each exactly once (``replay_spill``);
    ``ConfigError`` naming the file and the replay command (``then``: what to do after it) when one
    cannot be delivered."""
    from gradmon_ray.tracking.redact import short, uri_secrets
    from gradmon_ray.tracking.spill_replay import replay_spill

    for path in files:
        try:
            result = replay_spill(path, tracking.uri)
        except Exception as exc:
            why = short(str(exc), 80, uri_secrets(tracking.uri), one_line=True) or type(exc).__name__
            raise ConfigError(
                "--resume",
                f"could not deliver run {run_id}'s outage spill first ({why}); deliver it with: "
                f"gradmon-ray replay {path} --tracking-uri {tracking.shown}{then}",
            ) from None
        print(
            f"gradmon-ray: delivered {result.iterations} iterations of run {run_id} that {path} kept during an outage",
            flush=True,
        )


def _checkpoint_of(run_id: str, tag: str | None, checkpoint_dir: str | Path | None) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``run_id`` resumes from, under the allowed root (module docstring)."""
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
    return version, state


def resume_point(
    tracking_uri: str | TrackingUri,
    run_id: str,
    checkpoint_dir: str | Path | None = None,
    iterations: int | None = None,
) -> tuple[GradmonConfig, ResumePoint]:
    """The config and checkpoint ``run_id`` can continue from (``ConfigError`` when it cannot).

    ``checkpoint_dir``: the checkpoint root (or the run's directory in it) to load from; default
    ``$GRADMON_CHECKPOINT_DIR``, else where the run's tag points if that is inside
    ``./gradmon-checkpoints``.  The run's spill files are delivered first (``deliver_spill``).  A run
    that has all its iterations (``iterations``: the ``--iterations`` given, else its own) is refused.
    ``tracking_uri``: the command's ``TrackingUri`` (its masked form made where it entered), or a URI.
    """
    from mlflow.tracking import MlflowClient

    from gradmon_ray.tracking.redact import short, uri_secrets
    from gradmon_ray.tracking.store_uri import absolute_tracking_uri

    tracking = TrackingUri.of(tracking_uri)
    client = MlflowClient(absolute_tracking_uri(tracking.uri))
    try:
        run = client.get_run(run_id)
    except Exception as exc:
        why = short(str(exc), 200, uri_secrets(tracking.uri), one_line=True) or type(exc).__name__
        raise ConfigError("--resume", f"no run {run_id!r} at {tracking.shown}: {why}") from None
    version, state = _checkpoint_of(run_id, run.data.tags.get(mn.TAG_CHECKPOINT_DIR), checkpoint_dir)
    cfg = config_from_dict(state["config"])
    # <root>/<run id>/ckpt-*, or <root>/latest from before per-run directories
    run_root = (version.parent.parent if version.parent.name == run_id else version.parent).absolute()
    spill_dirs = spill_directories(cfg.mlflow.spill_dir, cfg.checkpoint_dir, run_root)
    deliver_spill(tracking, run_id, run_spill_files(run_id, spill_dirs))  # before "logged through" is read
    if cfg.checkpoint_dir:  # may be relative to the interrupted run's working directory
        cfg.checkpoint_dir = str(run_root)
    point = ResumePoint(
        str(version / "algo"),
        int(state["iterations_done"]),
        state.get("health", {}),
        state_digest=state["state_digest"],
        logged_through=last_logged_iteration(tracking.uri, run_id),
        checkpoint_root=str(run_root),
    )
    _refuse_complete(run_id, client.get_run(run_id).info.status, point, cfg.iterations, iterations)
    return cfg, point


def _refuse_complete(run_id: str, status: str, point: ResumePoint, own: int, iterations: int | None) -> None:
    """``ConfigError`` when the run has every iteration asked for (``iterations``, else its ``own``):
    all trained (the checkpoint says so), or FINISHED with all of them in MLflow."""
    target = own if iterations is None else iterations
    if (iterations is None and point.iterations_done >= target) or (
        status == "FINISHED" and point.logged_through >= target
    ):
        raise ConfigError(
            "--resume",
            f"run {run_id} is complete: it has all {target} iterations ({status}); to train it further, "
            f"give --iterations N with N > {max(target, point.logged_through)}",
        )
