"""A CI-sized ``gradmon-ray train`` config for the resumable-checkpoint tests (``checkpoint_every``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gradmon_ray.config import GradmonConfig, config_from_dict


def resumable_config(tmp_path: Path, **top: Any) -> GradmonConfig:
    """Tiny PPO without EnvRunners, checkpoints in ``tmp_path/ckpt``, MLflow in ``tmp_path/mlflow.db``
    (experiment ``resume``); ``top`` sets or replaces top-level fields."""
    return config_from_dict(
        {
            "seed": 0,
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "ppo": {"train_batch_size": 256, "minibatch_size": 128, "num_epochs": 1},
            "model": {"trunk_hiddens": [32]},
            "resources": {"num_env_runners": 0},
            "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "resume", "plots_every": 0},
            **top,
        }
    )


def newest_checkpoint(root: Path, run_id: str | None = None) -> Path:
    """The newest complete checkpoint version under ``root`` (in ``run_id``'s directory if given,
    else in any run's directory, the ``unnamed-*`` ones included)."""
    from gradmon_ray.app.train.checkpoints import versions

    run_dirs = [root / run_id] if run_id else [p for p in root.iterdir() if p.is_dir()]
    found = [vs for run_dir in run_dirs for vs in versions(run_dir)]
    assert found, f"no complete checkpoint under {root}"
    return max(found, key=lambda vs: int(vs[1]["saved_ns"]))[0]


def newest_state(root: Path, run_id: str | None = None) -> dict[str, Any]:
    """The resume file of ``newest_checkpoint(root, run_id)``."""
    from gradmon_ray.app.train.checkpoints import RESUME_FILE

    return json.loads((newest_checkpoint(root, run_id) / RESUME_FILE).read_text())
