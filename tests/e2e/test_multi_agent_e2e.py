"""Multi-agent PPO on real Ray: two learner actors x two modules, one collective per step, each
module averaged across learners by gradmon (replica weights compared module by module), a NaN
on one rank latched on both, per module; a module added mid-run (``algo.add_module``) in the MLflow
callback's head-names tag and the report.  (APPO's
two learners on RLlib's default multi-agent modules: test_dropin_e2e.py; a two-agent run's MLflow
names per module: test_mlflow_ui_e2e.py, which trains one for the browser too.)"""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.rl_module.rl_module import RLModuleSpec

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import main
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib import build_ppo_config, with_gradmon
from gradmon_ray.tracking import GradmonMLflowCallback
from gradmon_ray.tracking.mlflow_io import mlflow_value
from tests.peer.pairs import HEADS, cartpole_config
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


def test_a_module_added_mid_run_joins_the_head_names_tag_and_the_report(ray_session, tmp_path, capsys):
    """A newcomer's league step: two policies with ``with_gradmon(PPOTorchLearner)`` and the MLflow
    callback, one iteration, then ``algo.add_module("p2")`` with agent 1 mapped to it, one more
    iteration.  The run's ``gradmon.head_names`` tag then names p2's heads after p0's and p1's; MLflow
    holds p2's norm at step 2 exactly as the algorithm's result does; ``report`` exits 0 with a heads
    table for each of the three modules.  (A module's iteration without samples, NaN counts in the
    report: ``tests/viz/test_module_set_changes.py``.)"""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    training = {"num_epochs": 1, "minibatch_size": 128}  # one minibatch an iteration: the tag is the subject
    config = cartpole_config(
        "ppo", with_gradmon(PPOTorchLearner), agents=2, gradmon={"heads": HEADS}, training=training
    )
    config.callbacks(GradmonMLflowCallback.configured(tracking_uri=uri, experiment="league"))
    algo = config.build_algo()
    try:
        algo.train()
        algo.add_module(
            module_id="p2",
            module_spec=RLModuleSpec.from_module(algo.get_module("p0")),
            new_agent_to_module_mapping_fn=lambda agent_id, *args, **kwargs: "p0" if agent_id == 0 else "p2",
        )
        result = algo.train()
        callback = next(c for c in algo.callbacks if isinstance(c, GradmonMLflowCallback))
        run_id = callback.sink.wait_for_run(30)
    finally:
        algo.stop()
    run = MlflowClient(uri).get_run(run_id)
    tag = run.data.tags[mn.TAG_HEAD_NAMES].split(",")  # p0 and p1 in RLlib's policy-set order, then p2
    assert sorted(tag[:4]) == ["p0/pi", "p0/vf", "p1/pi", "p1/vf"] and tag[4:] == ["p2/pi", "p2/vf"], tag
    name = mn.head_metric(mn.HEAD_GRAD_NORM, "p2/pi")
    history = {m.step: m.value for m in MlflowClient(uri).get_metric_history(run_id, name)}
    assert history == {2: mlflow_value(result["learners"]["p2"][mn.head_metric(mn.HEAD_GRAD_NORM, "pi")])}
    out = tmp_path / "report"
    assert main(["report", run_id, "--tracking-uri", uri, "--out", str(out)]) == 0, capsys.readouterr().err
    heads_table = (out / "summary.md").read_text().split("## Heads, worst first")[1].split("## Latched heads")[0]
    in_tag_order = list(dict.fromkeys(label.split("/")[0] for label in tag))  # policies: a set, so p0/p1 either way
    assert [m.split("\n", 1)[0] for m in heads_table.split("### module ")[1:]] == in_tag_order
