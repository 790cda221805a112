"""VGS and UPGD inside the real gradmon learner (seed test 4 and the checkpoint path)."""

from __future__ import annotations

import math

import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID

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
    cfg = _cfg()
    learner = build_local_learner(cfg)
    assert isinstance(next(iter(learner._optimizer_parameters)), UPGD)
    losses = []
    for _ in range(4):
        results = update(learner, batch, cfg)[DEFAULT_MODULE_ID]
        losses.append(float(results["total_loss"]))
    assert all(math.isfinite(x) for x in losses)
    assert results[mn.VGS_STEP_COUNT] == learner.vgs.step_count == 4 * learner.last_telemetry.minibatches
    assert 0.0 < results[mn.VGS_SCALING_FACTOR] < 1.0  # alpha=5: it really scales
    for name in mn.VGS_DEVICE_METRICS:
        assert math.isfinite(results[name]), name
    assert all(math.isfinite(p.detach().sum().item()) for p in learner.module[DEFAULT_MODULE_ID].parameters())


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
