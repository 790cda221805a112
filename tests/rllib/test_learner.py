"""GradmonPPOTorchLearner on a real RLlib learner and real episodes (no Ray cluster needed)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.learner import TELEMETRY_STATE_KEY
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update
from gradmon_ray.telemetry import per_head_grad_norms

EXPECTED_HEADS = (
    "alpha_curve",
    "alpha_speed",
    "alpha_target",
    "blueprint",
    "op",
    "slot",
    "style",
    "tempo",
    "value",
)


def _cfg(**ppo):
    base = {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 2}
    base.update(ppo)
    return config_from_dict({"seed": 0, "ppo": base, "model": {"trunk_hiddens": [32, 32]}})


@pytest.fixture(scope="module")
def shared():
    """One learner build and one batch of real episodes, reused (read-only) by the tests."""
    cfg = _cfg()
    learner = build_local_learner(cfg)
    batch = train_batch(learner, sample_episodes(cfg, learner, 256))
    return cfg, learner, batch


def _fresh(cfg, fused=True):
    c = copy.deepcopy(cfg)
    c.telemetry.fused_optimizer = fused
    return build_local_learner(c)


def _rl_module(learner):
    return learner.module[DEFAULT_MODULE_ID].unwrapped()


def _head_bias(learner, head):
    return _rl_module(learner).heads[head][-1].bias


def test_reports_nine_heads_with_finite_healthy_values(shared):
    cfg, learner, batch = shared
    results = update(learner, batch, cfg)
    tele = learner.last_telemetry
    assert learner.head_names == EXPECTED_HEADS
    assert tuple(tele.head_norms) == EXPECTED_HEADS
    assert all(math.isfinite(v) and v > 0 for v in tele.head_norms.values())
    assert math.isfinite(tele.global_norm) and tele.nan_grad_count == 0 and tele.inf_grad_count == 0
    assert tele.skipped == 0 and tele.minibatches >= 2 * (256 // 64)
    assert not any(tele.nan_latched.values()) and not any(tele.inf_latched.values())
    logged = results[DEFAULT_MODULE_ID]
    for head in EXPECTED_HEADS:
        assert f"grad/head/{head}/norm" in logged
    assert "latch/nan/op" in logged and "latch/inf/tempo" in logged and "grad/global_norm" in logged


def test_norms_equal_reference_on_one_full_batch_minibatch(shared):
    """One minibatch, no clipping: the reported norms are exactly the grads left in p.grad."""
    _, _, batch = shared
    c = _cfg(grad_clip=None, num_epochs=1, minibatch_size=256, train_batch_size=256)
    learner = _fresh(c)
    learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    tele = learner.last_telemetry
    assert tele.minibatches == 1
    reference = per_head_grad_norms(_rl_module(learner).head_parameter_groups())
    for head, ref in zip(learner.head_names, reference.tolist(), strict=True):
        assert tele.head_norms[head] == pytest.approx(ref, rel=1e-5)
    all_sq = sum(float(p.grad.double().pow(2).sum()) for p in _rl_module(learner).parameters())
    assert tele.global_norm == pytest.approx(math.sqrt(all_sq), rel=1e-5)


def test_norms_are_taken_before_clipping(shared):
    _, _, batch = shared
    learner = _fresh(_cfg(grad_clip=1e-4, num_epochs=1))
    learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    reported = learner.last_telemetry.global_norm
    left = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in _rl_module(learner).parameters()))
    assert left == pytest.approx(1e-4, rel=1e-3)  # the optimizer saw clipped grads ...
    assert reported > 100 * left  # ... telemetry saw them before clipping


@pytest.mark.parametrize("fused", [True, False], ids=["fused-on-device-skip", "host-sync-skip"])
def test_nan_in_one_head_latches_that_head_only_and_skips_the_update(shared, fused):
    cfg, _, batch = shared
    learner = _fresh(cfg, fused=fused)
    optimizer = next(iter(learner._optimizer_parameters))
    update(learner, batch, cfg)  # one clean iteration so the optimizer has state
    params_before = {k: v.clone() for k, v in _rl_module(learner).state_dict().items()}
    opt_before = copy.deepcopy(optimizer.state_dict())
    with torch.no_grad():
        saved = _head_bias(learner, "tempo").clone()
        _head_bias(learner, "tempo").fill_(float("nan"))
    update(learner, batch, cfg)
    tele = learner.last_telemetry
    assert [h for h, v in tele.nan_latched.items() if v] == ["tempo"]
    assert tele.nan_first_iteration == {"tempo": 2}
    assert tele.skipped == tele.minibatches > 0 and tele.nan_grad_count > 0
    for key, value in _rl_module(learner).state_dict().items():  # nothing applied ...
        if key != "heads.tempo.0.bias":
            assert torch.equal(value, params_before[key]), key
    opt_after = optimizer.state_dict()  # ... and the optimizer state untouched
    for pid, state in opt_before["state"].items():
        for name, tensor in state.items():
            assert torch.equal(opt_after["state"][pid][name], tensor), (pid, name)
    with torch.no_grad():
        _head_bias(learner, "tempo").copy_(saved)
    for _ in range(2):
        update(learner, batch, cfg)
    tele = learner.last_telemetry
    assert tele.skipped == 0 and tele.skipped_total == tele.minibatches
    assert tele.nan_latched["tempo"] and sum(tele.nan_latched.values()) == 1  # latch survives clean updates
    assert all(math.isfinite(p.detach().sum().item()) for p in _rl_module(learner).parameters())

    restored = _fresh(cfg)
    restored.set_state(learner.get_state())
    update(restored, batch, cfg)
    assert restored.last_telemetry.nan_latched["tempo"] and restored.last_telemetry.nan_first_iteration == {"tempo": 2}
    assert restored.last_telemetry.iteration == 5


def test_inf_log_prob_latches_inf_not_nan(shared):
    cfg, _, batch = shared
    learner = _fresh(cfg)
    taken = batch.policy_batches[DEFAULT_MODULE_ID]["actions"]["slot"]
    with torch.no_grad():
        bias = _head_bias(learner, "slot")
        bias[int(taken[0])] = float("-inf")  # that action's log-prob becomes -inf
    update(learner, batch, cfg)
    tele = learner.last_telemetry
    assert [h for h, v in tele.inf_latched.items() if v] == ["slot"]
    assert not any(tele.nan_latched.values())


def test_state_contains_telemetry_only_when_asked(shared):
    _, learner, _ = shared
    assert TELEMETRY_STATE_KEY in learner.get_state()
    assert TELEMETRY_STATE_KEY not in learner.get_state(components="rl_module")


def test_telemetry_off_logs_nothing(shared):
    cfg, _, batch = shared
    c = copy.deepcopy(cfg)
    c.telemetry.enabled = False
    learner = build_local_learner(c)
    results = update(learner, batch, c)
    assert learner.last_telemetry is None
    assert not [k for k in results[DEFAULT_MODULE_ID] if str(k).startswith("grad/")]


def test_configured_regularizers_enter_the_training_loss():
    cfg = config_from_dict(
        {
            "seed": 6,
            "ppo": {"train_batch_size": 128, "minibatch_size": 128, "num_epochs": 1},
            "model": {"trunk_hiddens": [8]},
            "regularizers": [
                {"name": "wl2", "fn": "weight_l2", "weight": 0.25},
                {"name": "off", "fn": "logit_l2", "weight": 100.0, "enabled": False},
            ],
        }
    )
    learner = build_local_learner(cfg)
    batch = learner._convert_batch_type(train_batch(learner, sample_episodes(cfg, learner, 128)))
    tensors = dict(batch.policy_batches[DEFAULT_MODULE_ID])
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    fwd = module.forward_train(tensors)
    config = learner.config.get_config_for_module(DEFAULT_MODULE_ID)
    with_reg = learner.compute_loss_for_module(module_id=DEFAULT_MODULE_ID, config=config, batch=tensors, fwd_out=fwd)
    learner._regularizers = []
    without = learner.compute_loss_for_module(module_id=DEFAULT_MODULE_ID, config=config, batch=tensors, fwd_out=fwd)
    expected = 0.25 * sum(float(p.detach().pow(2).sum()) for p in module.parameters())
    assert float(with_reg.detach() - without.detach()) == pytest.approx(expected, rel=1e-5)


def test_configured_band_edges_judge_the_learners_heads():
    """telemetry.bands reaches the learner's tracker: value by its own edges, action heads by theirs."""
    from gradmon_ray.telemetry import BandSet

    bands = {"action": {"dead_below": 0.001}, "value": {"healthy_max": 20.0, "elevated_max": 80.0}}
    cfg = config_from_dict({"seed": 0, "model": {"trunk_hiddens": [16]}, "telemetry": {"bands": bands}})
    learner = build_local_learner(cfg)
    assert learner.gradmon_modules[DEFAULT_MODULE_ID].tracker.bands == BandSet.from_dict(bands)
    assert learner.gradmon_modules[DEFAULT_MODULE_ID].tracker.bands.value.edges == (0.01, 0.1, 20.0, 80.0)
    assert learner.gradmon_modules[DEFAULT_MODULE_ID].tracker.bands.action.edges == (0.001, 0.1, 2.0, 5.0)
