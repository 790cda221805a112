"""Every gradient number the learner reports, recomputed along a second, independent path.

The product measures per-head norms through ``head_parameter_groups()`` and its own
``GradientNormPlan``; these tests never use either. Parameters are fetched by module
attribute name (``module.heads[name]``, ``module.value_head``), logits are sliced with a
layout computed from the env's action space (not the module's), losses are RLlib's own or
written by hand, and clipping is RLlib's own ``clip_gradients``.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.torch_utils import clip_gradients

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.learner import GradmonPPOTorchLearner
from gradmon_ray.rllib.local_learner import build_local_learner, env_spaces, sample_episodes, train_batch

MID = DEFAULT_MODULE_ID


def _cfg(**ppo):
    base = {"train_batch_size": 256, "minibatch_size": 256, "num_epochs": 1, "grad_clip": None}
    base.update(ppo)
    return config_from_dict({"seed": 3, "ppo": base, "model": {"trunk_hiddens": [32, 32]}})


@pytest.fixture(scope="module")
def episodes_cfg():
    cfg = _cfg()
    learner = build_local_learner(cfg)
    return cfg, sample_episodes(cfg, learner, 256)


def _module(learner):
    return learner.module[MID].unwrapped()


def _action_slices(cfg) -> dict[str, slice]:
    """Logit columns per action head, from the env's Dict action space (sorted keys, as dm-tree flattens)."""
    _, action_space = env_spaces(cfg)
    assert isinstance(action_space, gym.spaces.Dict)
    out, start = {}, 0
    for name in sorted(action_space.spaces):
        n = int(action_space[name].n)
        out[name] = slice(start, start + n)
        start += n
    return out


def _norm_by_attribute(loss: torch.Tensor, module: torch.nn.Module) -> dict[str, float]:
    """L2 norm of d loss / d params for each head, params fetched by attribute name, in float64."""
    owners = {name: list(head.parameters()) for name, head in module.heads.items()}
    owners["value"] = list(module.value_head.parameters())
    flat = [p for ps in owners.values() for p in ps]
    grads = torch.autograd.grad(loss, flat, retain_graph=True, allow_unused=True)
    out, i = {}, 0
    for name, ps in owners.items():
        chunk = [g for g in grads[i : i + len(ps)] if g is not None]
        out[name] = math.sqrt(sum(float(g.double().pow(2).sum()) for g in chunk))
        i += len(ps)
    return out


def _learner_with_loss(cfg, loss_fn):
    """Gradmon's learner whose training loss is ``loss_fn(module, batch, fwd_out)``; everything else is real."""

    class HandBuiltLoss(GradmonPPOTorchLearner):
        @override(GradmonPPOTorchLearner)
        def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
            super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)
            return loss_fn(self.module[module_id].unwrapped(), batch, fwd_out)

    return build_local_learner(cfg, learner_class=HandBuiltLoss)


def _logged_head_norms(results, heads) -> dict[str, float]:
    logged = results[MID]
    return {h: float(logged[f"grad/head/{h}/norm"]) for h in heads}


def test_a_loss_on_one_heads_logits_moves_only_that_heads_norm(episodes_cfg):
    """By construction: a loss of head h's logits gives h a non-zero norm and every other head exactly 0."""
    cfg, episodes = episodes_cfg
    slices = _action_slices(cfg)
    targets = [*slices, "value"]
    for target in targets:

        def loss_fn(module, batch, fwd_out, target=target):
            logits = fwd_out[Columns.ACTION_DIST_INPUTS]
            values = module.compute_values(batch, embeddings=fwd_out[Columns.EMBEDDINGS])
            # 0 x everything: every parameter gets an exactly-zero gradient, never None.
            zero = 0.0 * (logits.sum() + values.sum())
            if target == "value":
                return values.pow(2).mean() + zero
            return torch.logsumexp(2.0 * logits[:, slices[target]], dim=-1).mean() + zero

        learner = _learner_with_loss(cfg, loss_fn)
        batch = train_batch(learner, episodes)
        before = copy.deepcopy(_module(learner))
        tensors = dict(learner._convert_batch_type(batch).policy_batches[MID])
        expected = _norm_by_attribute(loss_fn(before, tensors, before.forward_train(tensors)), before)
        results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        reported = _logged_head_norms(results, targets)
        assert reported[target] > 1e-3, (target, reported)
        assert reported[target] == pytest.approx(expected[target], rel=1e-4), target
        for other in targets:
            if other != target:
                assert reported[other] == 0.0, (target, other, reported)
        # The global norm covers the trunk as well: at least the target head's norm.
        assert float(results[MID]["grad/global_norm"]) >= reported[target] * (1 - 1e-6)


