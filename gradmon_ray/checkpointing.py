"""Resumable checkpoints of a ``gradmon-ray train`` run (``checkpoint_every``), read back by ``resume``.

Every ``checkpoint_every`` iterations the algorithm is saved into ``<checkpoint_dir>/latest``
(written next to it, then renamed over it, so a crash mid-save leaves the previous one), with
``gradmon_resume.json`` beside it: the MLflow run id, the iterations done, the health-stop
streaks, the learner's gradmon state digest and the run config.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradmon_ray.config import GradmonConfig

RESUME_FILE = "gradmon_resume.json"
LATEST = "latest"
DEFAULT_CHECKPOINT_DIR = "gradmon-checkpoints"


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


def checkpoint_reporter(cfg: GradmonConfig, run_id: Callable[[], str | None]) -> Callable[..., None]:
    """A ``run_training`` reporter that saves a resumable checkpoint every ``cfg.checkpoint_every``
    iterations (and when a health rule stops the run)."""
    root = checkpoint_root(cfg)

    def report(iteration: int, metrics: dict[str, float], algo: Any, monitor: Any, stop_reason: str | None) -> None:
        if iteration % cfg.checkpoint_every != 0 and stop_reason is None:
            return
        staging = root / f".{LATEST}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        algo.save_to_path(str(staging / "algo"))
        state = {**resume_state(algo, iteration, run_id(), monitor), "config": cfg.model_dump(mode="json")}
        (staging / RESUME_FILE).write_text(json.dumps(state))
        old = root / f".{LATEST}.old"
        shutil.rmtree(old, ignore_errors=True)
        if (root / LATEST).exists():
            (root / LATEST).rename(old)
        staging.rename(root / LATEST)  # a crash mid-save leaves the previous checkpoint intact
        shutil.rmtree(old, ignore_errors=True)

    return report
