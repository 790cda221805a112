"""The probe per module in a real run: two modules, a real probe actor, a real MLflow sqlite store.

``run_training`` on the built-in two-agent env (modules ``agent_0``, ``agent_1``; one local learner,
sampling on the driver), probing every iteration for 2 iterations.  A spy on the learner's
``_probe_request`` keeps each request it hands to the actor (the weights and batch the probe got);
the test then recomputes each module's bucket numbers from them with the PPO loss written by hand
(``hand_written_losses``) and ``torch.autograd.grad``, and reads MLflow's
``module/<id>/grad_norm/bucket_1/...`` at the probed iteration's step.

Bugs this catches: the probe following one module (the other's names absent from MLflow), the actor
logging one module's numbers under both names (each module has its own oracle, and they differ),
names without the module (``grad_norm/...`` plain in a two-module run), a probe at the wrong step.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import tree
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.train.run import run_training
from gradmon_ray.config import config_from_dict
from gradmon_ray.probe.client import LossSettings
from gradmon_ray.rllib.learner import GradmonPPOTorchLearner
from tests.probe.designed_batch import flat, hand_written_losses

pytestmark = pytest.mark.e2e

AGENTS = ("agent_0", "agent_1")
COMPONENTS = ("task", "entropy", "value")  # use_kl_loss is off: no KL component


@pytest.fixture(scope="module")
def two_module_run(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe-modules")
    cfg = config_from_dict(
        {
            "iterations": 2,
            "seed": 9,
            "env": {"id": "gradmon/FactoredOpsMultiAgent-v0"},
            "ppo": {"train_batch_size": 128, "minibatch_size": 64, "num_epochs": 1},
            "model": {"trunk_hiddens": [16]},
            "resources": {"num_env_runners": 0, "num_learners": 0},  # the learner is in this process
            "probe": {"gradient_analysis_every": 1, "num_buckets": 1},
            "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "probe-modules"},
        }
    )
    requests = []
    real = GradmonPPOTorchLearner._probe_request

    def spy(learner, snapshot):
        request = real(learner, snapshot)
        requests.append(request)
        return request

    def reporter(iteration, metrics, algo, monitor, stop_reason) -> None:
        if iteration == 1:  # iteration 1's probe done before iteration 2's is due: none dropped

            def finish(learner):
                return learner._probe.finish(120.0)

            assert all(r.get() for r in algo.learner_group.foreach_learner(finish))

    patch = pytest.MonkeyPatch()
    patch.setattr(GradmonPPOTorchLearner, "_probe_request", spy)
    try:
        outcome = run_training(cfg, progress=None, reporter=reporter)
    finally:
        patch.undo()
    return cfg, outcome, requests


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


def test_both_modules_probes_land_in_mlflow_equal_to_their_own_oracle(two_module_run):
    cfg, outcome, requests = two_module_run
    assert outcome.iterations_done == 2 and outcome.mlflow_complete
    assert [r.iteration for r in requests] == [1, 2]
    client = MlflowClient(cfg.mlflow.tracking_uri)
    run = client.get_run(outcome.run_id)
    assert run.info.status == "FINISHED"
    assert not any(name.startswith("grad_norm/") for name in run.data.metrics), "no unprefixed probe metric"
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
    for component in COMPONENTS:  # every component of both modules at both probed steps
        for mid in AGENTS:
            name = mn.module_metric(mid, mn.probe_metric(mn.PROBE_COMPONENT_NORM, "bucket_1", component=component))
            assert sorted(m.step for m in client.get_metric_history(outcome.run_id, name)) == [1, 2], name