def test_ppo_minibatch_norms_equal_autograd_of_rllibs_own_loss_by_attribute_name(episodes_cfg):
    """A real minibatch: reported norms == autograd.grad of stock RLlib PPO's loss w.r.t. module.heads[h]."""
    cfg, episodes = episodes_cfg
    learner = build_local_learner(cfg)
    batch = train_batch(learner, episodes)
    stock = build_local_learner(cfg, learner_class=PPOTorchLearner)
    stock.module[MID].set_state(learner.module[MID].get_state())  # the pre-update weights
    tensors = dict(stock._convert_batch_type(batch).policy_batches[MID])
    module = _module(stock)
    loss = stock.compute_loss_for_module(
        module_id=MID,
        config=stock.config.get_config_for_module(MID),
        batch=tensors,
        fwd_out=module.forward_train(tensors),
    )
    expected = _norm_by_attribute(loss, module)
    all_grads = torch.autograd.grad(loss, list(module.parameters()), allow_unused=True)
    expected_global = math.sqrt(sum(float(g.double().pow(2).sum()) for g in all_grads if g is not None))

    results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    reported = _logged_head_norms(results, expected)
    assert len({round(v, 6) for v in expected.values()}) == len(expected)  # distinct: a swap would show
    for head, value in expected.items():
        assert reported[head] == pytest.approx(value, rel=1e-4), head
    assert float(results[MID]["grad/global_norm"]) == pytest.approx(expected_global, rel=1e-4)


# --- clipping: the learner's postprocessed gradients == RLlib's clip_gradients ------------------


def _vgs_cfg(vgs: str | None):
    """``vgs``: None (off), ``"gradient"`` or ``"update"`` (where the factor acts)."""
    cfg = _cfg()
    if vgs:
        cfg.vgs.enabled = True
        cfg.vgs.warmup_steps = 0
        cfg.vgs.alpha = 5.0
        cfg.vgs.apply_to = vgs
    return cfg


def _set_grads(module, grads: list[torch.Tensor]) -> dict:
    for p, g in zip(module.parameters(), grads, strict=True):
        p.grad = g.clone()
    return {p: p.grad for p in module.parameters()}


def _random_grads(module, seed: int, norm: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    raw = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in module.parameters()]
    total = math.sqrt(sum(float(g.pow(2).sum()) for g in raw))
    return [(g * (norm / total)).float() for g in raw]


class _Twins:
    """Two identically built learners fed identical gradients: ``probe`` (no clipping) reveals the
    VGS factor a gradient will get, so that ``learner``'s clip norm can be placed around it."""

    def __init__(self, vgs: str | None) -> None:
        cfg = _vgs_cfg(vgs)
        self.learner = build_local_learner(cfg)
        self.probe = build_local_learner(cfg)
        self.probe.module[MID].set_state(self.learner.module[MID].get_state())
        self.vgs = vgs
        for seed in range(6):  # varying gradients: the VGS sees temporal variance
            g = _random_grads(_module(self.learner), seed, norm=0.3 + 0.4 * seed)
            self.postprocess(self.learner, g, None, "global_norm")
            self.postprocess(self.probe, g, None, "global_norm")

    @staticmethod
    def postprocess(learner, grads, grad_clip, grad_clip_by) -> dict:
        module = _module(learner)
        grads_dict = _set_grads(module, grads)
        # The learner (and RLlib's postprocess_gradients_for_module it defers to) reads only these fields.
        config = SimpleNamespace(grad_clip=grad_clip, grad_clip_by=grad_clip_by, log_gradients=False)
        out = learner.postprocess_gradients_for_module(module_id=MID, config=config, module_gradients_dict=grads_dict)
        return {p: out[p] for p in module.parameters()}

    def factor_for(self, grads) -> float:
        before = [p.detach().clone() for p in grads]
        out = self.postprocess(self.probe, grads, None, "global_norm")
        if not self.vgs:
            return 1.0
        if self.vgs == "update":  # the gradients stay as they are; the factor waits for the step
            assert all(torch.equal(o, b) for o, b in zip(out.values(), before, strict=True))
            return self.probe.vgs.get_scaling_factor()
        ratios = [float((o.double() / b.double()).flatten()[0]) for o, b in zip(out.values(), before, strict=True)]
        return ratios[0]


@pytest.fixture(scope="module", params=[None, "gradient", "update"], ids=["no-vgs", "vgs-gradient", "vgs-update"])
def twins(request):
    return _Twins(request.param)


# Where the clip value sits relative to the post-VGS global norm n_post (and the raw norm n_raw).
_PLACEMENTS = ["below", "at", "between", "above"]  # "between" the raw and post-VGS norms: "at" without VGS


