"""Where ``with_gradmon(L)`` does not train exactly like ``L``, and where it still does.

- The one intended difference: under ``torch_skip_nan_gradients=True`` a minibatch with a
  non-finite gradient is really skipped; stock RLlib 2.60 steps on it (``TorchLearner.
  apply_gradients`` leaves the NaN in and calls ``optimizer.step()``).  Shown for plain Adam (a host
  check, gradients dropped) and fused Adam (``found_inf`` read in the kernel), with stock RLlib's
  behaviour beside it.
- RLlib's default (``torch_skip_nan_gradients=False``): even a NaN minibatch stays bit for bit
  (RLlib's own ``nan_to_num`` and step run untouched).
- Mixed precision (``_torch_grad_scaler_class``): gradmon unscales the gradients before RLlib's
  clipping; stock RLlib clips the scaled ones.  Bit for bit without clipping; with clipping, RLlib's
  own logged pre-clip norm is the true one under gradmon and ``scale`` x it under stock RLlib.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID as MID
from ray.rllib.policy.sample_batch import MultiAgentBatch, concat_samples

from tests.peer.pairs import (
    build_pair,
    cartpole_config,
    first_difference,
    gradmon_twin,
    learner_tensors,
    peek,
    sample_batch,
    seeded_update,
    shutdown_all,
    spaces_of,
    weights_and_optimizer,
)
from tests.peer.user_learners import FusedAdamPPOLearner


def _poison(learner: Any, name: str, minibatch: int) -> Any:
    """A tensor hook writing NaN into element 0 of ``name``'s gradient in the ``minibatch``-th backward."""
    param = dict(learner.module[MID].unwrapped().named_parameters())[name]
    calls = itertools.count(1)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if next(calls) != minibatch:
            return grad
        poisoned = grad.clone()
        poisoned.view(-1)[0] = float("nan")
        return poisoned

    return param.register_hook(hook)


def _rows_of(batch: MultiAgentBatch, *spans: tuple[int, int]) -> MultiAgentBatch:
    rows = concat_samples([batch.policy_batches[MID][a:b] for a, b in spans])
    return MultiAgentBatch({MID: rows}, len(rows))


def _first_pi_parameter(learner: Any) -> str:
    return next(n for n, _ in learner.module[MID].unwrapped().named_parameters() if n.startswith("pi."))


@pytest.mark.parametrize("learner_class", [PPOTorchLearner, FusedAdamPPOLearner], ids=["adam", "fused-adam"])
def test_torch_skip_nan_gradients_skips_where_stock_rllib_steps(learner_class: type) -> None:
    """``torch_skip_nan_gradients=True``, one NaN gradient element in minibatch 2 of 3.

    Stock RLlib 2.60 neither zeroes it nor skips: Adam steps and the element's weight turns NaN.
    gradmon skips that minibatch: the twin ends exactly where a stock learner ends that trained
    on minibatches 1 and 3 only (same Adam step count and moments), and a single poisoned
    minibatch leaves its weights and optimizer state exactly as they were.
    """
    config = cartpole_config(
        "ppo",
        learner_class,
        training={"train_batch_size_per_learner": 96, "grad_clip": 0.5},
        framework={"torch_skip_nan_gradients": True},
    )
    learners = []
    try:
        stock, wrapped = build_pair(config, gradmon_twin(config))
        reference = config.build_learner(spaces=spaces_of(config))
        reference.module.set_state(stock.module.get_state())
        learners = [stock, wrapped, reference]
        full = sample_batch(config, stock, num_timesteps=96)
        m = len(full) // 3
        batch = _rows_of(full, (0, 3 * m))
        name = _first_pi_parameter(stock)
        one_epoch = {"num_epochs": 1, "minibatch_size": m, "shuffle_batch_per_epoch": False}

        handles = [_poison(learner, name, minibatch=2) for learner in (stock, wrapped)]
        stock_results = seeded_update(stock, "ppo", batch, seed=1, step=1, **one_epoch)
        wrapped_results = seeded_update(wrapped, "ppo", batch, seed=1, step=1, **one_epoch)
        seeded_update(reference, "ppo", _rows_of(batch, (0, m), (2 * m, 3 * m)), seed=1, step=1, **one_epoch)
        for handle in handles:
            handle.remove()

        # Stock RLlib stepped on the NaN: the poisoned weight is NaN and later minibatches spread it.
        stock_weight = dict(stock.module[MID].unwrapped().named_parameters())[name]
        assert torch.isnan(stock_weight.view(-1)[0])
        assert peek(stock_results, MID)["num_module_steps_trained"] == 3 * m
        # gradmon skipped exactly that minibatch and counted it.
        diff = first_difference(learner_tensors(reference), learner_tensors(wrapped))
        assert diff is None, f"gradmon's skip != training on minibatches 1 and 3: {diff}"
        logged = peek(wrapped_results, MID)
        assert (logged["update/skipped"], logged["grad/nan_count"], logged["update/minibatches"]) == (1.0, 1.0, 3.0)

        # One poisoned minibatch alone: no weight and no optimizer state moves (Adam's moments and
        # step count); RLlib's KL-coefficient rule still runs after the update, as it should.
        before = weights_and_optimizer(wrapped, clone=True)
        handle = _poison(wrapped, name, minibatch=1)
        seeded_update(wrapped, "ppo", batch, seed=2, step=2, num_epochs=1, minibatch_size=None)
        handle.remove()
        diff = first_difference(before, weights_and_optimizer(wrapped))
        assert diff is None, f"a skipped minibatch moved: {diff}"
    finally:
        shutdown_all(learners)


