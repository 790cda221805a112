"""Shared fixtures: one Ray instance per test session, tiny configs."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
# Tests name their own MLflow stores; a developer's MLFLOW_TRACKING_URI must not leak into them.
os.environ.pop("MLFLOW_TRACKING_URI", None)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by every integration test (starting Ray costs ~5 s)."""
    import ray

    if not ray.is_initialized():
        # Ray overcommits logical CPUs: 4 on a 2-core CI box runs 1 EnvRunner + learners.
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def tiny_config_data(tmp_path):
    """A CI-sized run config (as plain data) writing MLflow into a temp sqlite store."""
    return {
        "iterations": 2,
        "seed": 0,
        "ppo": {"train_batch_size": 512, "minibatch_size": 128, "num_epochs": 2},
        "resources": {"num_env_runners": 1},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "test"},
    }
