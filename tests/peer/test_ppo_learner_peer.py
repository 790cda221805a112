"""RLlib 2.60's PPO learner scenarios (``rllib/algorithms/ppo/tests/test_ppo_learner.py``), with
``with_gradmon(PPOTorchLearner)``: loss equality, save/restore round trip (per-module KL
coefficients: ``test_kl_coeff_peer.py``, one scenario for PPO and APPO).

RLlib's own test builds learner groups on a running Ray; these build the learners in-process
(no Ray): the same learner code runs, minus the actor around it.  The expectations are RLlib's
(equal losses, equal state after a round trip) made exact: the loss against a closed form in
numpy, and gradmon's own state (latches, previous norms, clock, skip count) through the round trip.
"""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import numpy as np
import pytest
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID as MID
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
from ray.rllib.evaluation.postprocessing import Postprocessing
from ray.rllib.utils.test_utils import check

from gradmon_ray.rllib import with_gradmon
from gradmon_ray.rllib.monitor_step import TELEMETRY_STATE_KEY
from tests.peer.pairs import (
    HEADS,
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
)

RLLIB_TEST_MODEL = DefaultModelConfig(fcnet_hiddens=[10, 10], fcnet_activation="linear", vf_share_layers=False)
"""The model RLlib's PPO learner test uses."""
ONE_MINIBATCH = {"num_epochs": 1, "minibatch_size": None}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def ppo_loss_closed_form(learner: Any, batch: Any, module_id: str = MID) -> dict[str, float]:
    """PPO's loss terms in float64 numpy from the module's outputs at its current weights.

    Only the forward pass is RLlib's (logits, values); the loss is the PPO paper's clipped
    surrogate, clipped squared value error, categorical entropy and KL(sampling || current),
    as masked means, with RLlib's coefficients from the config.
    """
    config = learner.config.get_config_for_module(module_id)
    tensors = dict(learner._convert_batch_type(copy.deepcopy(batch)).policy_batches[module_id])
    module = learner.module[module_id].unwrapped()
    with torch.no_grad():
        logits = module.forward_train(tensors)[Columns.ACTION_DIST_INPUTS].double().numpy()
        values = module.compute_values(tensors).double().numpy()
    col = {k: v.double().numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in tensors.items()}
    mask = col[Columns.LOSS_MASK].astype(bool) if Columns.LOSS_MASK in col else np.ones(len(logits), bool)
    actions = col[Columns.ACTIONS].astype(int)
    logp_all, prev_all = _log_softmax(logits), _log_softmax(col[Columns.ACTION_DIST_INPUTS])
    logp = logp_all[np.arange(len(actions)), actions]
    ratio = np.exp(logp - col[Columns.ACTION_LOGP])
    adv = col[Postprocessing.ADVANTAGES]
    surrogate = np.minimum(adv * ratio, adv * np.clip(ratio, 1 - config.clip_param, 1 + config.clip_param))
    vf = np.clip((values - col[Postprocessing.VALUE_TARGETS]) ** 2, 0, config.vf_clip_param)
    entropy = -(np.exp(logp_all) * logp_all).sum(-1)
    kl = (np.exp(prev_all) * (prev_all - logp_all)).sum(-1)
    kl_coeff = float(learner.curr_kl_coeffs_per_module[module_id])
    total = (-surrogate + config.vf_loss_coeff * vf - config.entropy_coeff * entropy)[mask].mean()
    return {
        "total_loss": float(total + kl_coeff * kl[mask].mean()),
        "policy_loss": float(-surrogate[mask].mean()),
        "vf_loss": float(vf[mask].mean()),
        "entropy": float(entropy[mask].mean()),
        "mean_kl_loss": float(kl[mask].mean()),
    }


def test_loss_equals_rllibs_learner_and_the_closed_form() -> None:
    """RLlib's ``test_loss``: the learner's loss is PPO's.  The twin's logged loss terms equal the
    stock learner's bit for bit, and both equal the closed form (after one training update, so
    the ratio is not 1 and the KL not 0)."""
    config = cartpole_config(
        "ppo", PPOTorchLearner, training={"train_batch_size_per_learner": 64, "entropy_coeff": 0.01, "lr": 1e-3}
    ).rl_module(model_config=RLLIB_TEST_MODEL)
    stock = wrapped = None
    try:
        stock, wrapped = build_pair(config, gradmon_twin(config))
        batch = sample_batch(config, stock, num_timesteps=64)
        for learner in (stock, wrapped):
            seeded_update(learner, "ppo", batch, seed=1, step=1, num_epochs=2, minibatch_size=32)
        expected = ppo_loss_closed_form(stock, batch)
        assert expected["mean_kl_loss"] > 1e-6  # the weights moved away from the sampling policy
        logged = {}
        for arm, learner in (("stock", stock), ("wrapped", wrapped)):
            logged[arm] = peek(seeded_update(learner, "ppo", batch, seed=2, step=2, **ONE_MINIBATCH), MID)
        for key, value in expected.items():
            assert logged["wrapped"][key] == logged["stock"][key], key
            assert logged["wrapped"][key] == pytest.approx(value, rel=2e-5, abs=1e-7), key
    finally:
        shutdown_all([stock, wrapped])


