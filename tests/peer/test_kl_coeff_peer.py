"""RLlib 2.60's ``test_kl_coeff_changes`` (``rllib/algorithms/{ppo,appo}/tests``) with two modules and
different ``kl_target``, one scenario for both algorithms: p0's coefficient must rise (its KL is far
above a tiny target), p1's fall (far below a huge one), each by RLlib's rule applied to that
module's own logged KL, equal to the stock learner's; gradmon reports both modules.

APPO's learner thread ``ray.put``s its weights: its case is e2e; PPO's runs in the fast lane.
"""

from __future__ import annotations

from typing import Any

import pytest
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

from tests.peer.pairs import build_pair, cartpole_config, gradmon_twin, peek, sample_batch, seeded_update, shutdown_all

CASES = [
    pytest.param("ppo", PPOTorchLearner, PPOConfig, 0.2, {}, 4.0, id="ppo"),
    pytest.param(
        "appo",
        APPOTorchLearner,
        APPOConfig,
        0.01,
        {"lr": 1e-3, "use_kl_loss": True},
        2.0,
        id="appo",
        marks=pytest.mark.e2e,
    ),
]


def _expected_kl_coeff(start: float, kl: float, target: float) -> float:
    """RLlib's PPO/APPO rule (``_update_module_kl_coeff``): x1.5 above 2 x target, x0.5 below half."""
    return start * 1.5 if kl > 2.0 * target else start * 0.5 if kl < 0.5 * target else start


@pytest.mark.parametrize(("algo", "learner_class", "config_class", "initial", "training", "minibatches"), CASES)
def test_kl_coeff_changes_per_module(
    request: pytest.FixtureRequest,
    algo: str,
    learner_class: type,
    config_class: Any,
    initial: float,
    training: dict[str, Any],
    minibatches: float,
) -> None:
    if algo == "appo":
        request.getfixturevalue("ray_session")
    config = cartpole_config(
        algo,
        learner_class,
        agents=2,
        training={"train_batch_size_per_learner": 64, "kl_coeff": initial, **training},
    ).rl_module(
        algorithm_config_overrides_per_module={
            "p0": config_class.overrides(kl_target=1e-9),
            "p1": config_class.overrides(kl_target=1e3),
        }
    )
    stock = wrapped = None
    try:
        stock, wrapped = build_pair(config, gradmon_twin(config))
        batch = sample_batch(config, stock, num_timesteps=64)
        results = {
            arm: seeded_update(learner, algo, batch, seed=1, step=1, num_epochs=2, minibatch_size=32)
            for arm, learner in (("stock", stock), ("wrapped", wrapped))
        }
        for mid, target, factor in (("p0", 1e-9, 1.5), ("p1", 1e3, 0.5)):
            logged, theirs = peek(results["wrapped"], mid), peek(results["stock"], mid)
            kl = logged["mean_kl_loss"]
            assert kl > 0.0, mid  # the last minibatch ran after earlier steps
            assert kl > 2.0 * target if factor > 1 else kl < 0.5 * target, (mid, kl)
            expected = _expected_kl_coeff(initial, kl, target)
            assert expected == pytest.approx(initial * factor), mid
            assert float(wrapped.curr_kl_coeffs_per_module[mid]) == pytest.approx(expected, rel=1e-6), mid
            assert float(wrapped.curr_kl_coeffs_per_module[mid]) == float(stock.curr_kl_coeffs_per_module[mid])
            assert logged["curr_kl_coeff"] == theirs["curr_kl_coeff"], mid
            assert logged["curr_kl_coeff"] == float(wrapped.curr_kl_coeffs_per_module[mid]), mid
            assert logged["grad/head/pi/norm"] > 0.0 and logged["update/minibatches"] >= minibatches, mid
    finally:
        shutdown_all([stock, wrapped])
