"""Resumable checkpoints of a ``gradmon-ray train`` run (``checkpoint_every``), read back by ``resume``.

Layout: every run has its own directory under the checkpoint root, named by its MLflow run id,
so runs sharing a ``checkpoint_dir`` never touch each other's checkpoints::

    <checkpoint_dir>/<run id>/ckpt-00000012-<nonce>/algo/                the algorithm (RLlib)
    <checkpoint_dir>/<run id>/ckpt-00000012-<nonce>/gradmon_resume.json  run id, iterations, digests
    <checkpoint_dir>/<run id>/latest -> ckpt-00000012-<nonce>            symlink to the newest

A save writes a new version under a hidden ``.partial-*`` name (algorithm, then the resume
file, every file fsynced), publishes it with one ``rename``, switches ``latest`` with one
``os.replace`` of a fresh symlink, then deletes the older versions (each renamed away before it
is removed).  A crash at any step leaves the previous version or the new one complete and
findable: ``find_checkpoint`` takes the newest *complete* version (its resume file parses and
every file the manifest lists has its recorded size), whatever ``latest`` says.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradmon_ray.config import GradmonConfig
from gradmon_ray.config.sections import durable_job_path
from gradmon_ray.tracking.redact import redact_uri

logger = logging.getLogger(__name__)

RESUME_FILE = "gradmon_resume.json"
LATEST = "latest"
VERSION_PREFIX = "ckpt-"
DEFAULT_CHECKPOINT_DIR = "gradmon-checkpoints"
RUN_ID_WAIT_S = 30.0
"""How long the first checkpoint (or Tune report) waits for MLflow to create the run, which the
sink does on its own thread; later ones never wait."""


class CheckpointStateMismatchError(RuntimeError):
    """The learner's restored gradmon state differs from the one written with the checkpoint."""


def checkpoint_root(cfg: GradmonConfig) -> Path:
    """Where ``cfg``'s resumable checkpoints go (absolute; in a ``ray job submit`` job, a relative one
    under the node's home: Ray deletes the job's working directory, ``config.sections.durable_job_path``)."""
    return Path(os.path.abspath(Path(durable_job_path(cfg.checkpoint_dir or DEFAULT_CHECKPOINT_DIR)).expanduser()))


def learner_state_digest(algo: Any) -> str:
    """SHA-256 of the rank-0 learner's gradmon state (``GradmonPPOTorchLearner.gradmon_state_digest``).

    Asked by rank, not by position: the learners' results need not come back in rank order (after
    a lost node, they did not), and only rank 0 holds the probe's counters, so another rank's
    digest differs and a correct restore would be refused."""
    from gradmon_ray.rllib.monitor import global_rank  # here: importing RLlib costs the CLI seconds

    results = algo.learner_group.foreach_learner(lambda learner: (global_rank(), learner.gradmon_state_digest()))
    return min(result.get() for result in results)[1]  # a list (local learner) or RemoteCallResults; .get() re-raises


def verify_restored_state(expected: str | None, restored: str, checkpoint: str) -> None:
    """Raise ``CheckpointStateMismatchError`` unless the restored learner state's digest is the one
    written with ``checkpoint`` (a checkpoint without a digest cannot be checked: refused too)."""
    if expected is None:
        raise CheckpointStateMismatchError(
            f"{checkpoint} records no learner state digest, so its restore cannot be checked; not continuing from it"
        )
    if restored != expected:
        raise CheckpointStateMismatchError(
            f"the learner's gradmon state after restoring {checkpoint} (sha256 {restored[:12]}) is "
            f"not the one written with it (sha256 {expected[:12]}); not continuing the run from it"
        )


def resume_state(algo: Any, iteration: int, run_id: str | None, monitor: Any) -> dict[str, Any]:
    """What a resume needs besides the algorithm checkpoint (``train --resume`` and Tune trial restarts)."""
    return {
        "iterations_done": iteration,
        "run_id": run_id,
        "health": monitor.state_dict() if monitor is not None else {},
        "state_digest": learner_state_digest(algo),
    }


