"""Multi-agent PPO on real Ray: two learner actors x two modules, one collective per step, each
module averaged across learners by gradmon (replica weights compared module by module), a NaN
on one rank latched on both, per module.  (APPO's
two learners on RLlib's default multi-agent modules: test_dropin_e2e.py; a two-agent run's MLflow
names per module: test_mlflow_ui_e2e.py, which trains one for the browser too.)"""

from __future__ import annotations

import pytest

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib import build_ppo_config
from tests.rllib.fault_injection import with_faults

pytestmark = pytest.mark.e2e

AGENTS = ("agent_0", "agent_1")


def _per_module(learner) -> dict:
    import hashlib

    def digest(mid: str) -> str:
        h = hashlib.sha256()
        for p in learner.module[mid].unwrapped().parameters():
            h.update(p.detach().cpu().numpy().tobytes())
        return h.hexdigest()

    return {
        "rank": learner.collective.rank,
        "averaged_by_gradmon": learner.gradient_average is not None,
        "digests": {mid: digest(mid) for mid in AGENTS},
        "calls": learner.collective.calls,
        "modules": {
            mid: {
                "heads": list(m.head_names),
                "nan_latched": sorted(h for h, v in m.last_telemetry.nan_latched.items() if v),
                "norms": dict(m.last_telemetry.head_norms),
                "iteration": m.last_telemetry.iteration,
            }
            for mid, m in learner.gradmon_modules.items()
        },
    }


def test_two_learners_two_modules_one_collective_per_step(ray_session):
    cfg = config_from_dict(
        {
            "seed": 3,
            "env": {"id": "gradmon/FactoredOpsMultiAgent-v0"},
            "resources": {"num_env_runners": 0, "num_learners": 2},  # the learners are the subject
            "ppo": {"train_batch_size": 256, "minibatch_size": 128, "num_epochs": 1},
            "model": {"trunk_hiddens": [16]},
        }
    )
    ppo = build_ppo_config(cfg)
    ppo = with_faults(ppo, {"nan_logits": {"rank": 1, "head": "tempo", "iteration": 2}})
    algo = ppo.build_algo()
    try:
        results = [algo.train() for _ in range(3)]
        learners = sorted((r.get() for r in algo.learner_group.foreach_learner(_per_module)), key=lambda d: d["rank"])
    finally:
        algo.stop()
    assert [d["calls"] for d in learners] == [3, 3], "one collective per step, however many modules"
    assert all(d["averaged_by_gradmon"] for d in learners), "two modules x two learners: gradmon averages"
    # The replicas hold the same weights, module by module (a gradient mixed up between modules,
    # or averaged on one learner only, makes them differ), and the modules differ from each other.
    assert learners[0]["digests"] == learners[1]["digests"]
    assert learners[0]["digests"]["agent_0"] != learners[0]["digests"]["agent_1"]
    for d in learners:
        assert sorted(d["modules"]) == list(AGENTS)
        for mid in AGENTS:
            module = d["modules"][mid]
            assert module["heads"][0] == "alpha_curve" and module["heads"][-1] == "value"
            assert module["iteration"] == 3
            # rank 1's NaN logits (every module's loss, iteration 2) latch on rank 0 too, per module
            assert module["nan_latched"] == ["tempo"]
    # the reduced numbers are the same on both learners, module by module
    assert learners[0]["modules"] == learners[1]["modules"]
    last = results[-1]["learners"]
    for mid in AGENTS:
        assert last[mid][mn.head_metric(mn.HEAD_NAN_LATCH, "tempo")] == 1.0
        assert last[mid][mn.head_metric(mn.HEAD_GRAD_NORM, "op")] == pytest.approx(
            learners[0]["modules"][mid]["norms"]["op"]
        )
    # the two agents' policies are different modules with different gradients
    assert learners[0]["modules"]["agent_0"]["norms"] != learners[0]["modules"]["agent_1"]["norms"]
