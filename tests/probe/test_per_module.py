"""The probe per module, in-process: a two-module learner hands over one request with every monitored
module, and the probe's numbers for each module equal an oracle computed for THAT module.

The learner is the real ``GradmonPPOTorchLearner`` on the built-in two-agent env (modules ``agent_0``
and ``agent_1``, each its own ``FactoredActorCritic``), its client's ``submit`` recording the request
(no actor is needed for the hand-off); the request then goes through a real ``GradientProbe`` (as a
plain object).  The oracle buckets each module's designed batch by hand (``expected_buckets``),
writes the PPO loss with ``torch.distributions`` (``hand_written_losses``) on a fresh module built
with the weights read off the learner before the update, with the coefficients of the run config,
and takes ``torch.autograd.grad``: none of the probe's own code.

Bugs these catch: the probe following only the first module (``agent_1``'s names missing), every
module analysed with one module's weights or batch (the values would match the other module's
oracle), module ids missing from the names (``module/<id>/`` prefix), a module absent from the
iteration's batch sent anyway, a module the actor cannot build taking the others' metrics down, a
request the learner cannot build raising into the update (the fixture's fourth update), the module
list fixed at build (a module added with RLlib's ``add_module`` never probed, a removed one still sent).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import tree
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

from gradmon_ray import metric_names as mn
from gradmon_ray import metric_parsing as mp
from gradmon_ray.config import config_from_dict
from gradmon_ray.probe.actor import GradientProbe
from gradmon_ray.probe.client import LossSettings
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update
from tests.probe.designed_batch import designed_columns, expected_buckets, flat, hand_written_losses

AGENTS = ("agent_0", "agent_1")
PPO = {
    "train_batch_size": 128,
    "minibatch_size": 128,
    "num_epochs": 1,
    "entropy_coeff": 0.05,
    "use_kl_loss": True,
    "kl_coeff": 0.3,
    "clip_param": 0.25,
}


def _cfg():
    return config_from_dict(
        {
            "seed": 6,
            "env": {"id": "gradmon/FactoredOpsMultiAgent-v0"},
            "ppo": PPO,
            "model": {"trunk_hiddens": [16]},
            "probe": {"gradient_analysis_every": 1, "num_buckets": 2},
        }
    )


def _designed(policy_batch) -> SampleBatch:
    """The module's real rows cut to 60, with the designed episode/group/reward/mask columns."""
    host = {
        k: tree.map_structure(lambda t: np.asarray(t)[:60], v) for k, v in policy_batch.items() if k != "weights_seq_no"
    }
    host.update(designed_columns())
    return SampleBatch(host)


@pytest.fixture(scope="module")
def probed():
    """(the request the learner handed over at iteration 2, each module's pre-update weights and
    batch, each module's KL coefficient then, the probe's metrics and outcome)."""
    cfg = _cfg()
    learner = build_local_learner(cfg)
    sent = []
    learner._probe.submit = sent.append  # a recording client: the hand-off is the subject here
    try:
        first = train_batch(learner, sample_episodes(cfg, learner, 128))
        update(learner, first, cfg)  # the weights move off the sampling policy: KL has a gradient
        designed = {mid: _designed(first.policy_batches[mid]) for mid in AGENTS}
        weights = {mid: copy.deepcopy(learner.module[mid].unwrapped().state_dict()) for mid in AGENTS}
        kl_coeffs = {mid: float(learner.curr_kl_coeffs_per_module[mid]) for mid in AGENTS}
        update(learner, MultiAgentBatch(designed, env_steps=60), cfg)
        request = sent[-1]
        update(learner, MultiAgentBatch({"agent_1": designed["agent_1"]}, env_steps=60), cfg)
        sparse = sent[-1]  # iteration 3: agent_0 has no rows

        def broken(module_id, part):
            raise RuntimeError(f"cannot describe {module_id}")

        learner._module_probe = broken  # a request that cannot be built: counted, the update goes on
        before = len(sent)
        update(learner, MultiAgentBatch(designed, env_steps=60), cfg)
        assert len(sent) == before and learner._probe.counters[mn.PROBE_FAILURES] == 1
        assert learner.gradmon_iteration == 4
        probe = GradientProbe(num_buckets=2, device="cpu")
        outcome = probe.analyse(request)
        modules = {mid: copy.deepcopy(learner.module[mid].unwrapped()) for mid in AGENTS}
    finally:
        learner.shutdown()
    return request, modules, weights, designed, kl_coeffs, probe.last_metrics, outcome, sparse


