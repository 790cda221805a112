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
from gradmon_ray.rllib.standalone import build_local_learner, sample_episodes, train_batch, update


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
    """No clipping. After statistics from several different minibatches, one full-batch
    minibatch: what is left in p.grad (what UPGD stepped with) is the telemetry's
    pre-scaling gradient times the VGS factor."""
    cfg = _cfg(ppo={"train_batch_size": 256, "minibatch_size": 32, "num_epochs": 2, "grad_clip": None})
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
    assert state[VGS_STATE_KEY]["step_count"] == learner.vgs.step_count > 0
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
