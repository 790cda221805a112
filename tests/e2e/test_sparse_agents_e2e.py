"""Sparse agents on two learners: a module missing from one learner's shard, and one missing from
the whole iteration, train on without a hang; every module's gradient is the mean of the LOCAL
gradients of the learners that trained it (recorded before the average: the oracle), the replicas
hold identical weights module by module, and a module nobody trained is neither stepped nor
reported (its norms missing, 0 minibatches).  Stock RLlib on the same run: docs/observe_only.md."""

from __future__ import annotations

import faulthandler
import hashlib
import math
import time

import numpy as np
import pytest

from gradmon_ray import metric_names as mn
from gradmon_ray.metric_parsing import parse
from gradmon_ray.rllib.monitor import with_gradmon
from tests.e2e.sparse_agents import EPISODE_LEN, POLICIES, LocalGradientsPPOLearner, SparseAgentsEnv, policy_of

pytestmark = pytest.mark.e2e

ITERATIONS = 3
HANG_S = 150  # a hang (what stock RLlib does here) ends the test process instead of stalling CI for 30 min


def _view(learner) -> dict:
    return {**_view_of(learner, list(POLICIES)), "averaged_here": learner.gradient_average is not None}


def _views(algo) -> list[dict]:
    return sorted((r.get() for r in algo.learner_group.foreach_learner(_view)), key=lambda v: v["rank"])


def test_modules_missing_from_a_learners_shard_train_on_with_exact_means(ray_session):
    config = (
        __import__("ray.rllib.algorithms.ppo", fromlist=["PPOConfig"])
        .PPOConfig()
        .environment(SparseAgentsEnv)
        .multi_agent(policies=set(POLICIES), policy_mapping_fn=policy_of)
        .env_runners(num_env_runners=0)
        .learners(
            num_learners=2,
            learner_class=with_gradmon(LocalGradientsPPOLearner),
            learner_config_dict={"gradmon": {"replica_check_every": 1}},
        )
        .training(train_batch_size_per_learner=2 * EPISODE_LEN, minibatch_size=2 * EPISODE_LEN, num_epochs=1)
        .debugging(seed=0)
    )
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    start = time.monotonic()
    algo = config.build_algo()
    try:
        before = _views(algo)
        results, views = [], []
        for _ in range(ITERATIONS):
            results.append(algo.train()["learners"])
            views.append(_views(algo))
    finally:
        algo.stop()
        faulthandler.cancel_dump_traceback_later()
    assert time.monotonic() - start < HANG_S
    assert all(v["averaged_here"] for v in before), "3 modules x 2 learners: gradmon averages, not DDP"
    # The replicas start from rank 0's weights and stay identical, module by module.
    for view in [before, *views]:
        assert view[0]["digests"] == view[1]["digests"]
    for it in range(ITERATIONS):
        learners = views[it]
        local = [v["local_grads"][it] for v in learners]  # one minibatch per update
        present = {mid: [g[mid] for g in local if g[mid] is not None] for mid in POLICIES}
        assert len(present["p0"]) == 2 and len(present["p1"]) == 1, "the env's schedule (see sparse_agents)"
        result = results[it]
        for mid, grads in present.items():
            if grads:
                mean = np.mean(grads, axis=0)
                assert result[mid][mn.GLOBAL_GRAD_NORM] == pytest.approx(np.linalg.norm(mean), rel=1e-5), (it, mid)
                assert result[mid][mn.MINIBATCH_UPDATES] == 1.0
                assert result[mid][mn.REPLICA_CHECKSUM_OK] == 1.0
            else:  # nobody trained it: not stepped, and its norms are missing, not 0
                assert (it, mid) == (1, "p2")
                prev = (views[it - 1] if it else before)[0]["digests"][mid]
                assert learners[0]["digests"][mid] == prev, "a module no learner trained is not stepped"
                assert math.isnan(result[mid][mn.GLOBAL_GRAD_NORM])
                assert math.isnan(result[mid][mn.head_metric(mn.HEAD_GRAD_NORM, "pi")]), result[mid]
                assert math.isnan(result[mid][mn.MINIBATCH_UPDATES]), "not logged: RLlib's NaN"
    assert len({len(v["local_grads"]) for v in views[-1]}) == 1


