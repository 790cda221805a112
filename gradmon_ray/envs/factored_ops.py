"""FactoredOps: a small Gymnasium env with the seeds' eight-head factored action space.

Each step the observation announces which lifecycle operation is wanted (``required_op``)
and which slot is free; each episode is a task drawn from a fixed pool (``group_id``,
also in the observation) with its own hidden target for the other heads.  Rewards:

* ``op`` always matters: +0.5 for the wanted op, -0.25 otherwise.
* ``GERMINATE`` (the op that *starts* something) when wanted and chosen: up to +0.5 more,
  split evenly over ``slot`` (== the free slot), ``blueprint``, ``style``, ``tempo``,
  ``alpha_target``, ``alpha_speed`` and ``alpha_curve`` (== the task's targets).
  The alpha heads matter only here.
* ``ADVANCE`` when wanted and chosen: +0.25 if ``tempo`` matches the task's tempo.
* ``PRUNE`` when wanted and chosen: +0.25 if ``slot`` is the free slot.
* Gaussian noise with a per-task standard deviation (0 to ``max_reward_noise``), so tasks
  differ in reward variance, which the gradient probes bucket by.

So the heads are relevant at different rates (op every step, alpha heads on about a quarter
of the steps) and a healthy policy shows different per-head gradient norms.  A uniform
random policy earns about -1 per 16-step episode; the optimum is about +11.
"""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

HEAD_NAMES: tuple[str, ...] = (
    "op",
    "slot",
    "blueprint",
    "style",
    "tempo",
    "alpha_target",
    "alpha_speed",
    "alpha_curve",
)
"""The eight action heads, in the seeds' order (a Dict space iterates them sorted)."""

HEAD_SIZES: dict[str, int] = {
    "op": 4,  # WAIT, GERMINATE, ADVANCE, PRUNE
    "slot": 3,
    "blueprint": 5,
    "style": 4,
    "tempo": 3,  # FAST, STANDARD, SLOW
    "alpha_target": 3,  # HALF, SEVENTY, FULL
    "alpha_speed": 4,  # INSTANT, FAST, MEDIUM, SLOW
    "alpha_curve": 5,  # LINEAR, COSINE, SIGMOID, ...
}

WAIT, GERMINATE, ADVANCE, PRUNE = range(4)
_TARGET_HEADS = ("blueprint", "style", "tempo", "alpha_target", "alpha_speed", "alpha_curve")


class FactoredOpsEnv(gym.Env[np.ndarray, dict[str, int]]):
    """The built-in multi-head environment (see the module docstring for the rules).

    ``config`` keys (all optional): ``num_tasks`` (8), ``episode_len`` (16),
    ``max_reward_noise`` (0.3), ``task_seed`` (0: the task pool, identical on every
    EnvRunner), ``op_probs`` (probabilities of the four wanted ops, default uniform).
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        config = dict(config or {})
        self.num_tasks = int(config.pop("num_tasks", 8))
        self.episode_len = int(config.pop("episode_len", 16))
        self.max_reward_noise = float(config.pop("max_reward_noise", 0.3))
        task_seed = int(config.pop("task_seed", 0))
        op_probs = config.pop("op_probs", None)
        # RLlib adds worker_index etc. to an EnvContext; anything else is a typo.
        unknown = set(config) - {"worker_index", "vector_index", "num_workers", "remote", "recreated_worker"}
        if unknown:
            raise ValueError(f"FactoredOpsEnv: unknown config keys {sorted(unknown)}")
        if self.num_tasks < 1 or self.episode_len < 1 or self.max_reward_noise < 0:
            raise ValueError("FactoredOpsEnv: num_tasks and episode_len must be >= 1, max_reward_noise >= 0")
        self.op_probs = np.full(4, 0.25) if op_probs is None else np.asarray(op_probs, dtype=np.float64)
        if self.op_probs.shape != (4,) or np.any(self.op_probs < 0) or not np.isclose(self.op_probs.sum(), 1.0):
            raise ValueError("FactoredOpsEnv: op_probs must be 4 non-negative numbers summing to 1")

        pool_rng = np.random.default_rng(task_seed)
        self.task_targets = {h: pool_rng.integers(0, HEAD_SIZES[h], size=self.num_tasks) for h in _TARGET_HEADS}
        self.task_noise = np.linspace(0.0, self.max_reward_noise, self.num_tasks)
        pool_rng.shuffle(self.task_noise)

        self.action_space = gym.spaces.Dict({h: gym.spaces.Discrete(HEAD_SIZES[h]) for h in HEAD_NAMES})
        obs_dim = self.num_tasks + 4 + HEAD_SIZES["slot"] + 1
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(obs_dim,), dtype=np.float32)
        self._task = 0
        self._t = 0
        self._required_op = WAIT
        self._free_slot = 0

    def _observe(self) -> np.ndarray:
        obs = np.zeros(self.observation_space.shape, dtype=np.float32)
        obs[self._task] = 1.0
        obs[self.num_tasks + self._required_op] = 1.0
        obs[self.num_tasks + 4 + self._free_slot] = 1.0
        obs[-1] = self._t / self.episode_len
        return obs

    def _draw_step_state(self) -> None:
        self._required_op = int(self.np_random.choice(4, p=self.op_probs))
        self._free_slot = int(self.np_random.integers(HEAD_SIZES["slot"]))

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._task = int(self.np_random.integers(self.num_tasks))
        self._t = 0
        self._draw_step_state()
        return self._observe(), {"group_id": self._task}

    def step(self, action: dict[str, Any]) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        a = {h: int(np.asarray(action[h]).item()) for h in HEAD_NAMES}
        reward = self.head_reward(a, self._required_op, self._free_slot, self._task)
        reward += (
            float(self.np_random.normal(0.0, self.task_noise[self._task])) if self.task_noise[self._task] > 0 else 0.0
        )
        self._t += 1
        truncated = self._t >= self.episode_len
        self._draw_step_state()
        return self._observe(), reward, False, truncated, {"group_id": self._task}

    def head_reward(self, a: dict[str, int], required_op: int, free_slot: int, task: int) -> float:
        """Noise-free reward of action ``a`` in the given step state (exposed for tests)."""
        if a["op"] != required_op:
            return -0.25
        reward = 0.5
        if required_op == GERMINATE:
            hits = [a["slot"] == free_slot] + [a[h] == self.task_targets[h][task] for h in _TARGET_HEADS]
            reward += 0.5 * sum(hits) / len(hits)
        elif required_op == ADVANCE:
            reward += 0.25 * (a["tempo"] == self.task_targets["tempo"][task])
        elif required_op == PRUNE:
            reward += 0.25 * (a["slot"] == free_slot)
        return reward
