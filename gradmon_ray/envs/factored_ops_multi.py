"""FactoredOps for several agents: each agent plays its own ``FactoredOpsEnv`` with the factored action space.

The multi-agent variant of the built-in environment, for training one policy per agent
(``gradmon-ray train --set env.id=gradmon/FactoredOpsMultiAgent-v0``): agents ``agent_0``,
``agent_1``, ... step together, each in its own copy of the environment (own task, own
wanted op), so their policies' heads learn at different rates, as in a real multi-agent game.
``config``: ``num_agents`` (2) and every ``FactoredOpsEnv`` key (shared by all agents; each
agent's episode stream is seeded apart).
"""

from __future__ import annotations

from typing import Any

from ray.rllib.env.multi_agent_env import MultiAgentEnv

from gradmon_ray.envs.factored_ops import FactoredOpsEnv


class FactoredOpsMultiAgentEnv(MultiAgentEnv):
    """``num_agents`` independent ``FactoredOpsEnv`` copies stepped together (see the module docstring)."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__()
        config = dict(config or {})
        num_agents = int(config.pop("num_agents", 2))
        if num_agents < 1:
            raise ValueError(f"FactoredOpsMultiAgentEnv: num_agents must be >= 1, got {num_agents}")
        self.envs = {f"agent_{i}": FactoredOpsEnv(dict(config)) for i in range(num_agents)}
        self.possible_agents = list(self.envs)
        self.agents = list(self.envs)
        self.observation_spaces = {aid: env.observation_space for aid, env in self.envs.items()}
        self.action_spaces = {aid: env.action_space for aid, env in self.envs.items()}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        obs, infos = {}, {}
        for i, (aid, env) in enumerate(self.envs.items()):
            # Different seeds per agent: identical copies would make every agent's data the same.
            obs[aid], infos[aid] = env.reset(seed=None if seed is None else seed + 1000 * i, options=options)
        self.agents = list(self.envs)
        return obs, infos

    def step(self, action_dict: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        obs, rewards, terminateds, truncateds, infos = {}, {}, {}, {}, {}
        for aid, action in action_dict.items():
            obs[aid], rewards[aid], terminateds[aid], truncateds[aid], infos[aid] = self.envs[aid].step(action)
        # Every copy has the same fixed episode length, so all agents end together.
        terminateds["__all__"] = all(terminateds.values())
        truncateds["__all__"] = all(truncateds.values())
        return obs, rewards, terminateds, truncateds, infos
