"""What a real ``with_gradmon(PPOTorchLearner)`` decides at build (in-process, no Ray): module ids
and head names the metric grammar cannot carry are refused in one line, and a user's own action
distribution gets one ``policy`` latch, never a ``TypeError`` in the middle of an update.

Oracles: RLlib's own loss differentiated by ``torch.autograd.grad`` per parameter-name prefix
(``tests/rllib/stock_oracle.py``) for the norms; the user's distribution's own ``logp`` of the
batch for the latch (NaN exactly where the latch must fire).

Bugs these catch: per-component latches named from the action space whatever the distribution
class (``compat.child_distributions`` then raises mid-update); a latch that is not fed for such a
distribution; entropy lanes computed as if the user's distribution were RLlib's categorical;
a module id or a head of the module's own ``head_parameter_groups()`` or of the zero-config
heads that reaches the metric names unchecked.
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import pytest
import torch
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.distribution.torch.torch_distribution import TorchDistribution
from ray.rllib.core.rl_module.apis.value_function_api import ValueFunctionAPI
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.core.rl_module.torch import TorchRLModule
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
from torch import nn

from gradmon_ray import metric_names as mn
from gradmon_ray.head_labels import POLICY_LATCH
from gradmon_ray.rllib import with_gradmon
from gradmon_ray.telemetry.blame import RESULT_KEY
from tests.peer.pairs import sample_batch
from tests.rllib.stock_oracle import stock_head_norms
from tests.rllib.user_module import TinyActorCritic

OBS = gym.spaces.Box(-1.0, 1.0, (4,))
DIALS = gym.spaces.MultiDiscrete([3, 3])
HEADS = {"pi": r"^policy_out\.", "vf": r"^value_out\."}


class TemperedDials(TorchDistribution):
    """A user's own distribution over ``MultiDiscrete([3, 3])``: both dials categorical at
    temperature 2, as ONE ``torch`` ``Independent`` (no per-component children, not RLlib's
    ``TorchMultiCategorical``)."""

    def _get_torch_distribution(self, logits: torch.Tensor) -> torch.distributions.Distribution:
        cat = torch.distributions.Categorical(
            logits=logits.reshape(*logits.shape[:-1], 2, 3) / 2.0, validate_args=False
        )
        return torch.distributions.Independent(cat, 1, validate_args=False)

    @classmethod
    def required_input_dim(cls, space: gym.Space, **kwargs: Any) -> int:
        return 6

    def to_deterministic(self) -> Any:
        raise NotImplementedError


class DialsModule(TorchRLModule, ValueFunctionAPI):
    """A body, ``policy_out`` (6 inputs of ``TemperedDials``) and ``value_out``."""

    def setup(self) -> None:
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.policy_out = nn.Linear(16, 6)
        self.value_out = nn.Linear(16, 1)

    def get_train_action_dist_cls(self) -> type:
        return TemperedDials

    def get_exploration_action_dist_cls(self) -> type:
        return TemperedDials

    def get_inference_action_dist_cls(self) -> type:
        return TemperedDials

    def _forward(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        embeddings = self.body(batch[Columns.OBS].float())
        return {Columns.ACTION_DIST_INPUTS: self.policy_out(embeddings), Columns.EMBEDDINGS: embeddings}

    def compute_values(self, batch: dict[str, Any], embeddings: torch.Tensor | None = None) -> torch.Tensor:
        if embeddings is None:
            embeddings = self.body(batch[Columns.OBS].float())
        return self.value_out(embeddings).squeeze(-1)


class DialsEnv(gym.Env):
    """Turn two dials to (1, 2) for a reward of 2; episodes of 8 steps."""

    observation_space, action_space = OBS, DIALS

    def __init__(self, config: dict | None = None) -> None:
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        self.t += 1
        reward = float(action[0] == 1) + float(action[1] == 2)
        return self.observation_space.sample(), reward, self.t >= 8, False, {}


def dials_config(learner_class: type) -> PPOConfig:
    return (
        PPOConfig()
        .environment(DialsEnv)
        .rl_module(rl_module_spec=RLModuleSpec(module_class=DialsModule))
        .env_runners(num_env_runners=0, rollout_fragment_length=32)
        .learners(num_learners=0, learner_class=learner_class, learner_config_dict={"gradmon": {"heads": HEADS}})
        .training(train_batch_size_per_learner=64, minibatch_size=64, num_epochs=1, grad_clip=None)
        .debugging(seed=0)
    )


def _peek(results: dict) -> dict[str, float]:
    return {k: float(v.peek()) for k, v in results[DEFAULT_MODULE_ID].items() if hasattr(v, "peek") and k != RESULT_KEY}


@pytest.fixture(scope="module")
def dials():
    """Stock and wrapped PPO learners on ``DialsEnv``, same weights, one sampled batch."""
    spaces = {DEFAULT_MODULE_ID: (OBS, DIALS)}
    stock = dials_config(PPOTorchLearner).build_learner(spaces=spaces)
    wrapped = dials_config(with_gradmon(PPOTorchLearner)).build_learner(spaces=spaces)
    wrapped.module.set_state(stock.module.get_state())
    batch = sample_batch(dials_config(PPOTorchLearner), stock, num_timesteps=64)
    yield stock, wrapped, batch
    stock.shutdown()
    wrapped.shutdown()


def test_a_custom_distribution_gets_one_policy_latch_and_its_update_runs(dials):
    stock, wrapped, batch = dials
    assert wrapped.gradmon_modules[DEFAULT_MODULE_ID].tracker.latch_heads == (POLICY_LATCH,)
    expected = stock_head_norms(stock, batch, DEFAULT_MODULE_ID, {"pi": "policy_out.", "vf": "value_out."})
    logged = _peek(wrapped.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None))
    for head, norm in expected.items():
        assert logged[mn.head_metric(mn.HEAD_GRAD_NORM, head)] == pytest.approx(norm, rel=1e-4), head
    assert logged[mn.head_metric(mn.HEAD_NAN_LATCH, POLICY_LATCH)] == 0.0
    assert not any(k.startswith(("latch/nan/a", "policy/head/")) for k in logged), "no per-dial latch or entropy"
    assert mn.HEAD_GRAD_NORM_CV not in logged, "one action head (pi; vf a value head): no CV, not NaN"


def test_the_policy_latch_watches_the_custom_distributions_log_prob(dials):
    """One NaN observation row: the user's own ``logp`` of that row is NaN, so the latch fires."""
    _, wrapped, batch = dials
    poisoned = batch.copy()
    rows = poisoned.policy_batches[DEFAULT_MODULE_ID]
    obs = torch.as_tensor(rows[Columns.OBS]).clone()
    obs[3] = float("nan")
    rows[Columns.OBS] = obs.numpy()
    module = wrapped.module[DEFAULT_MODULE_ID].unwrapped()
    with torch.no_grad():
        logits = module.forward_train({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]
        logp = TemperedDials.from_logits(logits).logp(torch.as_tensor(rows[Columns.ACTIONS]))
    assert math.isnan(float(logp[3])) and not torch.isnan(logp[:3]).any()  # the oracle: row 3 only
    logged = _peek(wrapped.update(batch=poisoned, timesteps={}, num_epochs=1, minibatch_size=None))
    assert logged[mn.head_metric(mn.HEAD_NAN_LATCH, POLICY_LATCH)] == 1.0


# --- names the learner resolves --------------------------------------------------------------------


def test_a_module_id_metric_names_cannot_carry_is_refused_at_build():
    """RLlib refuses ``team/0`` itself; ``team 0`` (inner space) and ``red,blue`` pass RLlib's check."""
    for bad in ("team 0", "red,blue"):
        config = (
            PPOConfig()
            .environment(MultiAgentCartPole, env_config={"num_agents": 2})
            .multi_agent(policies={bad, "ok"}, policy_mapping_fn=lambda agent, *a, k=bad, **kw: "ok" if agent else k)
            .env_runners(num_env_runners=0)
            .learners(
                num_learners=0,
                learner_class=with_gradmon(PPOTorchLearner),
                learner_config_dict={"gradmon": {"heads": {"pi": r"^pi\.", "vf": r"^vf\."}}},
            )
        )
        cartpole = gym.make("CartPole-v1")
        spaces = {m: (cartpole.observation_space, cartpole.action_space) for m in (bad, "ok")}
        with pytest.raises(ValueError) as info:
            config.build_learner(spaces=spaces)
        message = str(info.value)
        assert "\n" not in message and f"module id {bad!r} cannot go into gradmon's metric names" in message


class _SlashedHeads(TinyActorCritic):
    def head_parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        return {"pi/logits": list(self.policy_out.parameters()), "vf": list(self.value_out.parameters())}


def test_a_head_of_the_modules_own_groups_metric_names_cannot_carry_is_refused_at_build():
    cartpole = gym.make("CartPole-v1")
    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .rl_module(rl_module_spec=RLModuleSpec(module_class=_SlashedHeads))
        .env_runners(num_env_runners=0)
        .learners(num_learners=0, learner_class=with_gradmon(PPOTorchLearner))
    )
    with pytest.raises(ValueError, match=r"_SlashedHeads\.head_parameter_groups\(\): head name 'pi/logits' cannot go"):
        config.build_learner(spaces={DEFAULT_MODULE_ID: (cartpole.observation_space, cartpole.action_space)})


def test_a_dict_action_key_metric_names_cannot_carry_is_refused_at_build():
    space = gym.spaces.Dict({"move x": gym.spaces.Discrete(2), "fire": gym.spaces.Discrete(2)})
    config = (
        PPOConfig().env_runners(num_env_runners=0).learners(num_learners=0, learner_class=with_gradmon(PPOTorchLearner))
    )
    with pytest.raises(ValueError, match=r"action component 'move x' cannot go into gradmon's metric names"):
        config.build_learner(spaces={DEFAULT_MODULE_ID: (OBS, space)})