def redacted_config(cfg: GradmonConfig) -> dict[str, Any]:
    """``cfg`` as JSON data with its tracking URI's credentials masked (what a checkpoint may keep)."""
    data = cfg.model_dump(mode="json")
    mlflow = data.get("mlflow") or {}
    if mlflow.get("tracking_uri"):
        mlflow["tracking_uri"] = redact_uri(str(mlflow["tracking_uri"]))
    return data


# --- writing -------------------------------------------------------------------------------------
def _write_durably(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> None:
    """fsync every file, then every directory, under ``top``: a published version survives power loss."""
    for directory, _, files in os.walk(top, topdown=False):
        for name in [*files, "."]:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _manifest(algo_dir: Path) -> dict[str, int]:
    """Every file under ``algo_dir`` (relative path) and its size."""
    return {
        str(path.relative_to(algo_dir)): path.stat().st_size for path in sorted(algo_dir.rglob("*")) if path.is_file()
    }


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _discard(path: Path) -> None:
    """Rename ``path`` to a hidden name first (so it stops counting as a version at once), then delete it."""
    trash = path.with_name(f".trash-{path.name}-{time.time_ns():x}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    _remove(trash)


def save_checkpoint(run_dir: Path, iteration: int, write_algo: Callable[[Path], Any], state: dict[str, Any]) -> Path:
    """Write one checkpoint version into ``run_dir`` and make it ``latest``; returns the version directory.

    ``write_algo(path)`` saves the algorithm into ``path`` (``Algorithm.save_to_path``); ``state``
    goes into the resume file with the algorithm files' manifest.  Older versions are deleted
    once the new one is published.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    name = f"{VERSION_PREFIX}{iteration:08d}-{time.time_ns():x}"
    staging = run_dir / f".partial-{name}"
    write_algo(staging / "algo")
    record = {**state, "saved_ns": time.time_ns(), "manifest": _manifest(staging / "algo")}
    _write_durably(staging / RESUME_FILE, json.dumps(record).encode())
    _fsync_tree(staging)
    version = run_dir / name
    os.rename(staging, version)  # published: complete, or not there at all
    link = run_dir / f".{LATEST}-{name}"
    os.symlink(name, link)
    os.replace(link, run_dir / LATEST)  # atomic: latest is the old version or the new one
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename and the new link are durable
    finally:
        os.close(fd)
    for entry in sorted(run_dir.iterdir()):  # older versions, and what earlier crashed saves left
        if entry.name.startswith(".trash-"):
            _remove(entry)
        elif entry.name != name and entry.name.startswith((VERSION_PREFIX, ".partial-", f".{LATEST}-")):
            _discard(entry)
    return version


# --- reading -------------------------------------------------------------------------------------
def read_version(version: Path) -> dict[str, Any] | None:
    """A version's resume file if the version is complete (parses, every manifest file has its
    size), else None.  A legacy ``latest/`` directory (no manifest) is complete when it has ``algo/``."""
    try:
        state = json.loads((version / RESUME_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    manifest = state.get("manifest")
    if manifest is None:
        return state if (version / "algo").is_dir() else None
    algo = version / "algo"
    for rel, size in manifest.items():
        try:
            if (algo / rel).stat().st_size != size:
                return None
        except OSError:
            return None
    return state


def versions(run_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The complete versions in ``run_dir``, oldest first (by iterations done, then save time)."""
    found = []
    candidates = [p for p in run_dir.glob(f"{VERSION_PREFIX}*") if p.is_dir()] if run_dir.is_dir() else []
    legacy = run_dir / LATEST
    if legacy.is_dir() and not legacy.is_symlink():  # the layout before per-run directories
        candidates.append(legacy)
    for version in candidates:
        state = read_version(version)
        if state is not None:
            found.append((version, state))
    return sorted(found, key=lambda vs: (int(vs[1].get("iterations_done", 0)), int(vs[1].get("saved_ns", 0))))


def newest_version(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete version in ``run_dir`` (None: none)."""
    found = versions(run_dir)
    return found[-1] if found else None


class CheckpointReporter:
    """A ``run_training`` reporter that saves a resumable checkpoint every ``cfg.checkpoint_every``
    iterations (and when a health rule stops the run) into ``<root>/<run id>``; ``run_training``
    also calls ``save`` after the iteration Ctrl-C interrupted.

    ``--resume`` accepts a checkpoint only if it names the run, and the sink creates the run on
    its own thread: the first checkpoint waits (at most ``RUN_ID_WAIT_S``) for the run id.  A
    checkpoint written while MLflow still had no run goes to ``<root>/unnamed-<time>-<pid>``; the
    next one written with the id replaces it, and ``stamp_run_id`` names it when the run ends
    (Ctrl-C and failures included).
    """

    def __init__(
        self, cfg: GradmonConfig, run_id: Callable[[float], str | None], root: str | Path | None = None
    ) -> None:
        """``run_id(timeout_s)``: the MLflow run's id (``MlflowSink.run_id_waiting_once``);
        ``root``: the checkpoint root (default ``checkpoint_root(cfg)``)."""
        self._cfg = cfg
        self._root = Path(root) if root is not None else checkpoint_root(cfg)
        self._run_id = run_id
        self._unnamed: Path | None = None  # the run directory used while the run id was unknown
        self.last_version: Path | None = None
        self.last_iteration: int | None = None
        """The iteration of the newest checkpoint this reporter saved (None: none yet)."""

    @property
    def root(self) -> Path:
        """The checkpoint root: this run's checkpoints go to ``<root>/<run id>``."""
        return self._root

    def __call__(self, iteration: int, metrics: dict[str, float], algo: Any, monitor: Any, stop: str | None) -> None:
        if iteration % self._cfg.checkpoint_every == 0 or stop is not None:
            self.save(iteration, algo, monitor)

    def save(self, iteration: int, algo: Any, monitor: Any) -> None:
        """Save a checkpoint of ``iteration`` now, whatever the cadence (Ctrl-C asks for one)."""
        run_id = self._run_id(RUN_ID_WAIT_S)
        if run_id is None and self._unnamed is None:
            logger.warning(
                "checkpoint at iteration %d written before MLflow created the run: "
                "it gets the run id when the run ends (until then `train --resume` cannot use it)",
                iteration,
            )
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            self._unnamed = self._root / f"unnamed-{stamp}-{os.getpid()}"
        run_dir = self._root / run_id if run_id is not None else self._unnamed
        state = {**resume_state(algo, iteration, run_id, monitor), "config": redacted_config(self._cfg)}
        self.last_version = save_checkpoint(run_dir, iteration, lambda path: algo.save_to_path(str(path)), state)
        self.last_iteration = iteration
        if run_id is not None and self._unnamed is not None:  # superseded by a checkpoint that names the run
            _discard(self._unnamed)
            self._unnamed = None

    def stamp_run_id(self, run_id: str | None) -> None:
        """Name the run in the latest checkpoint if it was saved before the run existed, and move
        it to ``<root>/<run id>``."""
        if self._unnamed is None or run_id is None:
            return
        try:
            newest = newest_version(self._unnamed)
            if newest is None:
                return
            version, state = newest
            staged = version / f".{RESUME_FILE}.partial"
            _write_durably(staged, json.dumps({**state, "run_id": run_id}).encode())
            os.replace(staged, version / RESUME_FILE)  # atomic: the file is either the old or the stamped one
            target = self._root / run_id
            if target.exists():  # never expected (a fresh run's id): keep both, the newest version wins
                os.rename(version, target / version.name)
            else:
                os.rename(self._unnamed, target)
            self.last_version = target / version.name
        except OSError as exc:  # called on the way out of a run: never mask how the run ended
            logger.warning(
                "could not write run id %s into %s (%s): `train --resume` cannot use it", run_id, self._unnamed, exc
            )
            return
        self._unnamed = None
