"""Issue #8 fault 8: RLlib's torch grad scaler (``_torch_grad_scaler_class``) on CPU.

With a scaler of known scale S, RLlib back-propagates S * loss.  Every gradmon statistic must
still describe the true (unscaled) gradients, and a step the scaler skips because S * g
overflowed is the scaler's business: counted in ``update/scaler_skipped``, not in
``update/skipped``, and never a NaN/Inf latch.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.local_learner import env_spaces, local_ppo_config, sample_episodes, train_batch

CFG_DATA = {
    "seed": 4,
    "vgs": {"enabled": True, "warmup_steps": 0, "alpha": 2.0},
    "ppo": {"train_batch_size": 128, "minibatch_size": 64, "num_epochs": 1},
    "model": {"trunk_hiddens": [32]},
}
CFG = config_from_dict(CFG_DATA)
# op's logits x100: its largest gradient element is about 5.5, so 2**127 * g overflows float32.
LOUD_CFG = config_from_dict({**CFG_DATA, "model": {"trunk_hiddens": [32], "head_logit_scale": {"op": 100.0}}})


def _learner(init_scale: float | None, cfg=CFG, **scaler_kwargs):
    config = local_ppo_config(cfg)
    if init_scale is not None:
        scaler = functools.partial(torch.amp.GradScaler, "cpu", init_scale=init_scale, **scaler_kwargs)
        config = config.experimental(_torch_grad_scaler_class=scaler)
    return config.build_learner(spaces={DEFAULT_MODULE_ID: env_spaces(cfg)})


def _module(learner):
    return learner.module[DEFAULT_MODULE_ID].unwrapped()


def _one_minibatch_update(learner, batch) -> dict[str, float]:
    results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    return {k: float(v.peek()) for k, v in results[DEFAULT_MODULE_ID].items() if "/" in k}


@pytest.fixture(scope="module")
def episodes():
    return sample_episodes(CFG, _learner(None), 128)


def test_norms_vgs_and_the_update_are_those_of_the_unscaled_gradients(episodes):
    plain, scaled = _learner(None), _learner(1024.0, growth_interval=10**6)
    scaled.set_state({"rl_module": plain.get_state(components="rl_module")["rl_module"]})
    batch = train_batch(plain, copy.deepcopy(episodes))
    logged_plain = _one_minibatch_update(plain, batch)
    logged_scaled = _one_minibatch_update(scaled, train_batch(scaled, copy.deepcopy(episodes)))

    assert logged_scaled[mn.GRAD_SCALE] == 1024.0 and logged_scaled[mn.SCALER_SKIPPED_UPDATES] == 0.0
    assert mn.GRAD_SCALE not in logged_plain  # only with a scaler
    for head in plain.head_names:  # loss x 1024 changes no reported norm (powers of two are exact)
        name = mn.head_metric(mn.HEAD_GRAD_NORM, head)
        assert logged_scaled[name] == pytest.approx(logged_plain[name], rel=1e-6), head
    assert logged_scaled[mn.GLOBAL_GRAD_NORM] == pytest.approx(logged_plain[mn.GLOBAL_GRAD_NORM], rel=1e-6)
    assert 0.01 < logged_scaled[mn.GLOBAL_GRAD_NORM] < 100  # unscaled size, not 1024x
    vgs_plain, vgs_scaled = plain.vgs.state_dict(), scaled.vgs.state_dict()
    torch.testing.assert_close(vgs_scaled["param_grad_mean_ema"], vgs_plain["param_grad_mean_ema"])
    torch.testing.assert_close(vgs_scaled["param_grad_sq_ema"], vgs_plain["param_grad_sq_ema"])
    assert logged_scaled[mn.VGS_SCALING_FACTOR] == pytest.approx(logged_plain[mn.VGS_SCALING_FACTOR], rel=1e-6)
    for (name, p_plain), p_scaled in zip(_module(plain).named_parameters(), _module(scaled).parameters(), strict=True):
        torch.testing.assert_close(p_scaled, p_plain, rtol=1e-6, atol=1e-7, msg=name)  # the same step was taken


def test_an_overflow_at_the_scale_is_a_scaler_skip_not_a_nan_latch(episodes):
    learner = _learner(2.0**127, LOUD_CFG, backoff_factor=2.0**-16, growth_interval=10**6)
    before = {k: v.clone() for k, v in _module(learner).state_dict().items()}
    logged = _one_minibatch_update(learner, train_batch(learner, copy.deepcopy(episodes)))
    assert logged[mn.SCALER_SKIPPED_UPDATES] == 1.0 and logged[mn.SKIPPED_UPDATES] == 0.0
    assert logged[mn.NAN_GRAD_COUNT] + logged[mn.INF_GRAD_COUNT] > 0  # what the unscaled grads held
    assert logged[mn.GRAD_SCALE] == 2.0**127  # the scale that overflowed ...
    scaler = learner.gradmon_modules[DEFAULT_MODULE_ID].grad_scaler
    assert scaler.get_scale() == 2.0**111  # ... and the scaler backed off
    for head in learner.head_names[:-1]:
        assert logged[mn.head_metric(mn.HEAD_NAN_LATCH, head)] == 0.0
        assert logged[mn.head_metric(mn.HEAD_INF_LATCH, head)] == 0.0
    for key, value in _module(learner).state_dict().items():
        assert torch.equal(value, before[key]), key  # the step was skipped
    assert learner.vgs.state_dict()["stat_steps"] == 0.0  # VGS learned nothing from it either

    for _ in range(6):  # the scaler keeps backing off until S * g fits; then training goes on
        logged = _one_minibatch_update(learner, train_batch(learner, copy.deepcopy(episodes)))
        if logged[mn.SCALER_SKIPPED_UPDATES] == 0.0:
            break
    assert logged[mn.SCALER_SKIPPED_UPDATES] == 0.0 and logged[mn.SKIPPED_UPDATES] == 0.0
    assert math.isfinite(logged[mn.GLOBAL_GRAD_NORM])
    assert any(not torch.equal(v, before[k]) for k, v in _module(learner).state_dict().items())
    assert learner.last_telemetry.skipped_total == 0


def test_every_minibatch_the_scaler_skips_in_a_step_is_counted(episodes):
    """Four or more minibatches in one update, the scale starting at 2**127 and halving on every overflow
    (never growing): ``update/scaler_skipped`` is the number of minibatches the scaler skipped in
    the step, not whether the last one was.  Oracle: the scaler's own scale, which halved once
    per skipped step."""
    learner = _learner(2.0**127, LOUD_CFG, backoff_factor=0.5, growth_interval=10**6)
    results = learner.update(
        batch=train_batch(learner, copy.deepcopy(episodes)), timesteps={}, num_epochs=1, minibatch_size=32
    )
    logged = {k: float(v.peek()) for k, v in results[DEFAULT_MODULE_ID].items() if "/" in k}
    backoffs = math.log2(2.0**127 / learner.gradmon_modules[DEFAULT_MODULE_ID].grad_scaler.get_scale())
    assert backoffs == int(backoffs) >= 2  # several skips in the one step
    assert learner.last_telemetry.minibatches >= 4
    assert logged[mn.SCALER_SKIPPED_UPDATES] == backoffs
    assert logged[mn.SKIPPED_UPDATES] == 0.0
