"""What stock RLlib does when an agent's module is missing from one learner's shard (2 learners).

Runs PPO on ``tests/e2e/sparse_agents.SparseAgentsEnv`` (``p1`` on one learner's shard per
iteration, ``p2`` in no shard of iteration 2) with two remote learners, with RLlib's own
``PPOTorchLearner`` ("stock") or ``with_gradmon(PPOTorchLearner)`` ("gradmon"), and prints what
each iteration did within ``--deadline`` seconds (a hang shows as a timeout).  The figures in
``docs/observe_only.md`` come from ``python tools/stock_sparse_agents.py stock``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arm", choices=("stock", "gradmon"))
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds before the run counts as hung")
    args = parser.parse_args()

    import ray
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

    from gradmon_ray.rllib.monitor import with_gradmon
    from tests.e2e.sparse_agents import EPISODE_LEN, POLICIES, SparseAgentsEnv, policy_of

    learner = PPOTorchLearner if args.arm == "stock" else with_gradmon(PPOTorchLearner)
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(Path.cwd())}})
    config = (
        PPOConfig()
        .environment(SparseAgentsEnv)
        .multi_agent(policies=set(POLICIES), policy_mapping_fn=policy_of)
        .env_runners(num_env_runners=0)
        .learners(num_learners=2, learner_class=learner)
        .training(train_batch_size_per_learner=2 * EPISODE_LEN, minibatch_size=2 * EPISODE_LEN, num_epochs=1)
        .debugging(seed=0)
    )
    algo = config.build_algo()
    started = time.monotonic()

    def train() -> None:
        for i in range(1, args.iterations + 1):
            try:
                result = algo.train()
            except Exception as exc:
                print(f"iteration {i}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
                return
            trained = sorted(k for k in result["learners"] if k in POLICIES)
            print(
                f"iteration {i}: done after {time.monotonic() - started:.1f} s, modules in result {trained}", flush=True
            )

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    worker.join(args.deadline)
    if worker.is_alive():
        print(f"HUNG: no progress within {args.deadline:.0f} s", flush=True)
        ray.shutdown()
        import os

        os._exit(3)
    algo.stop()
    ray.shutdown()


if __name__ == "__main__":
    main()
