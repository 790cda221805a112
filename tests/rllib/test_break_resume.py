"""Break/resume equivalence (issue #8, fault 3), RLlib's own standard for checkpoints.

N updates, ``save_to_path``, ``restore_from_path`` into a freshly built learner, N more
updates must equal 2N uninterrupted updates on the same episodes: weights, optimizer state,
VGS statistics, telemetry state and every telemetry metric of the second half.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.learner import TELEMETRY_STATE_KEY, VGS_STATE_KEY
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update

N = 2
"""Updates before and after the checkpoint: VGS's warm-up (2 minibatches) is over within the first,
and the second half's second update reads what the first wrote after the restore (prev norms, trends)."""


def _cfg(optimizer: str):
    return config_from_dict(
        {
            "seed": 11,
            "optimizer": optimizer,
            "vgs": {"enabled": True, "warmup_steps": 2},
            "ppo": {"train_batch_size": 128, "minibatch_size": 32, "num_epochs": 2},
            "model": {"trunk_hiddens": [32]},
        }
    )


def _iterate(cfg, learner, episodes) -> list[dict]:
    """One training iteration per episode list; returns each iteration's logged telemetry."""
    logged = []
    for index, eps in copy.deepcopy(episodes):  # the learner connector edits episodes in place
        np.random.seed(1000 + index)  # RLlib shuffles minibatches with numpy's global RNG
        results = update(learner, train_batch(learner, eps), cfg)
        logged.append({k: float(v.peek()) for k, v in results[DEFAULT_MODULE_ID].items() if "/" in k})
    return logged


def _flat_state(learner) -> dict[str, np.ndarray]:
    """Everything a resumed learner must carry: weights, optimizer, VGS and telemetry state."""
    state = learner.get_state()
    out: dict[str, np.ndarray] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)
        elif isinstance(value, torch.Tensor):
            out[prefix] = value.detach().cpu().numpy()
        elif value is None or isinstance(value, str):
            out[prefix] = np.asarray(str(value))
        else:
            out[prefix] = np.asarray(value)

    for key in ("rl_module", "optimizer", TELEMETRY_STATE_KEY, VGS_STATE_KEY):
        walk(key, state[key])
    return out


@pytest.mark.parametrize("optimizer", ["adam", "upgd"])
def test_n_plus_n_updates_across_a_checkpoint_equal_2n_uninterrupted(optimizer, tmp_path):
    cfg = _cfg(optimizer)
    sampler = build_local_learner(cfg)
    episodes = [(i, sample_episodes(cfg, sampler, 128)) for i in range(2 * N)]

    straight = build_local_learner(cfg)
    straight_logged = _iterate(cfg, straight, episodes)

    first = build_local_learner(cfg)
    _iterate(cfg, first, episodes[:N])
    first.save_to_path(tmp_path / "learner")
    del first
    resumed = build_local_learner(cfg)  # fresh weights, optimizer, VGS and telemetry ...
    resumed.restore_from_path(tmp_path / "learner")  # ... all replaced by the checkpoint
    resumed_logged = _iterate(cfg, resumed, episodes[N:])

    expected, actual = _flat_state(straight), _flat_state(resumed)
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        if value.dtype.kind in "fc":
            np.testing.assert_allclose(actual[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
        else:
            np.testing.assert_array_equal(actual[key], value, err_msg=key)
    for straight_it, resumed_it in zip(straight_logged[N:], resumed_logged, strict=True):
        assert sorted(resumed_it) == sorted(straight_it)
        for name, value in straight_it.items():
            assert resumed_it[name] == pytest.approx(value, rel=1e-6, abs=1e-7, nan_ok=True), name
    assert resumed.last_telemetry.iteration == 2 * N
    assert resumed.vgs.state_dict()["step_count"] == straight.vgs.state_dict()["step_count"] > 2 * N
