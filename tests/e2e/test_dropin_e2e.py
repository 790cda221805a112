"""The drop-in example as written (APPO, CartPole, RLlib's default module and learner settings), and
two remote learners: one packed reduction, the noise scale and the replica checksum."""

from __future__ import annotations

import math
import time

import pytest
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner

from gradmon_ray import metric_names as mn
from gradmon_ray.rllib import with_gradmon

pytestmark = pytest.mark.e2e

HEADS = {"pi": r"^pi\.", "vf": r"^vf\."}


def _train_until_learner_results(algo, max_seconds: float = 150.0) -> dict:
    """``algo.train()`` until ``result["learners"]`` holds gradmon's metrics.  APPO updates
    asynchronously: on a loaded machine stock RLlib's first iterations can carry no learner
    results at all (its EnvRunners are still starting)."""
    deadline = time.monotonic() + max_seconds
    while time.monotonic() < deadline:
        result = algo.train()
        if "grad/head/pi/norm" in result.get("learners", {}).get("default_policy", {}):
            return result
    raise AssertionError(f"no learner results within {max_seconds} s")


def test_appo_example_as_written(ray_session):
    config = (
        APPOConfig()
        .environment("CartPole-v1")
        .learners(
            learner_class=with_gradmon(APPOTorchLearner),
            learner_config_dict={"gradmon": {"heads": HEADS}},
        )
    )
    algo = config.build_algo()
    try:
        result = _train_until_learner_results(algo)
        logged = result["learners"]["default_policy"]
        for head in ("pi", "vf"):
            value = logged[f"grad/head/{head}/norm"]
            assert math.isfinite(value) and value > 0, (head, value)
        assert logged[mn.GLOBAL_GRAD_NORM] >= max(logged["grad/head/pi/norm"], logged["grad/head/vf/norm"])
        assert logged[mn.TELEMETRY_ITERATION] >= 1
    finally:
        algo.stop()


def test_two_appo_learners_reduce_once_per_step(ray_session):
    start = time.monotonic()
    config = (
        APPOConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=1)
        .learners(
            num_learners=2,
            learner_class=with_gradmon(APPOTorchLearner),
            learner_config_dict={"gradmon": {"heads": HEADS, "replica_check_every": 1}},
        )
        .reporting(min_time_s_per_iteration=2)
    )
    algo = config.build_algo()
    try:
        result = _train_until_learner_results(algo)
        logged = result["learners"]["default_policy"]
        assert logged[mn.REPLICA_CHECKSUM_OK] == 1.0
        for head in ("pi", "vf"):
            assert math.isfinite(logged[f"grad/head/{head}/norm"])

        def probe(learner):
            c = learner.collective
            return c.rank, c.world_size, c.calls, learner.gradmon_iteration

        states = [r.get() for r in algo.learner_group.foreach_learner(probe)]
        ranks = sorted(s[0] for s in states)
        assert ranks == [0, 1] and all(s[1] == 2 for s in states)
        # ONE collective call per telemetry step on every learner (read while the learner
        # thread may be inside a step: the call is counted before the clock advances).
        assert all(1 <= s[3] <= s[2] <= s[3] + 1 for s in states), states
    finally:
        algo.stop()
    assert time.monotonic() - start < 300
