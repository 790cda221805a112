"""Two real learner actors, one build, one fault schedule: one packed Ray-collective reduction per
iteration, non-finite gradients and log-probs on one rank, cross-rank latches, the replica checksum.

The schedule (1-based iterations of one Algorithm, two learners over gloo):

1. clean;
2. rank 1 writes a NaN into one element of head ``slot``'s gradient (before DDP's all-reduce);
3. clean: both replicas train again;
4. rank 0 writes an Inf into head ``op``'s gradient;
5. clean again;
6. rank 1's ``tempo`` logits are NaN (its log-probs too; rank 0's are fine);
7. clean: training resumes on both replicas, the ``tempo`` latch stays (one clean iteration shows
   both: a second one trained and latched alike);
8. rank 1's first parameter is nudged by 1e-3 before the iteration: the replica check fails it.

The module's fixture runs it and records what each learner held after each step; the tests read
the record (one two-learner build, not one per subject: each build starts two actor processes).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import pytest

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib import build_ppo_config
from tests.rllib.fault_injection import with_faults

pytestmark = pytest.mark.e2e

NAN_GRAD, INF_GRAD, NAN_LOGITS, CLEAN_AFTER = 2, 4, 6, (7,)
FAULTS = (NAN_GRAD, INF_GRAD, NAN_LOGITS)
MINIBATCHES = 4
"""Per learner and iteration: its 200-row shard / 100 per minibatch x 2 epochs."""


def _state(learner) -> dict:
    """What one learner holds: a digest of its parameters and Adam moments, its telemetry and collective."""
    digest, finite = hashlib.sha256(), True
    params = [p.detach() for p in learner.module["default_policy"].unwrapped().parameters()]
    params_digest = hashlib.sha256()
    for p in params:
        params_digest.update(p.cpu().numpy().tobytes())
    tensors = list(params)
    for state in learner.get_optimizer().state.values():
        tensors += [state["exp_avg"], state["exp_avg_sq"], state["step"].reshape(1)]
    for t in tensors:
        finite &= bool(t.isfinite().all())
        digest.update(t.cpu().numpy().tobytes())
    tele = learner.last_telemetry
    return {
        "rank": learner.collective.rank,
        "world": learner.collective.world_size,
        "backend": learner.collective.backend,
        "group": learner.collective.group_name,
        "calls": learner.collective.calls,
        "params": params_digest.hexdigest(),
        "digest": digest.hexdigest(),
        "finite": finite,
        "nan_latched": [h for h, v in tele.nan_latched.items() if v],
        "inf_latched": [h for h, v in tele.inf_latched.items() if v],
        "first": dict(tele.nan_first_iteration),
        "skipped": tele.skipped,
        "minibatches": tele.minibatches,
        "iteration": tele.iteration,
        "steps": sorted({int(s["step"]) for s in learner.get_optimizer().state.values()}),
    }


def _perturb_rank_1(learner) -> int:
    if learner.collective.rank == 1:
        p = next(iter(learner.module["default_policy"].unwrapped().parameters()))
        p.data.view(-1)[0] += 1e-3
    return learner.collective.rank


def _record_noise_metrics(learner) -> int:
    """Wrap the learner's noise-scale metrics so that the test sees exactly what it logs.

    (RLlib's result alone can't tell: its MetricsLogger reports NaN for a key a learner logged
    in an earlier iteration but left out of this one.)
    """
    learner._noise_logged = []
    inner = learner._noise_scale_metrics

    def record(monitor, noise, minibatches):
        out = inner(monitor, noise, minibatches)
        learner._noise_logged.append(dict(out))
        return out

    learner._noise_scale_metrics = record
    return learner.collective.rank


def _noise_logged(learner) -> list[dict[str, float]]:
    return learner._noise_logged


@pytest.fixture(scope="module")
def schedule(ray_session) -> dict[str, Any]:
    cfg = config_from_dict(
        {
            "seed": 5,
            "resources": {"num_learners": 2, "num_env_runners": 0},  # sampled here: no EnvRunner process to start
            "ppo": {"train_batch_size": 400, "minibatch_size": 100, "num_epochs": 2},
            "model": {"trunk_hiddens": [32, 32]},
            "distributed": {"replica_check_every": 1},
        }
    )
    ppo = build_ppo_config(cfg)
    faults = {
        "grad": [
            {"rank": 1, "head": "slot", "iteration": NAN_GRAD, "value": "nan"},
            {"rank": 0, "head": "op", "iteration": INF_GRAD, "value": "inf"},
        ],
        "nan_logits": {"rank": 1, "head": "tempo", "iteration": NAN_LOGITS},
    }
    ppo = with_faults(ppo, faults)
    algo = ppo.build_algo()

    def states() -> list[dict]:
        return sorted((r.get() for r in algo.learner_group.foreach_learner(_state)), key=lambda d: d["rank"])

    record: dict[str, Any] = {"logged": {}, "states": {}}
    try:
        assert sorted(r.get() for r in algo.learner_group.foreach_learner(_record_noise_metrics)) == [0, 1]
        for iteration in range(1, CLEAN_AFTER[-1] + 1):
            record["logged"][iteration] = algo.train()["learners"]["default_policy"]
            record["states"][iteration] = states()
        record["noise"] = [r.get() for r in algo.learner_group.foreach_learner(_noise_logged)]
        assert sorted(r.get() for r in algo.learner_group.foreach_learner(_perturb_rank_1)) == [0, 1]
        try:
            algo.train()
            record["replica_error"] = None
        except Exception as exc:  # what the test expects
            record["replica_error"] = exc
    finally:
        algo.stop()
    return record


def test_two_ranks_one_gloo_group_one_collective_call_per_iteration(schedule):
    learners = schedule["states"][CLEAN_AFTER[-1]]
    assert [d["rank"] for d in learners] == [0, 1] and {d["world"] for d in learners} == {2}
    assert {d["backend"] for d in learners} == {"gloo"}
    assert learners[0]["group"] == learners[1]["group"] != "default"
    assert [d["calls"] for d in learners] == [CLEAN_AFTER[-1]] * 2  # exactly one collective call per iteration
    assert all(d["iteration"] == CLEAN_AFTER[-1] for d in learners)


def test_a_non_finite_gradient_element_on_one_rank_skips_the_update_on_both(schedule):
    """Issue #8 fault 1b: a non-finite gradient element on ONE learner (before DDP's all-reduce).

    Expected on both replicas in that iteration: the gradient NaN (or Inf) count says so, every
    minibatch update is skipped, the log-prob latches stay clear (the log-probs were fine),
    parameters and Adam moments stay finite and identical.
    """
    for iteration, count_name, other_name in (
        (NAN_GRAD, mn.NAN_GRAD_COUNT, mn.INF_GRAD_COUNT),
        (INF_GRAD, mn.INF_GRAD_COUNT, mn.NAN_GRAD_COUNT),
    ):
        before = schedule["states"][iteration - 1]  # a clean iteration
        assert before[0]["skipped"] == 0 and before[0]["digest"] == before[1]["digest"], iteration
        after, logged = schedule["states"][iteration], schedule["logged"][iteration]
        for d in after:
            assert d["minibatches"] == MINIBATCHES, (iteration, d)
            assert d["skipped"] == MINIBATCHES, (iteration, d)  # skipped on BOTH replicas
            assert d["nan_latched"] == [] and d["inf_latched"] == [], (iteration, d)  # log-probs were finite
            assert d["finite"], (iteration, d)
            assert d["digest"] == before[0]["digest"], (iteration, d)  # nothing moved: params, moments, steps
        assert logged[count_name] == MINIBATCHES, iteration  # one element per minibatch, counted once, not per replica
        assert logged[other_name] == 0, iteration
        assert logged[mn.SKIPPED_UPDATES] == MINIBATCHES and logged[mn.REPLICA_CHECKSUM_OK] == 1.0, iteration
        # ... and the next iteration trains both replicas again: only the poisoned one was skipped.
        following, logged_next = schedule["states"][iteration + 1], schedule["logged"][iteration + 1]
        assert all(d["skipped"] == 0 and d["finite"] for d in following), (iteration + 1, following)
        assert following[0]["digest"] == following[1]["digest"] != after[0]["digest"], iteration + 1
        assert following[0]["steps"] == [after[0]["steps"][0] + MINIBATCHES], iteration + 1
        assert logged_next[count_name] == 0 and logged_next[mn.SKIPPED_UPDATES] == 0, iteration + 1


def test_nan_log_probs_on_one_rank_latch_on_both_and_skip_the_update(schedule):
    learners, logged = schedule["states"][NAN_LOGITS], schedule["logged"][NAN_LOGITS]
    for d in learners:  # rank 0 never saw a NaN log-prob, yet latches 'tempo' in the same iteration
        assert d["nan_latched"] == ["tempo"] and d["first"] == {"tempo": NAN_LOGITS}, d
        assert d["skipped"] == d["minibatches"] == MINIBATCHES, d
        assert d["finite"], d
        assert d["digest"] == schedule["states"][NAN_LOGITS - 1][0]["digest"]  # skipped: nothing moved
    assert learners[0]["params"] == learners[1]["params"]
    assert logged[mn.head_metric(mn.HEAD_NAN_LATCH, "tempo")] == 1.0
    assert logged[mn.head_metric(mn.HEAD_NAN_LATCH, "op")] == 0.0
    assert logged[mn.SKIPPED_UPDATES] == MINIBATCHES


def test_clean_iterations_train_both_replicas_again_and_the_latch_stays(schedule):
    before, after = schedule["states"][NAN_LOGITS], schedule["states"][CLEAN_AFTER[-1]]
    logged = schedule["logged"][CLEAN_AFTER[-1]]
    assert after[0]["digest"] == after[1]["digest"] != before[0]["digest"]
    assert after[0]["steps"] == [before[0]["steps"][0] + len(CLEAN_AFTER) * MINIBATCHES]
    # Adam stepped in every clean iteration and in none of the three faulty ones.
    clean = CLEAN_AFTER[-1] - len(FAULTS)
    assert after[0]["steps"] == [clean * MINIBATCHES]
    assert all(d["finite"] and d["skipped"] == 0 for d in after)
    assert all(d["nan_latched"] == ["tempo"] for d in after)  # the latch survives clean iterations
    assert logged[mn.NAN_GRAD_COUNT] == 0 and logged[mn.SKIPPED_UPDATES] == 0
    assert logged[mn.SKIPPED_UPDATES_TOTAL] == len(FAULTS) * MINIBATCHES
    assert logged[mn.REPLICA_CHECKSUM_OK] == 1.0
    for head in ("op", "slot", "tempo", "value"):
        assert math.isfinite(logged[mn.head_metric(mn.HEAD_GRAD_NORM, head)]), head


def test_the_noise_scale_is_logged_every_iteration_identically_on_both_ranks(schedule):
    """Local (comm hook, pre-all-reduce) vs all-reduced norms; the non-finite iterations are left out
    of the EMAs.  A head whose |G|^2 estimate is still <= 0 (weak signal: the two-batch estimate
    can be negative) is left out, never logged as NaN."""
    noise = schedule["noise"]
    for per_iteration in noise[0] + noise[1]:
        assert all(math.isfinite(v) for v in per_iteration.values()), per_iteration
        assert mn.GLOBAL_NOISE_SCALE in per_iteration
    assert noise[0] == noise[1] and len(noise[0]) == CLEAN_AFTER[-1]  # every iteration, identical on both ranks
    logged = schedule["logged"][CLEAN_AFTER[-1]]
    assert math.isfinite(logged[mn.GLOBAL_NOISE_SCALE])
    for key, value in noise[0][-1].items():
        assert logged[key] == pytest.approx(value)


def test_replicas_that_hold_different_parameters_fail_the_iteration(schedule):
    assert schedule["replica_error"] is not None, "a nudged replica went unnoticed"
    assert "replicas hold different parameters" in str(schedule["replica_error"])