def _modules_view(learner) -> dict:
    from gradmon_ray.rllib.monitor_step import TELEMETRY_STATE_KEY

    view = _view_of(learner, list(learner.module.keys()))
    view["monitored"] = {mid: [list(m.head_names), m.tracker.iteration] for mid, m in learner.gradmon_modules.items()}
    view["state_modules"] = sorted(learner.get_state(components=[TELEMETRY_STATE_KEY])[TELEMETRY_STATE_KEY])
    view["averaged"] = learner.gradient_average is not None and len(learner.gradient_average.modules)
    return view


def _view_of(learner, module_ids: list[str]) -> dict:
    digests = {}
    for mid in module_ids:
        digest = hashlib.sha256()
        for p in learner.module[mid].unwrapped().parameters():
            digest.update(p.detach().cpu().numpy().tobytes())
        digests[mid] = digest.hexdigest()
    return {"rank": learner.collective.rank, "digests": digests, "local_grads": list(learner.local_grads)}


def test_a_module_added_mid_run_is_monitored_and_averaged_from_its_first_update(ray_session):
    """The self-play pattern on two learners: ``add_module("p3")`` after iteration 1 (a trainable
    copy of ``p1``'s spec; ``a2`` plays as ``p3`` in iteration 3, on one learner's shard), then
    ``remove_module`` after iteration 3.  Iteration 2 (p3 in the schema, trained by nobody) is already
    an update after the add, so iteration 3 is p3's average in a second update since it."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from tests.e2e.sparse_agents import policy_of_with_p3

    config = (
        PPOConfig()
        .environment(SparseAgentsEnv, env_config={"late_a2": True})
        .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=policy_of_with_p3)
        .env_runners(num_env_runners=0)
        .learners(num_learners=2, learner_class=with_gradmon(LocalGradientsPPOLearner))
        .training(train_batch_size_per_learner=2 * EPISODE_LEN, minibatch_size=2 * EPISODE_LEN, num_epochs=1)
        .debugging(seed=0)
    )
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    algo = config.build_algo()
    try:
        algo.train()
        algo.add_module("p3", RLModuleSpec.from_module(algo.get_module("p1")))
        added = _all_views(algo)
        results = [algo.train()["learners"] for _ in range(2)]
        after = _all_views(algo)
        algo.remove_module("p3")
        final = algo.train()["learners"]
        removed = _all_views(algo)
    finally:
        algo.stop()
        faulthandler.cancel_dump_traceback_later()
    for view in added:  # monitored from the start, its clock at the learner's, averaged with the others
        assert view["monitored"]["p3"] == [["pi", "vf"], 1], view["monitored"]
        assert view["monitored"]["p0"][1] == 1 and view["averaged"] == 3
    assert added[0]["digests"] == added[1]["digests"], "the new module starts from rank 0's weights"
    assert after[0]["digests"] == after[1]["digests"]
    assert after[0]["digests"]["p3"] != added[0]["digests"]["p3"], "p3 trains"
    assert after[0]["state_modules"] == ["p0", "p1", "p3"], "its telemetry state is checkpointed"
    seen = []
    for k, result in enumerate(results):  # iterations 2-3
        local = [v["local_grads"][1 + k]["p3"] for v in after]
        grads = [g for g in local if g is not None]
        seen.append(len(grads))
        if grads:  # p3's norms: the mean of the local gradients of the learners that trained it
            mean = np.mean(grads, axis=0)
            assert result["p3"][mn.GLOBAL_GRAD_NORM] == pytest.approx(np.linalg.norm(mean), rel=1e-5)
            assert result["p3"][mn.TELEMETRY_ITERATION] == 2.0 + k
        else:
            assert mn.GLOBAL_GRAD_NORM not in result.get("p3", {}), "nobody trained p3: nothing reported"
    assert seen == [0, 1], "the env's schedule: p3 untrained, then on one learner's shard"
    # RLlib's logger keeps a removed module's keys, as NaN (its own losses too): nothing new is logged
    logged = [(k, v) for k, v in final.get("p3", {}).items() if parse(k) is not None and not math.isnan(v)]
    assert not logged
    assert all(sorted(v["monitored"]) == ["p0", "p1"] for v in removed)
    assert removed[0]["state_modules"] == ["p0", "p1"]
    assert removed[0]["digests"] == removed[1]["digests"]


def _all_views(algo) -> list[dict]:
    return sorted((r.get() for r in algo.learner_group.foreach_learner(_modules_view)), key=lambda v: v["rank"])