def test_save_to_path_and_restore_from_path_round_trip() -> None:
    """RLlib's ``test_save_to_path_and_restore_from_path``, two modules, plus gradmon's state.

    Update 1 has a NaN observation in module p0's rows (its log-probs and gradients turn NaN,
    ``torch_skip_nan_gradients`` skips its step), update 2 is clean.  After save -> restore
    into a fresh learner: RLlib's ``check`` finds the whole states equal; gradmon's telemetry
    state per module is what the two updates imply; and a further update on both learners gives
    identical weights and identical gradmon metrics (the restored latches and previous norms
    are used, not just stored).  ``use_kl_loss=False``: RLlib 2.60 does not checkpoint PPO's
    KL coefficients, so a continuation would differ for the stock learner too.
    """
    config = cartpole_config(
        "ppo",
        with_gradmon(PPOTorchLearner),
        agents=2,
        gradmon={"heads": HEADS},
        training={"train_batch_size_per_learner": 64, "use_kl_loss": False},
        framework={"torch_skip_nan_gradients": True},
    )
    learner1 = learner2 = None
    try:
        learner1 = config.build_learner(spaces=spaces_of(config))
        batch = sample_batch(config, learner1, num_timesteps=64)
        poisoned = copy.deepcopy(batch)
        poisoned.policy_batches["p0"][Columns.OBS][0] = float("nan")
        seeded_update(learner1, "ppo", poisoned, seed=1, step=1, **ONE_MINIBATCH)
        second = seeded_update(learner1, "ppo", batch, seed=2, step=2, **ONE_MINIBATCH)
        with tempfile.TemporaryDirectory() as tmpdir:
            learner1.save_to_path(tmpdir)
            learner2 = config.build_learner(spaces=spaces_of(config))
            learner2.restore_from_path(tmpdir)
        check(learner1.get_state(), learner2.get_state())  # RLlib's own comparison

        telemetry = learner2.get_state(components=[TELEMETRY_STATE_KEY])[TELEMETRY_STATE_KEY]
        assert set(telemetry) == {"p0", "p1"}
        for mid, poisoned_module in (("p0", True), ("p1", False)):
            state = telemetry[mid]
            assert state["iteration"] == 2, mid
            assert state["skipped_total"] == int(poisoned_module), mid
            assert state["latches"]["nan"] == {"policy": poisoned_module}, mid
            assert state["latches"]["nan_first_iteration"] == ({"policy": 1} if poisoned_module else {}), mid
            # The previous norms are update 2's reported norms.
            reported = peek(second, mid)
            assert state["prev_norms"] == {h: pytest.approx(reported[f"grad/head/{h}/norm"], rel=1e-6) for h in HEADS}

        continued = [
            peek_all(seeded_update(lr, "ppo", batch, seed=3, step=3, **ONE_MINIBATCH)) for lr in (learner1, learner2)
        ]
        assert first_difference(learner_tensors(learner1), learner_tensors(learner2)) is None
        for mid in ("p0", "p1"):
            metrics = gradmon_metrics(continued[0][mid])
            assert "grad/head_norm_cv" not in metrics, "one action head (pi; vf a value head): CV left out, not NaN"
            assert not [k for k, v in metrics.items() if v != v], mid  # no NaN: every value equals itself
            assert gradmon_metrics(continued[1][mid]) == metrics, mid
        assert continued[1]["p0"]["latch/nan/policy"] == 1.0 and continued[1]["p0"]["update/skipped_total"] == 1.0
        assert continued[1]["p1"]["update/telemetry_iteration"] == 3.0
    finally:
        shutdown_all([learner1, learner2])


def peek_all(results: dict) -> dict[str, dict[str, float]]:
    """Every module's reduced results as plain floats (``ALL_MODULES`` left out)."""
    return {mid: peek(results, mid) for mid in results if mid.startswith("p")}


def gradmon_metrics(logged: dict[str, float]) -> dict[str, float]:
    """gradmon's metrics of one module.  None is NaN on a clean step: ``grad/head_norm_cv`` is left
    out while undefined (fewer than two action heads), not logged as NaN."""
    return {k: v for k, v in logged.items() if k.startswith(("grad/", "latch/", "update/", "policy/head/"))}
