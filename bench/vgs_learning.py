"""Does VGS help?  Return and per-head gradient-norm stability with VGS off / gradient / update mode.

Trains gradmon's PPO (``build_ppo_config``, default config otherwise) on the built-in env at
its default reward noise and at a noisier setting (``env.config.max_reward_noise``), for
several seeds and the same budget per arm; arms alternate seed by seed.  Per run it prints
the mean episode return over the last ``--tail`` iterations and the per-head norm
instability: for every head, the coefficient of variation (std / mean) of its gradient norm
across iterations after the first ``--skip``, averaged over heads.  Per arm it prints the
mean and (min, max) over seeds.  VGS runs use the default VGS settings (``alpha`` 0.1,
``warmup_steps`` 100, element granularity, p90).  A learning comparison, not a timing.

    python bench/vgs_learning.py [--seeds 3] [--iterations 30] [--noise 0.3,1.5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import ray

from gradmon_ray import metric_names as mn
from gradmon_ray import metric_parsing as mp
from gradmon_ray.config import GradmonConfig
from gradmon_ray.rllib.config import build_ppo_config

ARMS = {"off": None, "gradient": "gradient", "update": "update"}


def run(arm: str, noise: float, seed: int, iterations: int) -> tuple[list[float], dict[str, list[float]]]:
    """(episode return mean per iteration, head -> gradient norm per iteration)."""
    cfg = GradmonConfig()
    cfg.seed = seed
    cfg.env.config = {"max_reward_noise": noise}
    cfg.resources.num_env_runners = 1
    if ARMS[arm] is not None:
        cfg.vgs.enabled = True
        cfg.vgs.apply_to = ARMS[arm]
    algo = build_ppo_config(cfg).build_algo()
    returns: list[float] = []
    norms: dict[str, list[float]] = {}
    try:
        for _ in range(iterations):
            result = algo.train()
            returns.append(float(result["env_runners"].get("episode_return_mean", float("nan"))))
            learner = result["learners"]["default_policy"]
            for head in mp.heads_of(learner, mn.HEAD_GRAD_NORM):
                norms.setdefault(head, []).append(float(learner[mn.head_metric(mn.HEAD_GRAD_NORM, head)]))
    finally:
        algo.stop()
    return returns, norms


def instability(norms: dict[str, list[float]], skip: int) -> float:
    """Mean over action heads of std/mean of the head's gradient norm across iterations."""
    cvs = [
        statistics.pstdev(v[skip:]) / statistics.fmean(v[skip:])
        for head, v in norms.items()
        if head != mn.VALUE_HEAD and len(v) > skip + 1
    ]
    return statistics.fmean(cvs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--tail", type=int, default=5)
    parser.add_argument("--skip", type=int, default=5, help="iterations left out of the stability figure")
    parser.add_argument("--noise", default="0.3,1.5", help="max_reward_noise settings")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    for noise in [float(x) for x in args.noise.split(",")]:
        finals: dict[str, list[float]] = {a: [] for a in ARMS}
        unstable: dict[str, list[float]] = {a: [] for a in ARMS}
        for seed in range(args.seeds):
            for arm in ARMS:
                start = time.perf_counter()
                returns, norms = run(arm, noise, seed, args.iterations)
                finals[arm].append(statistics.fmean(returns[-args.tail :]))
                unstable[arm].append(instability(norms, args.skip))
                print(
                    f"run noise={noise} vgs={arm} seed={seed} final_return={finals[arm][-1]:.3f} "
                    f"norm_cv={unstable[arm][-1]:.3f} wall={time.perf_counter() - start:.0f}s",
                    flush=True,
                )
        for arm in ARMS:
            f, u = finals[arm], unstable[arm]
            print(
                f"result noise={noise} vgs={arm} seeds={len(f)} iterations={args.iterations} "
                f"final_return mean {statistics.fmean(f):.3f} min {min(f):.3f} max {max(f):.3f} "
                f"norm_cv mean {statistics.fmean(u):.3f} min {min(u):.3f} max {max(u):.3f}",
                flush=True,
            )
    ray.shutdown()


if __name__ == "__main__":
    main()
