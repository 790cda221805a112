"""A user's own RLModule (not gradmon's, not RLlib's default): heads are declared by regex; and
RLlib's own default PPO module for a given action space (``default_ppo_module``)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import torch
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core.columns import Columns
from ray.rllib.core.distribution.torch.torch_distribution import TorchCategorical
from ray.rllib.core.rl_module.apis.value_function_api import ValueFunctionAPI
from ray.rllib.core.rl_module.torch import TorchRLModule
from torch import nn


class TinyActorCritic(TorchRLModule, ValueFunctionAPI):
    """A shared body, ``policy_out`` (logits) and ``value_out``; no ``head_parameter_groups()``."""

    def setup(self) -> None:
        hidden = int((self.model_config or {}).get("hidden", 16))
        self.body = nn.Sequential(nn.Linear(self.observation_space.shape[0], hidden), nn.Tanh())
        self.policy_out = nn.Linear(hidden, int(self.action_space.n))
        self.value_out = nn.Linear(hidden, 1)
        self.action_dist_cls = TorchCategorical

    def _forward(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        embeddings = self.body(batch[Columns.OBS].float())
        return {Columns.ACTION_DIST_INPUTS: self.policy_out(embeddings), Columns.EMBEDDINGS: embeddings}

    def compute_values(self, batch: dict[str, Any], embeddings: torch.Tensor | None = None) -> torch.Tensor:
        if embeddings is None:
            embeddings = self.body(batch[Columns.OBS].float())
        return self.value_out(embeddings).squeeze(-1)


def default_ppo_module(action_space: gym.Space) -> Any:
    """RLlib's default PPO RLModule (its own catalog and distribution) over a 5-d Box observation."""
    spec = PPOConfig().get_default_rl_module_spec()
    spec.observation_space = gym.spaces.Box(-1.0, 1.0, (5,))
    spec.action_space = action_space
    spec.model_config = PPOConfig().model_config
    return spec.build()
