"""Which MLflow store ``GradmonMLflowCallback`` creates, and when (issue #47 item 4).

Only the store the user configured (or MLflow's default, for the plain class), and only when a run
is made: never by ``configured``, never when RLlib or Tune pickles the config on the driver (which
also ships ``GradmonMLflowCallback`` itself, as the base class of a configured one), so a build
that fails before a run leaves nothing (trials that then open one new sqlite store together:
``test_store_lock.py``).  The oracle for "created nothing" is the directory tree itself; for
"created the run", a fresh ``MlflowClient`` on the path built by hand.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import cloudpickle
import pytest
from mlflow.tracking import MlflowClient
from ray import cloudpickle as ray_cloudpickle
from ray.rllib.algorithms.ppo import PPOConfig

from gradmon_ray.tracking import GradmonMLflowCallback
from tests.e2e.processes import free_port
from tests.tracking.test_callback import _StubAlgorithm


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("pickler", [cloudpickle, ray_cloudpickle], ids=lambda m: m.__name__)
@pytest.mark.parametrize("store", ["http", "sqlite", "default"])
def test_configuring_and_shipping_the_callback_creates_no_store(store, pickler, tmp_path, monkeypatch):
    """What ``build_algo()`` does before any run (RLlib ``ray.put``s the config for its EnvRunners,
    ``Tuner`` pickles it): a store appeared here, an empty ``mlflow.db`` even for an http server."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if store == "default":
        callback: type[GradmonMLflowCallback] = GradmonMLflowCallback
    else:
        uri = f"http://127.0.0.1:{free_port()}" if store == "http" else "sqlite:///mine.db"
        callback = GradmonMLflowCallback.configured(tracking_uri=uri)
    pickler.dumps(callback)
    pickler.dumps(PPOConfig().environment("CartPole-v1").callbacks(callback))  # what RLlib ships to EnvRunners
    assert _tree(tmp_path) == []


def test_the_store_is_created_with_the_run_where_it_was_pinned(tmp_path, monkeypatch):
    driver, trial = tmp_path / "driver", tmp_path / "trial"
    driver.mkdir()
    trial.mkdir()
    monkeypatch.chdir(driver)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shipped = pickle.loads(ray_cloudpickle.dumps(GradmonMLflowCallback))
    assert _tree(driver) == []
    monkeypatch.chdir(trial)  # the trial's actor opens the run
    callback = shipped()
    callback.on_algorithm_init(algorithm=_StubAlgorithm())
    assert callback.close() is True
    client = MlflowClient(f"sqlite:///{driver / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gradmon-ray").experiment_id])
    assert run.info.run_id == callback.sink.run_id and run.info.status == "FINISHED"
    assert _tree(trial) == []
