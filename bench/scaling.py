"""How telemetry's cost grows with model size and with the number of heads, against memory bandwidth.

For each case, three learners train the same model on the same postprocessed batch of real
episodes, one full update each, in rotating order (side by side in one process):

* ``stock``: RLlib's ``PPOTorchLearner``;
* ``gradmon``: ``GradmonPPOTorchLearner``, full telemetry;
* ``gradmon-off``: the same learner with telemetry off (isolates telemetry's own cost).

Cases: the default 8-head env with trunks sized for about 0.1M, 1M and 10M parameters, and
1, 8 and 32 heads (a MultiDiscrete env defined here) at about 1M parameters.

Memory bandwidth is measured on the same machine (a sum over a 256 MiB float32 tensor, best of
several), and the telemetry's gradient read (``GradientNormPlan.compute``: per-head norms,
global norm, NaN/Inf counts) is timed alone on the model's gradients and expressed as
"passes": its time over the time of one read of every gradient at that bandwidth.

    python bench/scaling.py [--rounds 7] [--device cpu|cuda] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.standalone import build_local_learner, env_spaces, sample_episodes, train_batch, update
from gradmon_ray.telemetry import GradientNormPlan

NHEADS_ENV_ID = "gradmon-bench/NHeads-v0"


class NHeadsEnv(gym.Env):
    """MultiDiscrete([6] * num_heads): reward = fraction of heads matching the observed targets."""

    def __init__(self, config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.num_heads = int({**(config or {}), **kwargs}.get("num_heads", 8))  # gym.make passes kwargs
        self.observation_space = gym.spaces.Box(0.0, 1.0, (6 * self.num_heads,), np.float32)
        self.action_space = gym.spaces.MultiDiscrete([6] * self.num_heads)
        self._t = 0
        self._target = np.zeros(self.num_heads, np.int64)

    def _obs(self) -> np.ndarray:
        obs = np.zeros((self.num_heads, 6), np.float32)
        obs[np.arange(self.num_heads), self._target] = 1.0
        return obs.reshape(-1)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        self._target = self.np_random.integers(0, 6, self.num_heads)
        return self._obs(), {}

    def step(self, action):
        reward = float(np.mean(np.asarray(action) == self._target))
        self._t += 1
        self._target = self.np_random.integers(0, 6, self.num_heads)
        return self._obs(), reward, False, self._t >= 16, {}


def memory_bandwidth_gbs(device: str) -> float:
    """Best-of-N read bandwidth: sum over 256 MiB of float32 (one read of every element)."""
    x = torch.ones(64 * 1024 * 1024, device=device)
    best = float("inf")
    for _ in range(7):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        x.sum()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def _num_params(cfg) -> int:
    from gradmon_ray.rllib.config import build_ppo_config

    obs, act = env_spaces(cfg)
    spec = build_ppo_config(cfg).rl_module_spec
    spec.observation_space, spec.action_space = obs, act
    return sum(p.numel() for p in spec.build().parameters())


def trunk_for(target_params: int, env: str | None, num_heads: int | None, device: str) -> int:
    """Two-layer trunk width whose model has about ``target_params`` parameters (counted, not guessed)."""
    lo, hi = 8, 8192
    while hi - lo > 8:
        mid = (lo + hi) // 2
        if _num_params(_case_config(mid, env, num_heads, device)) < target_params:
            lo = mid
        else:
            hi = mid
    return hi


def _case_config(trunk: int, env: str | None, num_heads: int | None, device: str):
    data: dict[str, Any] = {
        "seed": 0,
        "ppo": {"train_batch_size": 1024, "minibatch_size": 256, "num_epochs": 1},
        "model": {"trunk_hiddens": [trunk, trunk]},
    }
    if env is not None:
        data["env"] = {"id": env, "config": {"num_heads": num_heads}}
        data["model"]["head_names"] = [f"h{i}" for i in range(num_heads)]
    if device == "cuda":
        data["resources"] = {"num_gpus_per_learner": 1.0}
    return config_from_dict(data)


def run_case(label: str, cfg, rounds: int, device: str, bandwidth: float) -> dict[str, Any]:
    off = copy.deepcopy(cfg)
    off.telemetry.enabled = False
    learners = {
        "stock": build_local_learner(cfg, learner_class=PPOTorchLearner),
        "gradmon": build_local_learner(cfg),
        "gradmon-off": build_local_learner(off),
    }
    weights = learners["gradmon"].module[DEFAULT_MODULE_ID].get_state()
    for learner in learners.values():
        learner.module[DEFAULT_MODULE_ID].set_state(weights)
    batch = train_batch(learners["gradmon"], sample_episodes(cfg, learners["gradmon"], cfg.ppo.train_batch_size))

    def timed(name: str) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        update(learners[name], batch, cfg)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    names = list(learners)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(2 + rounds):
        for name in names[r % 3 :] + names[: r % 3]:
            t = timed(name)
            if r >= 2:
                times[name].append(t)
    med = {n: statistics.median(v) for n, v in times.items()}

    # The telemetry's read of the gradients, alone, on the gradients the last update left.
    module = learners["gradmon"].module[DEFAULT_MODULE_ID].unwrapped()
    params = [p for p in module.parameters() if p.requires_grad]
    num_params = sum(p.numel() for p in params)
    plan = GradientNormPlan(module.head_parameter_groups(), params)
    for p in params:
        if p.grad is None:
            p.grad = torch.randn_like(p)
    grads = [p.grad for p in params]

    def median_time(fn) -> float:
        samples = []
        for _ in range(30):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    plan_s = median_time(plan.compute)
    norms_s = median_time(lambda: torch._foreach_norm(grads))  # the norms alone: one read of every gradient
    one_pass_s = num_params * 4 / (bandwidth * 1e9)
    minibatches = learners["gradmon"].last_telemetry.minibatches
    heads = len(learners["gradmon"].head_names) - 1
    return {
        "label": label,
        "params": num_params,
        "heads": heads,
        "stock_ms": med["stock"] * 1e3,
        "gradmon_ms": med["gradmon"] * 1e3,
        "off_ms": med["gradmon-off"] * 1e3,
        "minibatches": minibatches,
        "plan_ms": plan_s * 1e3,
        "passes": plan_s / one_pass_s,
        "norm_passes": norms_s / one_pass_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="3 rounds, no 10M case (a smoke run)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    gym.register(NHEADS_ENV_ID, entry_point=NHeadsEnv)
    rounds = 3 if args.quick else args.rounds

    bandwidth = memory_bandwidth_gbs(args.device)
    print(f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} rounds={rounds}")
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s (sum over 256 MiB float32, best of 7)")
    sizes = [100_000, 1_000_000] + ([] if args.quick else [10_000_000])
    cases = [(f"size {n / 1e6:g}M", trunk_for(n, None, None, args.device), None, None) for n in sizes]
    cases += [
        (f"{n} heads 1M", trunk_for(1_000_000, NHEADS_ENV_ID, n, args.device), NHEADS_ENV_ID, n) for n in (1, 8, 32)
    ]
    print(
        "case            params  heads  stock ms  gradmon ms  off ms  gradmon/stock  gradmon/off  "
        "telemetry ms/mb  norm-plan ms  passes  (norms alone)"
    )
    for label, trunk, env, heads in cases:
        r = run_case(label, _case_config(trunk, env, heads, args.device), rounds, args.device, bandwidth)
        per_mb = (r["gradmon_ms"] - r["off_ms"]) / r["minibatches"]
        print(
            f"{r['label']:14s} {r['params'] / 1e6:6.2f}M {r['heads']:5d} {r['stock_ms']:9.1f} {r['gradmon_ms']:11.1f} "
            f"{r['off_ms']:7.1f} {r['gradmon_ms'] / r['stock_ms']:14.3f} {r['gradmon_ms'] / r['off_ms']:12.3f} "
            f"{per_mb:16.3f} {r['plan_ms']:13.3f} {r['passes']:7.2f} {r['norm_passes']:14.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
