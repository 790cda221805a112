"""A CI-sized ``gradmon-ray train`` config for the resumable-checkpoint tests (``checkpoint_every``)."""

from __future__ import annotations

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
