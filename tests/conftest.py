"""Shared fixtures: one Ray instance per test session, tiny configs."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
# Tests name their own MLflow stores; a developer's MLFLOW_TRACKING_URI must not leak into them.
os.environ.pop("MLFLOW_TRACKING_URI", None)


def _init_local_ray() -> None:
    import ray

    if not ray.is_initialized():
        # Ray overcommits logical CPUs: 4 on a 2-core CI box runs 1 EnvRunner + learners.
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by every integration test (starting Ray costs ~5 s)."""
    import ray

    _init_local_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def without_shared_ray():
    """For a test module that connects to Ray of its own (a multi-node ``ray.cluster_utils.Cluster``):
    the shared local instance, if running, is shut down for the module and started again after it."""
    import ray

    was_running = ray.is_initialized()
    if was_running:
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()
    if was_running:
        _init_local_ray()


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
