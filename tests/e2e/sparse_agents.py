"""A multi-agent env where some agents appear only in some episodes, and a learner that records its
local gradients (the oracle for the cross-learner average).

Episodes last ``EPISODE_LEN`` steps.  ``a0`` plays every episode, ``a1`` only episodes 0, 4, 8, ...
and ``a2`` only episodes 1, 9, 17, ... (counted per env instance).  With 4 episodes per iteration
split between two learners, ``p1`` (``a1``'s policy) is on exactly one learner's shard in every
iteration, and ``p2`` is in iterations 1 and 3 but in no shard of iteration 2.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.env.multi_agent_env import MultiAgentEnv

EPISODE_LEN = 16
AGENTS = ("a0", "a1", "a2")
POLICIES = ("p0", "p1", "p2")


def policy_of(agent_id: str, *args: Any, **kwargs: Any) -> str:
    return "p" + agent_id[-1]


def agents_in(episode: int, late_a2: bool = False) -> list[str]:
    """The agents playing episode ``episode`` (0-based, per env instance; RLlib's EnvRunner resets
    once before it samples, so an iteration of 4 episodes plays 1-4, then 5-8, ...); ``late_a2``:
    ``a2`` plays episode 9 only (iteration 3)."""
    a2 = episode == 9 if late_a2 else episode % 8 == 1
    return ["a0"] + (["a1"] if episode % 4 == 0 else []) + (["a2"] if a2 else [])


class SparseAgentsEnv(MultiAgentEnv):
    """Each agent sees 4 numbers and is rewarded for choosing 1 when the first is positive."""

    def __init__(self, config: dict | None = None) -> None:
        super().__init__()
        self.possible_agents = list(AGENTS)
        self.agents = []
        box = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.observation_spaces = {a: box for a in AGENTS}
        self.action_spaces = {a: gym.spaces.Discrete(2) for a in AGENTS}
        self._episode = -1
        self._t = 0
        self._rng = np.random.default_rng(0)
        self._obs: dict[str, np.ndarray] = {}
        self._late_a2 = bool((config or {}).get("late_a2"))

    def _observe(self) -> dict[str, np.ndarray]:
        self._obs = {a: self._rng.uniform(-1, 1, 4).astype(np.float32) for a in self.agents}
        return dict(self._obs)

    def reset(self, *, seed: int | None = None, options: dict | None = None):  # type: ignore[override]
        self._episode += 1
        self._t = 0
        self.agents = agents_in(self._episode, self._late_a2)
        return self._observe(), {}

    def step(self, actions: dict[str, int]):  # type: ignore[override]
        rewards = {a: float(int(actions[a]) == int(self._obs[a][0] > 0)) for a in actions}
        self._t += 1
        done = self._t >= EPISODE_LEN
        obs = self._observe()
        terminateds = {a: done for a in self.agents} | {"__all__": done}
        return obs, rewards, terminateds, {"__all__": False}, {}


class LocalGradientsPPOLearner(PPOTorchLearner):
    """Stock PPO that keeps each update's LOCAL gradients per module (flattened, on the host), as
    ``backward`` left them: under ``with_gradmon`` this runs inside gradmon's ``compute_gradients``,
    so before the cross-learner average."""

    def build(self) -> None:
        super().build()
        self.local_grads: list[dict[str, np.ndarray | None]] = []

    def compute_gradients(self, loss_per_module: dict, **kwargs: Any) -> dict:
        grads = super().compute_gradients(loss_per_module, **kwargs)
        record: dict[str, np.ndarray | None] = {}
        for mid in self.module.keys():  # noqa: SIM118
            params = [p for p in self.module[mid].parameters() if p.requires_grad]
            present = [p.grad for p in params if p.grad is not None]
            record[mid] = torch.cat([g.reshape(-1) for g in present]).double().cpu().numpy() if present else None
        self.local_grads.append(record)
        return grads


def policy_of_with_p3(agent_id: str, *args: Any, **kwargs: Any) -> str:
    """``a2`` plays as ``p3``, a module added mid-run before ``a2``'s first episode (the self-play
    pattern without a mapping change mid-episode, which RLlib's EnvRunner does not survive)."""
    return "p3" if agent_id == "a2" else policy_of(agent_id)
