"""RLlib 2.60's IMPALA loss scenario (``rllib/algorithms/impala/tests/test_impala_learner.py``,
``test_impala_loss``) with ``with_gradmon(IMPALATorchLearner)``.

RLlib's test runs one learner-group update and leaves V-trace's correctness to its V-trace tests.
Here the twin's logged loss terms must equal the stock learner's bit for bit, and its total loss
must equal RLlib's own ``compute_loss_for_module`` called directly at the same weights (outside
``update`` and outside gradmon).  The learner thread ``ray.put``s its weights: e2e.
"""

from __future__ import annotations

import pytest
from ray.rllib.algorithms.impala.torch.impala_torch_learner import IMPALATorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID as MID
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

from tests.peer.pairs import (
    build_pair,
    cartpole_config,
    gradmon_twin,
    peek,
    rllib_loss,
    sample_batch,
    seeded_update,
    shutdown_all,
)

RLLIB_TEST_MODEL = DefaultModelConfig(fcnet_hiddens=[10, 10], fcnet_activation="linear", vf_share_layers=False)


@pytest.mark.e2e
def test_impala_loss_equals_rllibs(ray_session) -> None:
    config = cartpole_config(
        "impala", IMPALATorchLearner, training={"train_batch_size_per_learner": 64, "lr": 1e-3}
    ).rl_module(model_config=RLLIB_TEST_MODEL)
    stock = wrapped = None
    try:
        stock, wrapped = build_pair(config, gradmon_twin(config))
        batch = sample_batch(config, stock, num_timesteps=64)
        # A first update moves the weights off the sampling policy (importance ratios != 1).
        for learner in (stock, wrapped):
            seeded_update(learner, "impala", batch, seed=1, step=1, num_epochs=2, minibatch_size=32)
        expected = rllib_loss(stock, batch)
        logged = {
            arm: peek(seeded_update(learner, "impala", batch, seed=2, step=2), MID)
            for arm, learner in (("stock", stock), ("wrapped", wrapped))
        }
        assert logged["wrapped"]["total_loss"] == pytest.approx(expected, rel=1e-6)
        terms = [k for k in logged["stock"] if k.endswith("loss") or k == "entropy"]
        assert {"total_loss", "vf_loss", "entropy"} <= set(terms)
        for key in terms:
            assert logged["wrapped"][key] == logged["stock"][key], key
        assert logged["wrapped"]["update/minibatches"] == 1.0
    finally:
        shutdown_all([stock, wrapped])
