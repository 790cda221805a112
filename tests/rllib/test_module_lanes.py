"""Each module's policy-health lanes (entropy, entropy_norm, KL, collapse latch) through the packed
reduction, against an oracle per module, and a collapse-latch stop that names its module.

A real ``GradmonPPOTorchLearner`` on the built-in three-agent env (modules ``agent_0..2``, in-process,
no Ray).  After sampling, each module's head output biases get a different push (a mild one, a
strong one, a collapsing one), so the three modules' logits, entropies and KL(sampling || current)
differ.  One update on the whole batch as ONE minibatch (the lanes measure the step's last
minibatch); the oracle recomputes, per module, with numpy in float64 from that module's own logits
(its forward pass on the batch with the pushed weights) and the batch's sampling logits: per head the
masked mean of ``-sum p log p``, that over ``log(number of actions)``, the masked mean of
``sum p_old (log p_old - log p)``, and the collapse latch as ``entropy_norm < threshold`` (one
iteration needed).  None of ``telemetry.head_entropy`` or ``rllib.head_health`` is called.

Bugs these catch: every module given one module's lanes (the last module's, the first's), lanes
of one module sliced with another's head sizes, the KL direction swapped, entropy_norm by the wrong
size, a collapse latch judged on another module's entropy; and a latch stop whose message drops
the module (``head 'op'`` instead of ``head 'op' of module 'agent_2'``).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from ray.rllib.core import ALL_MODULES
from ray.rllib.core.columns import Columns

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch
from gradmon_ray.telemetry.blame import RESULT_KEY
from gradmon_ray.telemetry.health_stop import HealthStopMonitor, HealthStopRules
from gradmon_ray.tracking.result_metrics import result_to_metrics

AGENTS = ("agent_0", "agent_1", "agent_2")
PUSH = {"agent_0": 0.7, "agent_1": 2.0, "agent_2": 12.0}
"""Added to one action's bias in every head of the module: mild, strong, collapsing."""
THRESHOLD = 0.3


def _push(module, amount: float) -> None:
    """Add ``amount`` to the bias of action 0 in every action head (the last layer of each head)."""
    with torch.no_grad():
        for head in module.heads.values():
            head[-1].bias[0] += amount


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _oracle(module, batch) -> dict[str, dict[str, float]]:
    """Per head of ``module``: entropy, entropy_norm, kl, collapse latch, by numpy (see the docstring)."""
    with torch.no_grad():
        logits = module.forward_train(batch)[Columns.ACTION_DIST_INPUTS].double().numpy()
    sampling = batch[Columns.ACTION_DIST_INPUTS].double().numpy()
    mask = batch[Columns.LOSS_MASK].numpy().astype(bool)
    out, start = {}, 0
    for name, head in module.heads.items():  # the order the module concatenates its logits in
        n = head[-1].out_features
        logp = _log_softmax(logits[:, start : start + n])
        old = _log_softmax(sampling[:, start : start + n])
        start += n
        entropy = float((-(np.exp(logp) * logp).sum(-1))[mask].mean())
        kl = float((np.exp(old) * (old - logp)).sum(-1)[mask].mean())
        norm = entropy / math.log(n)
        out[name] = {"entropy": entropy, "entropy_norm": norm, "kl": kl, "collapse": float(norm < THRESHOLD)}
    assert start == logits.shape[-1]
    return out


@pytest.fixture(scope="module")
def one_update():
    """(the learner's per-module results as floats, the oracle per module)."""
    cfg = config_from_dict(
        {
            "seed": 11,
            "env": {"id": "gradmon/FactoredOpsMultiAgent-v0", "config": {"num_agents": 3}},
            "ppo": {"train_batch_size": 192, "minibatch_size": 64, "num_epochs": 1},
            "model": {"trunk_hiddens": [16]},
            "telemetry": {"bands": {"collapse": {"threshold": THRESHOLD, "iterations": 1}}},
        }
    )
    learner = build_local_learner(cfg)
    try:
        batch = train_batch(learner, sample_episodes(cfg, learner, 192))
        for mid in AGENTS:
            _push(learner.module[mid].unwrapped(), PUSH[mid])
        tensors = learner._convert_batch_type(batch).policy_batches
        oracle = {mid: _oracle(learner.module[mid].unwrapped(), dict(tensors[mid])) for mid in AGENTS}
        # minibatch_size None: the whole batch is the one (and last) minibatch the lanes measure
        results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    finally:
        learner.shutdown()
    numbers = {
        mid: {k: v for k, v in res.items() if hasattr(v, "peek") and k != RESULT_KEY} for mid, res in results.items()
    }
    logged = {mid: {k: float(v.peek()) for k, v in res.items()} for mid, res in numbers.items()}
    return logged, oracle


def test_each_modules_entropy_kl_and_collapse_lanes_equal_its_own_oracle(one_update):
    logged, oracle = one_update
    for mid in AGENTS:
        for head, want in oracle[mid].items():
            for template, key in (
                (mn.HEAD_ENTROPY, "entropy"),
                (mn.HEAD_ENTROPY_NORM, "entropy_norm"),
                (mn.HEAD_KL, "kl"),
                (mn.HEAD_COLLAPSE_LATCH, "collapse"),
            ):
                got = logged[mid][mn.head_metric(template, head)]
                assert got == pytest.approx(want[key], rel=1e-5, abs=1e-7), (mid, head, key)
            if want["collapse"]:
                assert logged[mid][mn.head_metric(mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION, head)] == 1.0, (mid, head)


def test_the_oracle_tells_the_modules_apart(one_update):
    """The values above differ between modules by far more than the tolerance, so a module given
    another module's lanes fails: every head's entropy and KL differ, and only agent_2 collapsed."""
    _, oracle = one_update
    for head in oracle["agent_0"]:
        for key in ("entropy", "kl"):
            values = sorted(oracle[mid][head][key] for mid in AGENTS)
            assert all(b - a > 1e-3 * b for a, b in itertools.pairwise(values)), (head, key, values)
    assert {mid: {h: v["collapse"] for h, v in oracle[mid].items()} for mid in AGENTS} == {
        mid: dict.fromkeys(oracle[mid], float(mid == "agent_2")) for mid in AGENTS
    }


def test_a_collapse_latch_in_one_module_stops_the_run_and_names_that_module(one_update):
    """The learner's results, named as the training loop names them (``result_to_metrics``), fed to
    the health stop: the collapse latch of agent_2 stops the run, and the message says which module."""
    logged, oracle = one_update
    result = {"learners": {ALL_MODULES: {"num_env_steps_trained": 192.0}, **logged}}
    metrics = result_to_metrics(result)
    decision = HealthStopMonitor(HealthStopRules(collapse=True)).update(1, metrics)
    assert decision is not None and decision.rule == "collapse", decision
    module, head = decision.head.split("/")
    assert module == "agent_2" and head in oracle["agent_2"], decision
    assert decision.message == f"head '{head}' of module 'agent_2': policy entropy collapsed (latched)"