@pytest.mark.parametrize("grad_clip_by", ["global_norm", "norm", "value"])
@pytest.mark.parametrize("placement", _PLACEMENTS)
def test_clipped_gradients_equal_rllibs_clip_gradients(twins, grad_clip_by, placement):
    module = _module(twins.learner)
    grads = _random_grads(module, seed=100 + _PLACEMENTS.index(placement), norm=1.0)
    factor = twins.factor_for(grads)
    if twins.vgs:
        assert factor < 0.9, factor  # the VGS acts here, so its order with clipping matters
    if twins.vgs == "update":
        factor = 1.0  # update mode: clipping sees the raw gradient (the factor scales the step)
    n_post = factor * 1.0
    if grad_clip_by == "global_norm":
        clip = {"below": 2.0 * n_post, "at": n_post, "between": 0.5 * (n_post + 1.0), "above": 0.5 * n_post}[placement]
    elif grad_clip_by == "norm":  # per tensor: between the smallest and largest tensor norms
        tensor_norms = sorted(float(g.norm()) * factor for g in grads)
        clip = {
            "below": 2.0 * tensor_norms[-1],
            "at": tensor_norms[len(tensor_norms) // 2],
            "between": 0.5 * (tensor_norms[0] + tensor_norms[-1]),
            "above": 0.5 * tensor_norms[0],
        }[placement]
    else:
        biggest = max(float(g.abs().max()) for g in grads) * factor
        clip = {"below": 2.0 * biggest, "at": biggest, "between": 0.5 * biggest, "above": 0.05 * biggest}[placement]

    expected = {i: (g.double() * factor).float() for i, g in enumerate(grads)}
    clip_gradients(expected, grad_clip=clip, grad_clip_by=grad_clip_by)  # RLlib's own
    out = twins.postprocess(twins.learner, grads, clip, grad_clip_by)
    for i, got in enumerate(out.values()):
        torch.testing.assert_close(got, expected[i], rtol=2e-5, atol=1e-9)
    if grad_clip_by == "global_norm" and placement == "below":
        # Below the clip value nothing is scaled (RLlib's coefficient is clamped at 1).
        got_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in out.values()))
        assert got_norm == pytest.approx(n_post, rel=1e-5)


