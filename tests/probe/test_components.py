"""The probe's per-component gradient analysis: non-destructive, independently checked."""

from __future__ import annotations

import copy
import hashlib
import itertools
import math

import numpy as np
import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing
from torch.distributions import Categorical

from gradmon_ray.config import config_from_dict
from gradmon_ray.losses.regularizers import BUILTIN_REGULARIZERS, RegularizerSpec, resolve_regularizer
from gradmon_ray.probe.components import component_gradients
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update

COEFFS = {
    "clip_param": 0.2,
    "vf_clip_param": 10.0,
    "vf_loss_coeff": 0.5,
    "entropy_coeff": 0.05,
    "kl_coeff": 0.3,
    "use_kl_loss": True,
}


@pytest.fixture(scope="module")
def setup():
    cfg = config_from_dict(
        {
            "seed": 2,
            "ppo": {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 1},
            "model": {"trunk_hiddens": [16]},
        }
    )
    learner = build_local_learner(cfg)
    batch = train_batch(learner, sample_episodes(cfg, learner, 256))
    update(learner, batch, cfg)  # the optimizer has state; p.grad is populated
    tensors = dict(learner._convert_batch_type(batch).policy_batches[DEFAULT_MODULE_ID])
    return learner, tensors


def _fingerprint(learner) -> str:
    digest = hashlib.sha256()
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    for p in module.parameters():
        digest.update(p.detach().numpy().tobytes())
        digest.update(b"none" if p.grad is None else p.grad.numpy().tobytes())
    for opt in learner._optimizer_parameters:
        for state in opt.state_dict()["state"].values():
            for value in state.values():
                digest.update(torch.as_tensor(value).numpy().tobytes())
    return digest.hexdigest()


def test_probe_is_non_destructive(setup):
    learner, batch = setup
    before = _fingerprint(learner)
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    specs = [RegularizerSpec(n, f) for n, f in BUILTIN_REGULARIZERS.items()]
    for _ in range(3):
        component_gradients(module, batch, regularizers=specs, **COEFFS)
    assert _fingerprint(learner) == before


def _independent(module, batch):
    """The PPO component losses written out with torch.distributions, head by head."""
    out = module.forward_train(batch)
    logits = out[Columns.ACTION_DIST_INPUTS]
    old_logits = batch[Columns.ACTION_DIST_INPUTS]
    sizes = module.head_layout.sizes
    names = module.head_layout.names
    heads = torch.split(logits, list(sizes), dim=-1)
    old_heads = torch.split(old_logits, list(sizes), dim=-1)
    actions = batch[Columns.ACTIONS]
    logp = sum(Categorical(logits=h).log_prob(actions[n]) for h, n in zip(heads, names, strict=True))
    entropy = sum(Categorical(logits=h).entropy() for h in heads)
    kl = sum(
        torch.distributions.kl_divergence(Categorical(logits=o), Categorical(logits=h))
        for o, h in zip(old_heads, heads, strict=True)
    )
    mask = batch[Columns.LOSS_MASK].float()

    def mmean(x):
        return (x * mask).sum() / mask.sum()

    ratio = torch.exp(logp - batch[Columns.ACTION_LOGP])
    adv = batch[Postprocessing.ADVANTAGES]
    surrogate = torch.min(adv * ratio, adv * ratio.clamp(0.8, 1.2))
    values = module.value_head(out[Columns.EMBEDDINGS]).squeeze(-1)
    vf = (values - batch[Postprocessing.VALUE_TARGETS]).pow(2).clamp(0, 10.0)
    return {
        "task": -mmean(surrogate),
        "entropy": -0.05 * mmean(entropy),
        "kl": 0.3 * mmean(kl),
        "value": 0.5 * mmean(vf),
    }


