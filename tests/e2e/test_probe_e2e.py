"""The gradient probe in a real training run: two modules, a real probe actor killed mid-run, a real
MLflow sqlite store.

``run_training`` on the built-in two-agent env (modules ``agent_0``, ``agent_1``; one local learner,
sampling on the driver), probing every iteration for 3 iterations.  Once iteration 1's probe is in
MLflow the probe actor is killed and Ray restarts it: iteration 2's request goes to the restarting
(or just restarted) actor, iteration 3's to the restarted one.  A spy on the learner's
``_probe_request`` keeps each request it hands to the actor (the weights and batch the probe got);
the oracle test recomputes each module's bucket numbers from them with the PPO loss written by hand
(``hand_written_losses``) and ``torch.autograd.grad``, and reads MLflow's
``module/<id>/grad_norm/bucket_1/...`` at each probed iteration's step.  One run for the kill and
the modules (each run is an Algorithm and a probe actor: seconds of a loaded box).

Bugs this catches: training stopped by the dead probe, a request the restarting actor refused lost
(a step missing), a probe finishing after the last iteration left uncounted, the probe following one
module (the other's names absent from MLflow), the actor logging one module's numbers under both
names (each module has its own oracle, and they differ), names without the module (``grad_norm/...``
plain in a two-module run), a probe at the wrong step.  One module's plain names: the actor's in
``tests/probe/test_actor.py::test_actor_logs_bucket_metrics_into_the_run_at_the_training_iteration``,
the learner's one-module request in ``..._learner_hands_off_pre_update_weights...`` there; bucket
order by reward std: ``tests/probe/test_analysis.py`` (worked answers).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import ray
import torch
import tree
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.train.run import run_training
from gradmon_ray.config import config_from_dict
from gradmon_ray.probe.actor import PROBE_ACTOR_PREFIX
from gradmon_ray.probe.client import LossSettings
from gradmon_ray.rllib.learner import GradmonPPOTorchLearner
from tests.probe.designed_batch import flat, hand_written_losses

pytestmark = pytest.mark.e2e

AGENTS = ("agent_0", "agent_1")
COMPONENTS = ("task", "entropy", "value", "logit_l2")  # use_kl_loss is off: no KL component
PROBED = [1, 2, 3]


def _first_probe_in_mlflow(client: MlflowClient) -> None:
    """Wait until iteration 1's probe is in MLflow (so the kill cannot land mid-analysis)."""
    run_id = client.search_runs([client.get_experiment_by_name("probe").experiment_id])[0].info.run_id
    names = [
        mn.module_metric(m, mn.probe_metric(mn.PROBE_COMPONENT_NORM, "bucket_1", component="task")) for m in AGENTS
    ]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(client.get_metric_history(run_id, n) for n in names):
        time.sleep(0.1)


def _kill_the_probe_actor() -> str:
    """Kill the probe actor (Ray restarts it) and wait until the old instance is gone."""
    names = [n for n in ray.util.list_named_actors() if n.startswith(PROBE_ACTOR_PREFIX)]
    handle = ray.get_actor(names[0])
    old = ray.get(handle.instance.remote())
    ray.kill(handle, no_restart=False)
    # The kill is asynchronous: a call made right after it can still be answered by the dying
    # instance (that is how the old `ready()` wait let the next iteration run into the restart).
    # Wait until the old instance is gone, not until the new one is up: the next iteration's
    # request may reach the restarting actor, and must still arrive.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if ray.get(handle.instance.remote(), timeout=30) != old:
                break  # already restarted
        except Exception:  # ActorUnavailableError: restarting
            break
        time.sleep(0.1)
    return names[0]


