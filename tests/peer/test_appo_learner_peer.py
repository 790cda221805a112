"""RLlib 2.60's APPO learner scenarios (``rllib/algorithms/appo/tests/test_appo_learner.py``) with
``with_gradmon(APPOTorchLearner)``: the loss and a state round trip (RLlib's test has none for
APPO; its PPO test has one).  KL coefficients that change per module: ``test_kl_coeff_peer.py``,
one scenario for PPO and APPO.

The learner thread ``ray.put``s its weights: every test here is e2e.  ``use_circular_buffer=False``
(``tests.peer.pairs``): the circular buffer re-samples batches with an unseeded RNG.
"""

from __future__ import annotations

import pytest
from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID as MID
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

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
    rllib_loss,
    sample_batch,
    seeded_update,
    shutdown_all,
    spaces_of,
    weights_and_optimizer,
)

RLLIB_TEST_MODEL = DefaultModelConfig(fcnet_hiddens=[10, 10], fcnet_activation="linear", vf_share_layers=False)
TWO_EPOCHS = {"num_epochs": 2, "minibatch_size": 32}


@pytest.mark.e2e
def test_appo_loss_equals_rllibs(ray_session) -> None:
    """RLlib's ``test_appo_loss``: the twin's logged loss terms equal the stock learner's bit for bit,
    and its total loss equals RLlib's ``compute_loss_for_module`` called directly at the same weights
    (KL loss on, after a first update, so the KL to the target network and the ratios are not trivial)."""
    config = cartpole_config(
        "appo",
        APPOTorchLearner,
        training={"train_batch_size_per_learner": 64, "lr": 1e-3, "use_kl_loss": True, "kl_coeff": 0.5},
    ).rl_module(model_config=RLLIB_TEST_MODEL)
    stock = wrapped = None
    try:
        stock, wrapped = build_pair(config, gradmon_twin(config))
        batch = sample_batch(config, stock, num_timesteps=64)
        for learner in (stock, wrapped):
            seeded_update(learner, "appo", batch, seed=1, step=1, **TWO_EPOCHS)
        expected = rllib_loss(stock, batch)
        logged = {
            arm: peek(seeded_update(learner, "appo", batch, seed=2, step=2), MID)
            for arm, learner in (("stock", stock), ("wrapped", wrapped))
        }
        assert logged["wrapped"]["mean_kl_loss"] > 0.0
        assert logged["wrapped"]["total_loss"] == pytest.approx(expected, rel=1e-6)
        for key in ("total_loss", "policy_loss", "vf_loss", "entropy", "mean_kl_loss", "curr_kl_coeff"):
            assert logged["wrapped"][key] == logged["stock"][key], key
    finally:
        shutdown_all([stock, wrapped])


@pytest.mark.e2e
def test_appo_state_round_trip_keeps_gradmon_state(ray_session) -> None:
    """``get_state`` -> ``set_state`` into a fresh twin: weights, target networks, optimizer and
    gradmon's telemetry state (clock, previous norms) arrive, and one more update on each gives
    identical weights and identical gradmon metrics."""
    config = cartpole_config(
        "appo", with_gradmon(APPOTorchLearner), gradmon={"heads": HEADS}, training={"train_batch_size_per_learner": 64}
    )
    learner1 = learner2 = None
    try:
        learner1 = config.build_learner(spaces=spaces_of(config))
        batch = sample_batch(config, learner1, num_timesteps=64)
        for step in (1, 2):
            reported = peek(seeded_update(learner1, "appo", batch, seed=step, step=step, **TWO_EPOCHS), MID)
        learner2 = config.build_learner(spaces=spaces_of(config))
        learner2.set_state(learner1.get_state())
        # (Not the KL coefficients: RLlib 2.60 does not put them in the learner state.)
        assert first_difference(weights_and_optimizer(learner1), weights_and_optimizer(learner2)) is None
        state = learner2.get_state(components=[TELEMETRY_STATE_KEY])[TELEMETRY_STATE_KEY][MID]
        assert state["iteration"] == 2
        assert state["prev_norms"] == {h: pytest.approx(reported[f"grad/head/{h}/norm"], rel=1e-6) for h in HEADS}
        continued = [
            peek(seeded_update(learner, "appo", batch, seed=3, step=3, **TWO_EPOCHS), MID)
            for learner in (learner1, learner2)
        ]
        assert first_difference(learner_tensors(learner1), learner_tensors(learner2)) is None
        for key in ("grad/head/pi/norm", "grad/head/pi/norm_prev", "grad/head/pi/trend", "update/telemetry_iteration"):
            assert continued[1][key] == continued[0][key], key
        assert continued[1]["update/telemetry_iteration"] == 3.0
    finally:
        shutdown_all([learner1, learner2])
