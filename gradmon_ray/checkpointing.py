"""Resumable checkpoints of a ``gradmon-ray train`` run (``checkpoint_every``), read back by ``resume``.

Every ``checkpoint_every`` iterations the algorithm is saved into ``<checkpoint_dir>/latest``
(written next to it, then renamed over it, so a crash mid-save leaves the previous one), with
``gradmon_resume.json`` beside it: the MLflow run id, the iterations done, the health-stop
streaks, the learner's gradmon state digest and the run config.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradmon_ray.config import GradmonConfig

logger = logging.getLogger(__name__)

RESUME_FILE = "gradmon_resume.json"
LATEST = "latest"
DEFAULT_CHECKPOINT_DIR = "gradmon-checkpoints"
RUN_ID_WAIT_S = 30.0
"""How long the first checkpoint (or Tune report) waits for MLflow to create the run, which the
sink does on its own thread; later ones never wait."""


def checkpoint_root(cfg: GradmonConfig) -> Path:
    """Where ``cfg``'s resumable checkpoints go (absolute)."""
    return Path(os.path.abspath(cfg.checkpoint_dir or DEFAULT_CHECKPOINT_DIR))


def learner_state_digest(algo: Any) -> str:
    """SHA-256 of the first (rank-0) learner's gradmon state (``GradmonPPOTorchLearner.gradmon_state_digest``)."""
    results = algo.learner_group.foreach_learner(lambda learner: learner.gradmon_state_digest())
    return next(iter(results)).get()  # a list (local learner) or RemoteCallResults; .get() re-raises


def resume_state(algo: Any, iteration: int, run_id: str | None, monitor: Any) -> dict[str, Any]:
    """What a resume needs besides the algorithm checkpoint (``train --resume`` and Tune trial restarts)."""
    return {
        "iterations_done": iteration,
        "run_id": run_id,
        "health": monitor.state_dict() if monitor is not None else {},
        "state_digest": learner_state_digest(algo),
    }


class CheckpointReporter:
    """A ``run_training`` reporter that saves a resumable checkpoint every ``cfg.checkpoint_every``
    iterations (and when a health rule stops the run).

    ``--resume`` accepts a checkpoint only if it names the run, and the sink creates the run on
    its own thread: the first checkpoint waits (at most ``RUN_ID_WAIT_S``) for the run id.  A
    checkpoint written while MLflow still had no run is given the id by ``stamp_run_id`` when
    the run ends (Ctrl-C and failures included).
    """

    def __init__(
        self, cfg: GradmonConfig, run_id: Callable[[float], str | None], root: str | Path | None = None
    ) -> None:
        """``run_id(timeout_s)``: the MLflow run's id (``MlflowSink.run_id_waiting_once``);
        ``root``: where ``latest`` goes (default ``checkpoint_root(cfg)``)."""
        self._cfg = cfg
        self._root = Path(root) if root is not None else checkpoint_root(cfg)
        self._run_id = run_id
        self._unstamped = False  # the latest checkpoint was written without a run id

    def __call__(self, iteration: int, metrics: dict[str, float], algo: Any, monitor: Any, stop: str | None) -> None:
        if iteration % self._cfg.checkpoint_every != 0 and stop is None:
            return
        root = self._root
        staging = root / f".{LATEST}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        algo.save_to_path(str(staging / "algo"))
        run_id = self._run_id(RUN_ID_WAIT_S)
        if run_id is None and not self._unstamped:
            logger.warning(
                "checkpoint at iteration %d written before MLflow created the run: "
                "it gets the run id when the run ends (until then `train --resume` cannot use it)",
                iteration,
            )
        self._unstamped = run_id is None
        state = {**resume_state(algo, iteration, run_id, monitor), "config": self._cfg.model_dump(mode="json")}
        (staging / RESUME_FILE).write_text(json.dumps(state))
        old = root / f".{LATEST}.old"
        shutil.rmtree(old, ignore_errors=True)
        if (root / LATEST).exists():
            (root / LATEST).rename(old)
        staging.rename(root / LATEST)  # a crash mid-save leaves the previous checkpoint intact
        shutil.rmtree(old, ignore_errors=True)

    def stamp_run_id(self, run_id: str | None) -> None:
        """Write ``run_id`` into the latest checkpoint if it was saved before the run existed."""
        if not self._unstamped or run_id is None:
            return
        state_file = self._root / LATEST / RESUME_FILE
        staged = state_file.with_name(f".{RESUME_FILE}.partial")
        try:
            state = json.loads(state_file.read_text())
            staged.write_text(json.dumps({**state, "run_id": run_id}))
            staged.replace(state_file)  # atomic: the file is either the old or the stamped one
        except OSError as exc:  # called on the way out of a run: never mask how the run ended
            logger.warning(
                "could not write run id %s into %s (%s): `train --resume` cannot use it", run_id, state_file, exc
            )
            return
        self._unstamped = False