@pytest.fixture(scope="module")
def probed_run(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    cfg = config_from_dict(
        {
            "iterations": len(PROBED),
            "seed": 9,
            "env": {"id": "gradmon/FactoredOpsMultiAgent-v0"},
            "ppo": {"train_batch_size": 128, "minibatch_size": 64, "num_epochs": 1},
            "model": {"trunk_hiddens": [16]},
            "resources": {"num_env_runners": 0, "num_learners": 0},  # the probe actor is the subject
            "regularizers": [{"name": "logit_l2", "weight": 0.01}],
            "probe": {"gradient_analysis_every": 1, "num_buckets": 1, "track_grad_norms": True, "max_restarts": 2},
            "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "probe"},
        }
    )
    killed: list[str] = []
    resends: list[int] = []
    requests = []
    real = GradmonPPOTorchLearner._probe_request

    def spy(learner, snapshot):
        request = real(learner, snapshot)
        requests.append(request)
        return request

    def reporter(iteration, metrics, algo, monitor, stop_reason) -> None:
        if iteration == 1:
            _first_probe_in_mlflow(MlflowClient(cfg.mlflow.tracking_uri))
            killed.append(_kill_the_probe_actor())
        if iteration == 2:
            # Iteration 2's probe went to the restarting (or just restarted) actor. Let the learner's
            # client finish it (resending while the actor restarts) before iteration 3, so that
            # iteration 3 finds no probe in flight: every count below is deterministic.
            def finish(learner):
                assert learner._probe.finish(120.0)
                return learner._probe.resends

            resends.extend(r.get() for r in algo.learner_group.foreach_learner(finish))

    patch = pytest.MonkeyPatch()
    patch.setattr(GradmonPPOTorchLearner, "_probe_request", spy)
    try:
        outcome = run_training(cfg, progress=None, reporter=reporter)
    finally:
        patch.undo()
    return cfg, outcome, killed, resends, requests


def test_training_survives_the_killed_probe_and_every_probe_is_counted(probed_run):
    cfg, outcome, killed, resends, _ = probed_run
    assert killed == [outcome.probe_actor]
    assert outcome.iterations_done == len(PROBED) and outcome.mlflow_complete
    client = MlflowClient(cfg.mlflow.tracking_uri)
    run = client.get_run(outcome.run_id)
    assert run.info.status == "FINISHED"
    # Iteration 1 probed before the kill, 2 and 3 by the restarted actor: all three handed off
    # and completed (a request the restarting actor could not take is sent again, not failed).
    counters = {k: run.data.metrics[k] for k in mn.PROBE_COUNTERS}
    assert counters == {
        mn.PROBE_REQUESTS_SENT: 3.0,
        mn.PROBE_COMPLETED: 3.0,
        mn.PROBE_REQUESTS_DROPPED: 0.0,
        mn.PROBE_SKIPPED: 0.0,
        mn.PROBE_FAILURES: 0.0,
    }, (counters, resends)
    # The final counters are logged at the last step, after the last probe (iteration 3's,
    # which finishes after iteration 3's metrics were logged) was collected.
    completed = client.get_metric_history(outcome.run_id, mn.PROBE_COMPLETED)
    assert max((m.step, m.timestamp, m.value) for m in completed)[::2] == (len(PROBED), 3.0)


def test_probe_metrics_of_both_modules_at_each_probed_iteration(probed_run):
    cfg, outcome, _, _, _ = probed_run
    client = MlflowClient(cfg.mlflow.tracking_uri)
    run = client.get_run(outcome.run_id)
    assert not any(name.startswith("grad_norm/") for name in run.data.metrics), "no unprefixed probe metric"
    names = [mn.probe_metric(mn.PROBE_COMPONENT_NORM, "bucket_1", component=c) for c in COMPONENTS]
    names += [mn.probe_metric(mn.PROBE_PER_TOKEN_NORM, "bucket_1", component=c) for c in COMPONENTS]
    names += [mn.probe_metric(mn.PROBE_PER_SAMPLE_NORM, "bucket_1", component="task")]
    names += [mn.probe_metric(mn.PROBE_LOSS, "bucket_1", loss=k) for k in ("policy", "entropy", "value", "total")]
    names += [mn.probe_metric(mn.PROBE_REWARD_STD_MEAN, "bucket_1")]
    names += [mn.probe_metric(mn.PROBE_REGULARIZER_TOTAL, "bucket_1")]
    names += [mn.probe_metric(mn.PROBE_SHARE, "bucket_1", component="task")]
    names += [mn.probe_metric(mn.PROBE_HEAD_NORM, "bucket_1", head="op", component="task")]
    wrong = {}
    for mid in AGENTS:
        for name in names:
            history = client.get_metric_history(outcome.run_id, mn.module_metric(mid, name))
            # Iteration 1 was probed before the kill, iterations 2 and 3 by the restarted actor.
            if sorted(m.step for m in history) != PROBED or not all(math.isfinite(m.value) for m in history):
                wrong[mn.module_metric(mid, name)] = [(m.step, m.value) for m in history]
    assert not wrong, wrong


def _oracle(part, cfg) -> dict[str, float]:
    """One module's whole-batch (one bucket) component norms and losses, by hand, from what the probe got."""
    module = part.module_spec.build()
    module.load_state_dict({k: torch.tensor(v) for k, v in part.weights.items()})
    batch = {k: tree.map_structure(torch.as_tensor, v) for k, v in part.batch.items()}
    p = cfg.ppo
    loss = LossSettings(p.clip_param, p.vf_clip_param, p.vf_loss_coeff, p.entropy_coeff, p.kl_coeff, False)
    weighted, terms, _, mask = hand_written_losses(module, batch, loss)
    params = list(module.parameters())
    out = {}
    for component, value in weighted.items():
        raw = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
        grads = [torch.zeros_like(q) if g is None else g for q, g in zip(params, raw, strict=True)]
        out[mn.probe_metric(mn.PROBE_COMPONENT_NORM, "bucket_1", component=component)] = float(
            np.linalg.norm(flat(grads))
        )
    out[mn.probe_metric(mn.PROBE_LOSS, "bucket_1", loss="value")] = float(terms["value"].detach())
    out[mn.probe_metric(mn.PROBE_NUM_STEPS, "bucket_1")] = float(mask.sum())
    return out


def test_both_modules_probes_land_in_mlflow_equal_to_their_own_oracle(probed_run):
    cfg, outcome, _, _, requests = probed_run
    assert [r.iteration for r in requests] == PROBED
    client = MlflowClient(cfg.mlflow.tracking_uri)
    for request in requests:
        assert request.per_module_names and sorted(p.module_id for p in request.modules) == list(AGENTS)
        oracles = {part.module_id: _oracle(part, cfg) for part in request.modules}
        for mid, oracle in oracles.items():
            for name, want in oracle.items():
                logged = mn.module_metric(mid, name)
                history = {m.step: m.value for m in client.get_metric_history(outcome.run_id, logged)}
                assert request.iteration in history, (logged, sorted(history))
                assert history[request.iteration] == pytest.approx(want, rel=1e-4), (logged, request.iteration)
                assert math.isfinite(want) and want > 0, (logged, want)
        # The two modules' numbers differ by far more than the tolerance: one module's numbers
        # logged under both names would fail the other's oracle.
        gaps = [abs(a - oracles["agent_1"][k]) / abs(a) for k, a in oracles["agent_0"].items()]
        assert max(gaps) > 1e-2, (request.iteration, oracles)