# --- skip flag: NaN, +Inf, -Inf, mixed ----------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "skipped"),
    [
        ([float("nan")], True),
        ([float("inf")], True),
        ([float("-inf")], True),
        ([float("nan"), float("-inf"), float("inf")], True),
        ([3e38], False),  # finite although its square overflows: nothing to skip
        ([], False),
    ],
    ids=["nan", "+inf", "-inf", "mixed", "finite-huge", "finite"],
)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_non_finite_gradients_skip_the_step_and_are_counted_exactly(episodes_cfg, values, skipped, fused):
    _, episodes = episodes_cfg
    cfg = _cfg(grad_clip=None)
    cfg.telemetry.fused_optimizer = fused
    learner = build_local_learner(cfg)
    module = _module(learner)
    target = module.heads["op"][0].weight  # by attribute name

    def poison(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone().reshape(-1)
        out[: len(values)] = torch.tensor(values, dtype=out.dtype)
        return out.reshape(grad.shape)

    handle = target.register_hook(poison)
    batch = train_batch(learner, episodes)
    before = [p.detach().clone() for p in module.parameters()]
    try:
        learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    finally:
        handle.remove()
    changed = [not torch.equal(p.detach(), b) for p, b in zip(module.parameters(), before, strict=True)]
    tele = learner.last_telemetry
    assert tele.minibatches == 1
    assert tele.skipped == int(skipped)
    assert tele.nan_grad_count == sum(math.isnan(v) for v in values)
    assert tele.inf_grad_count == sum(math.isinf(v) for v in values)
    if skipped:
        assert not any(changed)
    else:
        assert all(changed)


# --- learning parity: gradmon's first update == stock RLlib PPO's ------------------------------


class FusedAdamPPOTorchLearner(PPOTorchLearner):
    """Stock RLlib PPO as a competent user configures it: fused Adam."""

    @override(TorchLearner)
    def configure_optimizers_for_module(self, module_id, config=None):
        params = self.get_parameters(self._module[module_id])
        self.register_optimizer(
            module_id=module_id,
            optimizer=torch.optim.Adam(params, fused=True),
            params=params,
            lr_or_lr_schedule=config.lr,
        )


@pytest.mark.parametrize("grad_clip", [None, 0.05, 100.0], ids=["no-clip", "clip-binding", "clip-slack"])
def test_first_update_equals_stock_rllib_ppo_with_fused_adam(episodes_cfg, grad_clip):
    _, episodes = episodes_cfg
    cfg = _cfg(grad_clip=grad_clip, minibatch_size=64, num_epochs=2, lr=1e-3)
    gradmon = build_local_learner(cfg)
    stock = build_local_learner(cfg, learner_class=FusedAdamPPOTorchLearner)
    stock.module[MID].set_state(gradmon.module[MID].get_state())
    batch = train_batch(gradmon, episodes)
    start = {k: v.clone() for k, v in _module(gradmon).state_dict().items()}
    for learner in (gradmon, stock):
        learner.update(batch=batch, timesteps={}, num_epochs=2, minibatch_size=64, shuffle_batch_per_epoch=False)
    moved = 0.0
    for (name, got), want in zip(
        _module(gradmon).state_dict().items(), _module(stock).state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, float((got - start[name]).abs().max()))
    assert moved > 1e-4  # the update did something


# --- the iteration's aggregation: mean over minibatches, prev, trend, band, CV -------------------

_ACTION_EDGES = (0.01, 0.1, 2.0, 5.0)  # dead < 0.01 <= weak < 0.1 <= healthy <= 2 < elevated <= 5 < exploding
_VALUE_EDGES = (0.01, 0.1, 10.0, 50.0)  # the value head's own default edges


def _band_code(x: float, edges=_ACTION_EDGES) -> int:
    if math.isnan(x):
        return -1
    dead, weak, healthy, elevated = edges
    return 0 if x < dead else 1 if x < weak else 2 if x <= healthy else 3 if x <= elevated else 4


def test_iteration_metrics_equal_per_minibatch_gradients_captured_by_hooks(episodes_cfg):
    """Two iterations of 2 epochs x 4 minibatches: every minibatch's gradient is captured by tensor
    hooks on parameters fetched by attribute name, and the reported norms, previous values, trends,
    bands and CV are recomputed from those captures in numpy."""
    cfg, episodes = episodes_cfg
    cfg = _cfg(minibatch_size=64, num_epochs=2)
    learner = build_local_learner(cfg)
    module = _module(learner)
    owners = {name: list(head.parameters()) for name, head in module.heads.items()}
    owners["value"] = list(module.value_head.parameters())
    captured: dict[int, list[np.ndarray]] = {}  # parameter slot -> its gradient at each backward
    params = list(module.parameters())
    slot_of = {id(p): i for i, p in enumerate(params)}

    def capture(slot: int):
        def hook(grad: torch.Tensor) -> None:
            captured.setdefault(slot, []).append(grad.detach().double().numpy().copy())

        return hook

    handles = [p.register_hook(capture(slot_of[id(p)])) for p in params]
    batch = train_batch(learner, episodes)
    reported = []
    try:
        for _ in range(2):
            results = learner.update(batch=batch, timesteps={}, num_epochs=2, minibatch_size=64)
            count = len(captured[0])
            assert all(len(v) == count for v in captured.values())
            minibatches = [{slot: captured[slot][k] for slot in captured} for k in range(count)]
            reported.append((results[MID], minibatches))
            captured.clear()
    finally:
        for h in handles:
            h.remove()

    prev = {h: math.nan for h in owners}
    for logged, minibatches in reported:
        assert len(minibatches) >= 2 * 4 and all(len(m) == len(params) for m in minibatches)
        assert float(logged["update/minibatches"]) == len(minibatches)
        means = {}
        for head, ps in owners.items():
            per_mb = [math.sqrt(sum(float((m[slot_of[id(p)]] ** 2).sum()) for p in ps)) for m in minibatches]
            means[head] = float(np.mean(per_mb))
        global_mean = float(np.mean([math.sqrt(sum(float((g**2).sum()) for g in m.values())) for m in minibatches]))
        assert float(logged["grad/global_norm"]) == pytest.approx(global_mean, rel=1e-4)
        for head, mean in means.items():
            assert float(logged[f"grad/head/{head}/norm"]) == pytest.approx(mean, rel=1e-4), head
            got_prev = float(logged[f"grad/head/{head}/norm_prev"])
            assert (math.isnan(got_prev) and math.isnan(prev[head])) or got_prev == pytest.approx(prev[head], rel=1e-6)
            delta = mean - prev[head]
            trend = 1 if delta > 0.01 else -1 if delta < -0.01 else 0
            assert float(logged[f"grad/head/{head}/trend"]) == trend, head
            edges = _VALUE_EDGES if head == "value" else _ACTION_EDGES
            assert float(logged[f"grad/head/{head}/health"]) == _band_code(mean, edges), head
        action = np.array([means[h] for h in owners if h != "value"])
        assert float(logged["grad/head_norm_cv"]) == pytest.approx(float(action.std(ddof=0) / action.mean()), rel=1e-4)
        prev = means
