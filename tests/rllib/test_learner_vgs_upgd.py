"""VGS and UPGD inside the real gradmon learner (seed test 4 and the checkpoint path), and clipping.

Clipping: the learner's postprocessed gradients equal RLlib's own ``clip_gradients`` applied to the
(VGS-scaled, in gradient mode) gradients, for every ``grad_clip_by`` and clip values below, at,
between and above the norms (``test_clipped_gradients_equal_rllibs_clip_gradients``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.utils.torch_utils import clip_gradients

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.optim import UPGD
from gradmon_ray.rllib.learner import VGS_STATE_KEY
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update


def _cfg(**over):
    data = {
        "seed": 0,
        "optimizer": "upgd",
        "vgs": {"enabled": True, "warmup_steps": 0, "alpha": 5.0},
        "ppo": {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 2, "lr": 1e-3},
        "model": {"trunk_hiddens": [32, 32]},
    }
    data.update(over)
    return config_from_dict(data)


@pytest.fixture(scope="module")
def batch():
    cfg = _cfg()
    learner = build_local_learner(cfg)
    return train_batch(learner, sample_episodes(cfg, learner, 256))


def test_4_vgs_with_upgd_trains_and_reports(batch):
    """Seed test 4: VGS (alpha 5, no warmup) on the learner whose optimizer is UPGD, 4 updates.
    Oracle: the numpy VGS (``tests/vgs/vgs_oracle.py``, no product code) fed every minibatch's raw
    gradients, captured by tensor hooks: each logged ``vgs/*`` metric after the last update, the
    step count (one per backward pass) and the factor included, equals it."""
    import copy

    from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

    from tests.vgs.vgs_oracle import assert_vgs_metrics_close, numpy_vgs_metrics

    cfg = _cfg(model={"trunk_hiddens": [16, 16]})  # fewer entries than the percentiles' sample: exact
    learner = build_local_learner(cfg)
    assert isinstance(next(iter(learner._optimizer_parameters)), UPGD)
    params = list(learner.module[DEFAULT_MODULE_ID].parameters())
    assert sum(p.numel() for p in params) <= learner.vgs.quantile_sample_size
    captured: list[list] = [[] for _ in params]
    hooks = [
        p.register_hook(lambda g, mine=mine: mine.append(g.detach().double().numpy().copy()))
        for p, mine in zip(params, captured, strict=True)
    ]
    try:
        for _ in range(4):
            results = update(learner, batch, cfg)[DEFAULT_MODULE_ID]
    finally:
        for hook in hooks:
            hook.remove()
    assert len({len(c) for c in captured}) == 1, "a parameter missed a backward pass"
    steps = [[c[k] for c in captured] for k in range(len(captured[0]))]
    vgs = cfg.vgs
    expected = numpy_vgs_metrics(
        steps,
        beta=vgs.beta,
        alpha=vgs.alpha,
        eps=vgs.eps,
        warmup_steps=vgs.warmup_steps,
        aggregation_method=vgs.aggregation_method,
        granularity=vgs.granularity,
    )
    logged = {k: float(v.peek() if hasattr(v, "peek") else v) for k, v in results.items() if k in expected}
    # one VGS step per minibatch: 4 updates x what RLlib's own iterator makes of 2 epochs of 64 rows
    per_update = MiniBatchCyclicIterator(copy.deepcopy(batch), num_epochs=2, minibatch_size=64)
    assert expected[mn.VGS_STEP_COUNT] == 4 * len(list(per_update))
    assert expected[mn.VGS_SCALING_FACTOR] < 0.999  # alpha=5: it really scales
    assert_vgs_metrics_close(logged, expected)


def test_scaled_gradients_reach_the_optimizer(batch):
    """Gradient mode, no clipping. After statistics from several different minibatches, one
    full-batch minibatch: what is left in p.grad (what UPGD stepped with) is the telemetry's
    pre-scaling gradient times the VGS factor."""
    cfg = _cfg(
        vgs={"enabled": True, "warmup_steps": 0, "alpha": 5.0, "apply_to": "gradient"},
        ppo={"train_batch_size": 256, "minibatch_size": 32, "num_epochs": 2, "grad_clip": None},
    )
    learner = build_local_learner(cfg)
    update(learner, batch, cfg)  # 16+ minibatches with different gradients
    learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    pre = learner.last_telemetry.global_norm
    scale = learner.vgs.get_scaling_factor()
    params = learner.module[DEFAULT_MODULE_ID].parameters()
    left = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
    assert scale < 0.99
    assert left == pytest.approx(pre * scale, rel=1e-4)


def test_vgs_state_rides_in_the_learner_checkpoint(batch):
    cfg = _cfg(optimizer="adam")
    learner = build_local_learner(cfg)
    update(learner, batch, cfg)
    state = learner.get_state()
    assert state[VGS_STATE_KEY][DEFAULT_MODULE_ID]["step_count"] == learner.vgs.step_count > 0
    restored = build_local_learner(cfg)
    restored.set_state(state)
    assert restored.vgs.get_metrics() == learner.vgs.get_metrics()


def test_nan_minibatch_is_skipped_and_never_reaches_vgs_statistics(batch):
    cfg = _cfg(optimizer="adam")
    learner = build_local_learner(cfg)
    update(learner, batch, cfg)
    before = learner.vgs.state_dict()
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    with torch.no_grad():
        module.heads["op"][-1].bias.fill_(float("nan"))
    update(learner, batch, cfg)
    after = learner.vgs.state_dict()
    assert learner.last_telemetry.skipped == learner.last_telemetry.minibatches
    assert after["stat_steps"] == before["stat_steps"]
    assert torch.equal(after["param_grad_mean_ema"], before["param_grad_mean_ema"])


def test_upgd_with_vgs_off_and_telemetry_still_on(batch):
    cfg = _cfg(vgs={"enabled": False})
    learner = build_local_learner(cfg)
    results = update(learner, batch, cfg)[DEFAULT_MODULE_ID]
    assert learner.vgs is None and mn.VGS_SCALING_FACTOR not in results
    assert learner.last_telemetry.skipped == 0


def _one_step_twins(batch, optimizer: str, grad_clip: float | None, apply_to: str):
    """A VGS learner with 16 minibatches of history and a learner without VGS set to its exact
    state (weights, optimizer moments, UPGD noise generator); both take one full-batch step.
    Returns (factor used, [(delta with VGS, delta without, theta before)] per parameter)."""
    ppo = {"train_batch_size": 256, "minibatch_size": 32, "num_epochs": 2, "lr": 1e-3, "grad_clip": grad_clip}
    vgs = {"enabled": True, "warmup_steps": 0, "alpha": 5.0, "apply_to": apply_to}
    cfg = _cfg(optimizer=optimizer, ppo=ppo, vgs=vgs)
    plain_cfg = _cfg(optimizer=optimizer, ppo=ppo, vgs={"enabled": False})
    vgs_learner, plain = build_local_learner(cfg), build_local_learner(plain_cfg)
    update(vgs_learner, batch, cfg)  # 16 minibatches of history: the factor is well below 1
    state = vgs_learner.get_state()
    state.pop(VGS_STATE_KEY)
    plain.set_state(state)
    params = [list(learner.module[DEFAULT_MODULE_ID].parameters()) for learner in (vgs_learner, plain)]
    before = [[p.detach().clone() for p in ps] for ps in params]
    for learner in (vgs_learner, plain):
        learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)  # one minibatch
    factor = vgs_learner.vgs.get_scaling_factor()  # what this step used (warmup 0, statistics unchanged since)
    lr_after = [g["lr"] for opt in vgs_learner._optimizer_parameters for g in opt.param_groups]
    assert all(isinstance(lr, float) and lr == pytest.approx(1e-3) for lr in lr_after)  # the float lr is back
    deltas = []
    for p_vgs, p_plain, b_vgs, b_plain in zip(*params, *before, strict=True):
        assert torch.equal(b_vgs, b_plain)
        deltas.append(((p_vgs.detach() - b_vgs).double(), (p_plain.detach() - b_plain).double(), b_vgs))
    return factor, deltas


def test_gradient_mode_under_a_binding_global_norm_clip_changes_nothing(batch):
    """Why ``update`` is the default: in gradient mode a binding global-norm clip rescales the
    gradient to the clip norm whatever factor VGS applied, so Adam takes the very same step."""
    factor, deltas = _one_step_twins(batch, "adam", 0.05, "gradient")
    assert factor < 0.9
    for delta_vgs, delta_plain, _ in deltas:
        torch.testing.assert_close(delta_vgs, delta_plain, rtol=1e-4, atol=2e-7)


@pytest.mark.parametrize("optimizer", ["adam", "upgd"])
@pytest.mark.parametrize("grad_clip", [None, 0.05], ids=["no-clip", "binding-clip"])
def test_update_mode_moves_the_parameters_by_factor_times_the_update_without_vgs(batch, optimizer, grad_clip):
    """The worked answer of ``vgs.apply_to: update``: from the same weights and optimizer
    state, on the same minibatch, the VGS learner's parameter change is exactly the factor
    times the change of a learner without VGS (Adam's normalisation and a binding
    global-norm clip included: the factor acts after both)."""
    assert _cfg().vgs.apply_to == "update"  # the default
    factor, deltas = _one_step_twins(batch, optimizer, grad_clip, "update")
    assert factor < 0.9
    for delta_vgs, delta_plain, _ in deltas:
        # atol: float32 parameters round theta + delta to ~1e-7 (one ulp at |theta| ~ 1).
        torch.testing.assert_close(delta_vgs, factor * delta_plain, rtol=1e-4, atol=2e-7)
        ratio = float(delta_vgs.norm() / delta_plain.norm())
        assert ratio == pytest.approx(factor, rel=1e-2)  # tiny UPGD steps: float32 rounding ~0.2%
    assert sum(float(delta_plain.abs().sum()) for _, delta_plain, _ in deltas) > 0.0  # a real step was taken


# --- clipping: the learner's postprocessed gradients == RLlib's clip_gradients ------------------

MID = DEFAULT_MODULE_ID


def _module(learner):
    return learner.module[MID].unwrapped()


def _vgs_cfg(vgs: str | None):
    """Adam, one full-batch minibatch, no clipping configured; ``vgs``: None (off), ``"gradient"`` or
    ``"update"`` (where the factor acts)."""
    cfg = config_from_dict(
        {
            "seed": 3,
            "ppo": {"train_batch_size": 256, "minibatch_size": 256, "num_epochs": 1, "grad_clip": None},
            "model": {"trunk_hiddens": [32, 32]},
        }
    )
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