def test_one_request_carries_every_monitored_module_with_its_own_weights(probed):
    request, _, weights, designed, _, _, outcome, _ = probed
    assert request.iteration == 2 and request.per_module_names
    assert sorted(p.module_id for p in request.modules) == list(AGENTS)
    for part in request.modules:
        for key, value in weights[part.module_id].items():  # this module's pre-update weights, no other's
            np.testing.assert_array_equal(part.weights[key], value.numpy(), err_msg=f"{part.module_id}: {key}")
        np.testing.assert_array_equal(part.batch["obs"], designed[part.module_id]["obs"])
    assert outcome.status == "ok" and outcome.modules == dict.fromkeys(AGENTS, "ok"), outcome


def _oracle(module, state, batch, kl_coeff):
    """Per bucket: the norms, shares, losses and head norms of each PPO component, by hand."""
    loss = LossSettings(
        clip_param=PPO["clip_param"],
        vf_clip_param=10.0,  # the config's default
        vf_loss_coeff=0.5,
        entropy_coeff=PPO["entropy_coeff"],
        kl_coeff=kl_coeff,
        use_kl_loss=True,
    )
    out = {}
    for bucket, want in expected_buckets(batch).items():
        fresh = copy.deepcopy(module)
        fresh.load_state_dict(state)
        rows = {k: tree.map_structure(lambda a, r=want["rows"]: torch.as_tensor(a[r]), v) for k, v in batch.items()}
        weighted, terms, _, _ = hand_written_losses(fresh, rows, loss)
        params = list(fresh.parameters())
        grads = {
            c: [torch.zeros_like(p) if g is None else g for p, g in zip(params, raw, strict=True)]
            for c, raw in (
                (c, torch.autograd.grad(v, params, retain_graph=True, allow_unused=True)) for c, v in weighted.items()
            )
        }
        flats = {c: flat(g) for c, g in grads.items()}
        total = sum(flats.values())
        op = {id(p) for p in fresh.heads["op"].parameters()}
        out[bucket] = {
            "norms": {c: float(np.linalg.norm(g)) for c, g in flats.items()},
            "shares": {c: float(g @ total / (total @ total)) for c, g in flats.items()},
            "op_task": math.sqrt(
                sum(float(g.double().pow(2).sum()) for p, g in zip(params, grads["task"], strict=True) if id(p) in op)
            ),
            "losses": {k: float(v.detach()) for k, v in terms.items()},
            "steps": want["steps"],
        }
    return out


def test_each_modules_probe_equals_its_own_oracle_under_its_own_name(probed):
    _, modules, weights, designed, kl_coeffs, metrics, _, _ = probed
    seen = {}
    for mid in AGENTS:
        oracle = _oracle(modules[mid], weights[mid], designed[mid], kl_coeffs[mid])
        for bucket, want in oracle.items():

            def got(template, bucket=bucket, mid=mid, **parts):
                return metrics[mn.module_metric(mid, mn.probe_metric(template, bucket, **parts))]

            assert got(mn.PROBE_NUM_STEPS) == want["steps"], (mid, bucket)
            for component, norm in want["norms"].items():
                assert got(mn.PROBE_COMPONENT_NORM, component=component) == pytest.approx(norm, rel=1e-4), (
                    mid,
                    bucket,
                    component,
                )
                share = got(mn.PROBE_SHARE, component=component)
                assert share == pytest.approx(want["shares"][component], rel=1e-4, abs=1e-7), (mid, component)
            for name, value in want["losses"].items():
                assert got(mn.PROBE_LOSS, loss=name) == pytest.approx(value, rel=1e-4, abs=1e-7), (mid, name)
            head = got(mn.PROBE_HEAD_NORM, head="op", component="task")
            assert head == pytest.approx(want["op_task"], rel=1e-4), (mid, bucket)
            assert want["norms"]["kl"] > 0  # a real KL gradient, not two zeros agreeing
        seen[mid] = oracle["bucket_1"]["norms"]["task"]
    assert seen["agent_0"] != pytest.approx(seen["agent_1"], rel=1e-3)  # different modules, different numbers


