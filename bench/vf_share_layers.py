"""Does ``FactoredActorCritic`` learn better with a shared or a separate value trunk?

Trains gradmon's PPO (``build_ppo_config``, the default config otherwise) with
``model.vf_share_layers`` true and false, on the built-in env and on CartPole-v1, for
several seeds and the same budget, and prints per arm the mean episode return over the
last ``--tail`` iterations of every seed, their mean and (min, max).  Arms alternate
seed by seed, so drift on the machine hits both alike.  This is a learning comparison,
not a timing: wall time is printed only to plan budgets.

    python bench/vf_share_layers.py [--seeds 3] [--iterations 25] [--envs builtin,cartpole]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import ray

from gradmon_ray.config import GradmonConfig
from gradmon_ray.rllib.config import build_ppo_config

ENVS = {
    # (env id, train_batch_size): CartPole with 2000 steps per iteration, as in the check.
    "builtin": ("gradmon/FactoredOps-v0", 1024),
    "cartpole": ("CartPole-v1", 2000),
}


def run(env: str, share: bool, seed: int, iterations: int) -> list[float]:
    """Episode return mean per iteration of one training run."""
    env_id, batch = ENVS[env]
    cfg = GradmonConfig()
    cfg.env.id = env_id
    cfg.seed = seed
    cfg.ppo.train_batch_size = batch
    cfg.model.vf_share_layers = share
    cfg.resources.num_env_runners = 1
    algo = build_ppo_config(cfg).build_algo()
    returns = []
    try:
        for _ in range(iterations):
            result = algo.train()
            returns.append(float(result["env_runners"].get("episode_return_mean", float("nan"))))
    finally:
        algo.stop()
    return returns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=25)
    parser.add_argument("--tail", type=int, default=5, help="average the last N iterations' returns")
    parser.add_argument("--envs", default="builtin,cartpole")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    for env in args.envs.split(","):
        finals: dict[bool, list[float]] = {True: [], False: []}
        for seed in range(args.seeds):
            for share in (True, False):
                start = time.perf_counter()
                returns = run(env, share, seed, args.iterations)
                tail = returns[-args.tail :]
                finals[share].append(statistics.fmean(tail))
                print(
                    f"env={env} vf_share_layers={share} seed={seed} final={finals[share][-1]:.2f} "
                    f"curve={[round(r, 1) for r in returns]} wall={time.perf_counter() - start:.0f}s",
                    flush=True,
                )
        for share in (True, False):
            v = finals[share]
            print(
                f"result env={env} vf_share_layers={share} seeds={len(v)} iterations={args.iterations} "
                f"final_return mean {statistics.fmean(v):.2f} min {min(v):.2f} max {max(v):.2f}",
                flush=True,
            )
    ray.shutdown()


if __name__ == "__main__":
    main()
