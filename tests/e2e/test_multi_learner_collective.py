"""Two real learner actors: one packed Ray-collective reduction, cross-rank latches, replica checksum."""

from __future__ import annotations

import hashlib
import math

import pytest

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib import build_ppo_config

pytestmark = pytest.mark.e2e


def _probe(learner) -> dict:
    module = learner.module["default_policy"].unwrapped()
    digest = hashlib.sha256()
    finite = True
    for p in module.parameters():
        finite &= bool(p.detach().isfinite().all())
        digest.update(p.detach().cpu().numpy().tobytes())
    tele = learner.last_telemetry
    return {
        "rank": learner.collective.rank,
        "world": learner.collective.world_size,
        "backend": learner.collective.backend,
        "group": learner.collective.group_name,
        "calls": learner.collective.calls,
        "params": digest.hexdigest(),
        "finite": finite,
        "nan_latched": [h for h, v in tele.nan_latched.items() if v],
        "first": dict(tele.nan_first_iteration),
        "skipped": tele.skipped,
        "minibatches": tele.minibatches,
        "iteration": tele.iteration,
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


def test_nan_on_one_rank_latches_everywhere_and_replicas_are_checked(ray_session):
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
    ppo.learner_config_dict["gradmon"]["fault_injection"] = {"nan_logits": {"rank": 1, "head": "tempo", "iteration": 2}}
    algo = ppo.build_algo()
    try:
        assert sorted(r.get() for r in algo.learner_group.foreach_learner(_record_noise_metrics)) == [0, 1]
        algo.train()
        result = algo.train()  # iteration 2: rank 1's tempo logits are NaN
        learners = sorted((r.get() for r in algo.learner_group.foreach_learner(_probe)), key=lambda d: d["rank"])
        assert [d["rank"] for d in learners] == [0, 1] and {d["world"] for d in learners} == {2}
        assert {d["backend"] for d in learners} == {"gloo"}
        assert learners[0]["group"] == learners[1]["group"] != "default"
        for d in learners:  # rank 0 never saw a NaN log-prob, yet latches 'tempo' in the same iteration
            assert d["nan_latched"] == ["tempo"] and d["first"] == {"tempo": 2}
            assert d["skipped"] == d["minibatches"] > 0
            assert d["finite"]
        assert learners[0]["params"] == learners[1]["params"]
        logged = result["learners"]["default_policy"]
        assert logged[mn.head_metric(mn.HEAD_NAN_LATCH, "tempo")] == 1.0
        assert logged[mn.head_metric(mn.HEAD_NAN_LATCH, "op")] == 0.0
        assert logged[mn.SKIPPED_UPDATES] == learners[0]["minibatches"]

        for _ in range(3):  # iterations 3-5: clean again
            result = algo.train()
        learners = sorted((r.get() for r in algo.learner_group.foreach_learner(_probe)), key=lambda d: d["rank"])
        assert [d["calls"] for d in learners] == [5, 5]  # exactly one collective call per iteration
        assert learners[0]["params"] == learners[1]["params"] and learners[0]["iteration"] == 5
        assert result["learners"]["default_policy"][mn.REPLICA_CHECKSUM_OK] == 1.0
        assert result["learners"]["default_policy"][mn.SKIPPED_UPDATES] == 0.0
        assert learners[0]["nan_latched"] == ["tempo"]  # the latch survives clean iterations
        assert math.isfinite(result["learners"]["default_policy"][mn.head_metric(mn.HEAD_GRAD_NORM, "tempo")])
        # Noise scale: local (comm hook, pre-all-reduce) vs all-reduced norms; the NaN
        # iteration is left out of the EMAs.  A head whose |G|^2 estimate is still <= 0 (weak
        # signal: the two-batch estimate can be negative) is left out, never logged as NaN.
        logged = result["learners"]["default_policy"]
        assert math.isfinite(logged[mn.GLOBAL_NOISE_SCALE])
        noise = [r.get() for r in algo.learner_group.foreach_learner(_noise_logged)]
        for per_iteration in noise[0] + noise[1]:
            assert all(math.isfinite(v) for v in per_iteration.values()), per_iteration
            assert mn.GLOBAL_NOISE_SCALE in per_iteration
        assert noise[0] == noise[1] and len(noise[0]) == 5  # every iteration, identical on both ranks
        for key, value in noise[0][-1].items():
            assert logged[key] == pytest.approx(value)

        assert sorted(r.get() for r in algo.learner_group.foreach_learner(_perturb_rank_1)) == [0, 1]
        with pytest.raises(Exception, match="replicas hold different parameters"):
            algo.train()
    finally:
        algo.stop()


def _replica_state(learner) -> dict:
    """Parameters and Adam moments: finite? and a digest to compare replicas bit for bit."""
    digest, finite = hashlib.sha256(), True
    tensors = [p.detach() for p in learner.module["default_policy"].unwrapped().parameters()]
    for state in learner.get_optimizer().state.values():
        tensors += [state["exp_avg"], state["exp_avg_sq"], state["step"].reshape(1)]
    for t in tensors:
        finite &= bool(t.isfinite().all())
        digest.update(t.cpu().numpy().tobytes())
    tele = learner.last_telemetry
    return {
        "rank": learner.collective.rank,
        "digest": digest.hexdigest(),
        "finite": finite,
        "nan_latched": [h for h, v in tele.nan_latched.items() if v],
        "inf_latched": [h for h, v in tele.inf_latched.items() if v],
        "skipped": tele.skipped,
        "minibatches": tele.minibatches,
        "steps": sorted({int(s["step"]) for s in learner.get_optimizer().state.values()}),
    }


def test_nan_and_inf_in_one_parameter_gradient_on_one_rank_skip_the_update_on_both(ray_session):
    """Issue #8 fault 1b: a non-finite gradient element on ONE learner (before DDP's all-reduce).

    Expected on both replicas in that iteration: the gradient NaN (or Inf) count says so, every
    minibatch update is skipped, the log-prob latches stay clear (the log-probs were fine),
    parameters and Adam moments stay finite and identical, and the next iteration trains again.
    """
    cfg = config_from_dict(
        {
            "seed": 6,
            "resources": {"num_learners": 2, "num_env_runners": 0},  # sampled here: no EnvRunner process to start
            "ppo": {"train_batch_size": 400, "minibatch_size": 100, "num_epochs": 2},
            "model": {"trunk_hiddens": [32, 32]},
            "distributed": {"replica_check_every": 1},
        }
    )
    ppo = build_ppo_config(cfg)
    ppo.learner_config_dict["gradmon"]["fault_injection"] = {
        "grad": [
            {"rank": 1, "head": "slot", "iteration": 2, "value": "nan"},
            {"rank": 0, "head": "op", "iteration": 3, "value": "inf"},
        ]
    }
    algo = ppo.build_algo()

    def states() -> list[dict]:
        return sorted((r.get() for r in algo.learner_group.foreach_learner(_replica_state)), key=lambda d: d["rank"])

    try:
        logged = [algo.train()["learners"]["default_policy"]]
        before = states()
        assert before[0]["skipped"] == 0 and before[0]["digest"] == before[1]["digest"]
        for iteration, (count_name, other_name) in (
            (2, (mn.NAN_GRAD_COUNT, mn.INF_GRAD_COUNT)),
            (3, (mn.INF_GRAD_COUNT, mn.NAN_GRAD_COUNT)),
        ):
            logged.append(algo.train()["learners"]["default_policy"])
            after = states()
            m = after[0]["minibatches"]
            assert m == 4  # each learner's shard: 200 rows / 100 per minibatch x 2 epochs
            for d in after:
                assert d["skipped"] == m, (iteration, d)  # skipped on BOTH replicas
                assert d["nan_latched"] == [] and d["inf_latched"] == []  # log-probs were finite
                assert d["finite"]
                assert d["digest"] == before[0]["digest"]  # nothing moved: params, moments, step counts
            assert logged[-1][count_name] == m  # one poisoned element per minibatch, counted once (not per replica)
            assert logged[-1][other_name] == 0
            assert logged[-1][mn.SKIPPED_UPDATES] == m and logged[-1][mn.REPLICA_CHECKSUM_OK] == 1.0
        for _ in range(2):  # iterations 4-5: clean again, training resumes on both replicas
            logged.append(algo.train()["learners"]["default_policy"])
        after = states()
        assert after[0]["digest"] == after[1]["digest"] != before[0]["digest"]
        assert after[0]["steps"] == [before[0]["steps"][0] + 2 * after[0]["minibatches"]]
        assert all(d["finite"] and d["skipped"] == 0 for d in after)
        assert logged[-1][mn.NAN_GRAD_COUNT] == 0 and logged[-1][mn.SKIPPED_UPDATES] == 0
        assert logged[-1][mn.SKIPPED_UPDATES_TOTAL] == 2 * m
        for head in ("op", "slot", "value"):
            assert math.isfinite(logged[-1][mn.head_metric(mn.HEAD_GRAD_NORM, head)])
    finally:
        algo.stop()
