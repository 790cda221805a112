"""Fixtures for the checkpoint and resume guards: a real learner in this process (no Ray cluster),
checkpoints written on disk by the real ``CheckpointReporter``, a real sqlite MLflow store."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gradmon_ray.config import GradmonConfig, config_from_dict


class _Result:
    def __init__(self, value: Any) -> None:
        self._value = value

    def get(self) -> Any:
        return self._value


class LocalAlgo:
    """What ``checkpointing`` and ``train`` touch of an RLlib ``Algorithm``, over one in-process
    learner: ``save_to_path``, ``restore_from_path`` and ``learner_group.foreach_learner``."""

    def __init__(self, learner: Any) -> None:
        self.learner = learner
        self.learner_group = self

    def foreach_learner(self, fn: Any) -> list[_Result]:
        return [_Result(fn(self.learner))]

    def save_to_path(self, path: str) -> str:
        self.learner.save_to_path(path)
        return path

    def restore_from_path(self, path: str) -> None:
        self.learner.restore_from_path(path)


def tiny_config(tmp_path: Path) -> GradmonConfig:
    """A small PPO config checkpointing every iteration into ``tmp_path/ckpt``."""
    return config_from_dict(
        {
            "seed": 3,
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "checkpoint_every": 1,
            "ppo": {"train_batch_size": 64, "minibatch_size": 32, "num_epochs": 1},
            "model": {"trunk_hiddens": [16]},
            "mlflow": {"tracking_uri": "http://bob:SECRET-77@127.0.0.1:5999", "experiment": "ckpt"},
        }
    )


@dataclass
class Learners:
    """A learner after one update (``a``) and the same learner after a second (``b``), their gradmon
    state digests read off the learners themselves, and a third learner to restore into."""

    cfg: GradmonConfig
    algo: LocalAlgo
    digest_a: str
    digest_b: str
    state_a: dict[str, Any]
    state_b: dict[str, Any]
    fresh: LocalAlgo

    def at(self, which: str) -> LocalAlgo:
        """The learner set to state ``"a"`` or ``"b"``."""
        self.algo.learner.set_state(self.state_a if which == "a" else self.state_b)
        return self.algo

    def restored_digest(self, algo_path: Path) -> str:
        """The gradmon state digest of the fresh learner after restoring ``algo_path``."""
        self.fresh.restore_from_path(str(algo_path))
        return self.fresh.learner.gradmon_state_digest()


@pytest.fixture(scope="session")
def learners(tmp_path_factory: pytest.TempPathFactory) -> Learners:
    from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update

    cfg = tiny_config(tmp_path_factory.mktemp("learners"))
    learner = build_local_learner(cfg)
    episodes = sample_episodes(cfg, learner, 64)
    update(learner, train_batch(learner, episodes), cfg)
    state_a, digest_a = copy.deepcopy(learner.get_state()), learner.gradmon_state_digest()
    update(learner, train_batch(learner, sample_episodes(cfg, learner, 64)), cfg)
    state_b, digest_b = copy.deepcopy(learner.get_state()), learner.gradmon_state_digest()
    assert digest_a != digest_b  # the premise: an update changes the gradmon state
    return Learners(cfg, LocalAlgo(learner), digest_a, digest_b, state_a, state_b, LocalAlgo(build_local_learner(cfg)))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite MLflow store per test module (creating one costs seconds), with an ``interrupted``
    experiment; a module that needs another overrides it."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"
    MlflowClient(uri).create_experiment("interrupted")
    return uri