def test_component_norms_match_independent_autograd_on_a_fresh_copy(setup):
    learner, batch = setup
    fresh = copy.deepcopy(learner.module[DEFAULT_MODULE_ID].unwrapped())
    report = component_gradients(fresh, batch, **COEFFS)
    params = [p for p in fresh.parameters() if p.requires_grad]
    losses = _independent(fresh, batch)
    for name, loss in losses.items():
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        expected = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
        assert report.norms[name] == pytest.approx(expected, rel=1e-4), name
    total = sum(losses.values())
    grads = torch.autograd.grad(total, params, allow_unused=True)
    # the components add up to the total loss: shares sum to 1 over the same gradient
    assert sum(report.shares.values()) == pytest.approx(1.0, abs=1e-6)
    assert report.losses["total"] == pytest.approx(float(total), rel=1e-5)
    assert set(report.per_head["task"]) == {*fresh.head_layout.names, "value"}
    assert report.per_head["value"]["op"] == 0.0 and report.per_head["task"]["value"] == 0.0
    assert report.per_head["task"]["op"] > 0.0
    assert set(report.cosines) >= {"task_vs_entropy", "task_vs_value"}
    assert all(g is not None for g in grads[:1])


def test_broken_regularizers_are_flagged_and_the_rest_still_reported(setup):
    learner, batch = setup
    module = copy.deepcopy(learner.module[DEFAULT_MODULE_ID].unwrapped())

    def explodes(m, b, f):
        raise RuntimeError("boom")

    def constant(m, b, f):
        return torch.tensor(3.0)

    specs = [
        resolve_regularizer("logit_l2", weight=0.5),
        RegularizerSpec("explodes", explodes),
        RegularizerSpec("constant", constant),
        resolve_regularizer("user_l1", "tests.fixtures.user_envs:head_bias_l1"),
        RegularizerSpec("off", explodes, enabled=False),
    ]
    with pytest.warns(UserWarning, match="regularizer 'explodes' gradient failed: RuntimeError: boom"):
        report = component_gradients(module, batch, regularizers=specs, **COEFFS)
    regs = report.regularizers
    assert regs["explodes_grad_norm_error"] == 1.0 and regs["constant_grad_norm_error"] == 1.0
    assert regs["logit_l2_grad_norm_error"] == 0.0 and regs["logit_l2_grad_norm"] > 0
    assert regs["user_l1_grad_norm"] > 0 and "off_grad_norm" not in regs
    assert regs["logit_l2_share"] + regs["user_l1_share"] == pytest.approx(1.0)
    assert regs["total_grad_norm"] > 0
    assert all(math.isfinite(v) for v in report.norms.values())


def test_resolve_regularizer_errors():
    with pytest.raises(ValueError, match="unknown function 'nope'; use one of"):
        resolve_regularizer("nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_regularizer("x", "no.such:fn")
    assert resolve_regularizer("weight_l2").fn is BUILTIN_REGULARIZERS["weight_l2"]


def test_cosines_shares_and_head_norms_equal_numpy_on_independent_gradients(setup):
    """Signed cosines and shares recomputed in numpy from hand-written losses; per-head norms
    over parameters fetched by module attribute name (not ``head_parameter_groups``)."""
    learner, batch = setup
    fresh = copy.deepcopy(learner.module[DEFAULT_MODULE_ID].unwrapped())
    report = component_gradients(fresh, batch, **COEFFS)
    params = [p for p in fresh.parameters() if p.requires_grad]
    owners = {name: {id(p) for p in head.parameters()} for name, head in fresh.heads.items()}
    owners["value"] = {id(p) for p in fresh.value_head.parameters()}
    flats, per_head = {}, {}
    for name, loss in _independent(fresh, batch).items():
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
        flats[name] = np.concatenate([g.detach().double().numpy().ravel() for g in grads])
        per_head[name] = {
            head: math.sqrt(
                sum(float(g.double().pow(2).sum()) for p, g in zip(params, grads, strict=True) if id(p) in ids)
            )
            for head, ids in owners.items()
        }
    total = sum(flats.values())
    for name, g in flats.items():
        assert report.shares[name] == pytest.approx(float(g @ total / (total @ total)), rel=1e-4, abs=1e-7), name
        for head, value in per_head[name].items():
            assert report.per_head[name][head] == pytest.approx(value, rel=1e-4, abs=1e-9), (name, head)
    negative = 0
    for a, b in itertools.combinations(flats, 2):
        expected = float(flats[a] @ flats[b] / (np.linalg.norm(flats[a]) * np.linalg.norm(flats[b])))
        assert report.cosines[f"{a}_vs_{b}"] == pytest.approx(expected, rel=1e-4, abs=1e-7), (a, b)
        negative += expected < -1e-3
    assert negative >= 1  # the batch has an opposing pair, so a lost sign would show