def test_every_probe_name_carries_its_module_and_parses_back(probed):
    _, _, _, _, _, metrics, _, _ = probed
    plain = [name for name in metrics if not name.startswith("module/")]
    assert plain == [mn.PROBE_DURATION_S], "only the request's duration is not per module"
    for name in metrics:
        parsed = mp.parse(name)
        assert parsed is not None, name
        if name != mn.PROBE_DURATION_S:
            assert parsed.parts["module"] in AGENTS and name.startswith(f"module/{parsed.parts['module']}/"), name
    for mid in AGENTS:
        parsed = mp.parse(
            mn.module_metric(mid, mn.probe_metric(mn.PROBE_HEAD_NORM, "bucket_2", head="op", component="kl"))
        )
        assert parsed.template == mn.PROBE_HEAD_NORM
        assert parsed.parts == {"module": mid, "bucket": "bucket_2", "head": f"{mid}/op", "component": "kl"}
    assert sorted(mp.modules_of(metrics)) == list(AGENTS)
    assert mp.probe_buckets(metrics) == ["bucket_1", "bucket_2"]


def test_a_module_without_rows_in_the_iteration_is_left_out_and_names_stay_per_module(probed):
    *_, sparse = probed
    assert sparse.iteration == 3 and [p.module_id for p in sparse.modules] == ["agent_1"]
    assert sparse.per_module_names  # the run monitors two modules: its names do not switch to plain


def test_a_module_the_probe_cannot_build_is_an_error_and_the_others_are_still_logged(probed):
    request, _, _, _, _, metrics, _, _ = probed
    broken = copy.deepcopy(request)
    part = next(p for p in broken.modules if p.module_id == "agent_1")
    part.weights.pop(next(iter(part.weights)))  # a state dict the module refuses to load
    probe = GradientProbe(num_buckets=2, device="cpu")
    outcome = probe.analyse(broken)
    assert outcome.status == "error" and outcome.modules == {"agent_0": "ok", "agent_1": "error"}, outcome
    assert outcome.message.startswith("module 'agent_1': RuntimeError") and "agent_0" not in outcome.message
    logged = probe.last_metrics
    assert mp.modules_of(logged) == ["agent_0"]
    for name, value in logged.items():
        if name != mn.PROBE_DURATION_S:
            assert value == pytest.approx(metrics[name], rel=1e-9, nan_ok=True), name


def test_a_module_added_mid_run_is_probed_from_its_next_iteration_and_a_removed_one_no_more():
    """RLlib's own ``Learner.add_module`` / ``remove_module`` (the self-play pattern): the probe
    follows the learner's monitored modules at each probed iteration, with the new module's own weights."""
    cfg = _cfg()
    learner = build_local_learner(cfg)
    sent = []
    learner._probe.submit = sent.append
    try:
        first = train_batch(learner, sample_episodes(cfg, learner, 128))
        update(learner, first, cfg)
        template = learner.module["agent_0"].unwrapped()
        spec = RLModuleSpec(
            module_class=type(template),
            observation_space=template.observation_space,
            action_space=template.action_space,
            model_config=template.model_config,
        )
        learner.add_module(module_id="snapshot", module_spec=spec)
        designed = {mid: _designed(first.policy_batches[mid]) for mid in AGENTS}
        designed["snapshot"] = designed["agent_0"]  # the snapshot plays agent_0's seat
        weights = copy.deepcopy(learner.module["snapshot"].unwrapped().state_dict())
        update(learner, MultiAgentBatch(designed, env_steps=60), cfg)
        added = sent[-1]
        learner.remove_module("agent_0")
        del designed["agent_0"]
        update(learner, MultiAgentBatch(designed, env_steps=60), cfg)
        removed = sent[-1]
    finally:
        learner.shutdown()
    assert added.iteration == 2 and sorted(p.module_id for p in added.modules) == ["agent_0", "agent_1", "snapshot"]
    (part,) = [p for p in added.modules if p.module_id == "snapshot"]
    for key, value in weights.items():
        np.testing.assert_array_equal(part.weights[key], value.numpy(), err_msg=key)
    assert removed.iteration == 3 and sorted(p.module_id for p in removed.modules) == ["agent_1", "snapshot"]
    outcome = GradientProbe(num_buckets=2, device="cpu").analyse(added)
    assert outcome.status == "ok" and outcome.modules == dict.fromkeys(["agent_0", "agent_1", "snapshot"], "ok")