def test_rllibs_default_nan_handling_stays_bit_for_bit() -> None:
    """``torch_skip_nan_gradients=False`` (RLlib's default), NaN in minibatch 2 of 3: both arms run
    RLlib's ``nan_to_num`` and step, and end bit for bit equal and finite."""
    config = cartpole_config("ppo", PPOTorchLearner, training={"train_batch_size_per_learner": 96, "grad_clip": 0.5})
    stock = wrapped = None
    try:
        stock, wrapped = build_pair(config, gradmon_twin(config))
        batch = sample_batch(config, stock, num_timesteps=96)
        name = _first_pi_parameter(stock)
        handles = [_poison(learner, name, minibatch=2) for learner in (stock, wrapped)]
        minibatches = {"num_epochs": 1, "minibatch_size": len(batch) // 3 + 1, "shuffle_batch_per_epoch": False}
        results = [seeded_update(lr, "ppo", batch, seed=1, step=1, **minibatches) for lr in (stock, wrapped)]
        for handle in handles:
            handle.remove()
        diff = first_difference(learner_tensors(stock), learner_tensors(wrapped))
        assert diff is None, f"RLlib's default NaN handling under gradmon: {diff}"
        assert all(torch.isfinite(p).all() for p in stock.module[MID].unwrapped().parameters())
        logged = peek(results[1], MID)
        assert (logged["grad/nan_count"], logged["update/skipped"]) == (1.0, 0.0)
    finally:
        shutdown_all([stock, wrapped])


SCALE = 1024.0
"""A power of two: scaling by it is exact in float32, so the two arms' norms differ by exactly it."""


@pytest.mark.parametrize("grad_clip", [None, 0.01], ids=["no-clip", "global-norm-clip"])
def test_mixed_precision_clips_unscaled_gradients(grad_clip: float | None) -> None:
    """``_torch_grad_scaler_class``: gradmon unscales before RLlib's clipping (to measure true norms).

    No clipping: bit for bit (the unscale is the same operation, only earlier).  A binding
    global-norm clip: RLlib's own logged pre-clip norm is the true norm under gradmon and
    ``SCALE`` x it under stock RLlib, which clips the scaled gradients to ``grad_clip`` and so
    steps with gradients ``SCALE`` x smaller than intended: the weights differ (a difference by
    design, documented in docs/observe_only.md).
    """
    scaler = functools.partial(torch.amp.GradScaler, "cpu", init_scale=SCALE, growth_interval=10**6)
    config = cartpole_config(
        "ppo",
        PPOTorchLearner,
        training={"train_batch_size_per_learner": 64, "grad_clip": grad_clip, "grad_clip_by": "global_norm"},
        experimental={"_torch_grad_scaler_class": scaler},
    )
    stock = wrapped = None
    try:
        stock, wrapped = build_pair(config, gradmon_twin(config))
        batch = sample_batch(config, stock, num_timesteps=64)
        one = {"num_epochs": 1, "minibatch_size": None}
        logged = [peek(seeded_update(lr, "ppo", batch, seed=1, step=1, **one), MID) for lr in (stock, wrapped)]
        diff = first_difference(weights_and_optimizer(stock), weights_and_optimizer(wrapped))
        if grad_clip is None:
            assert diff is None, f"mixed precision without clipping: {diff}"
            return
        assert diff is not None
        (key,) = [k for k in logged[0] if k.startswith("gradients_") and k.endswith("_global_norm")]
        assert logged[0][key] == pytest.approx(SCALE * logged[1][key], rel=1e-6)
        assert logged[1][key] == pytest.approx(logged[1]["grad/global_norm"], rel=1e-6)  # gradmon's, unscaled
        assert logged[1][key] > grad_clip  # the clip binds
    finally:
        shutdown_all([stock, wrapped])
