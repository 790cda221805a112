"""What does a resumable checkpoint cost against a training iteration, on the default config?

Builds the default run config's PPO algorithm (``gradmon-ray train`` with no arguments: the
built-in 8-head env, one EnvRunner, 1024-step batches, 4 epochs) on a local Ray, then, in each of
``--repeats`` repetitions, times ``--iterations`` calls of ``algo.train()`` and ``--saves``
checkpoint saves through the code ``train`` runs every ``checkpoint_every`` iterations
(``CheckpointReporter``: the learner-state digest, ``Algorithm.save_to_path``, the manifest, every
fsync, the rename, the ``latest`` switch, the old version's deletion) into a temporary directory.
Prints min / median / max of both over all repetitions, and the share of training time a
checkpoint every N iterations costs (median save / (N * median iteration)).

    python bench/checkpoint_cost.py [--repeats 3] [--iterations 3] [--saves 3] [--config RUN.yaml]
    python bench/checkpoint_cost.py --quick    # smoke run: 1 repetition, 1 iteration, 1 save
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ray

from gradmon_ray.app.train.checkpoints import CheckpointReporter
from gradmon_ray.config import load_config
from gradmon_ray.rllib.config import build_ppo_config

CADENCES = (1, 2, 5, 10, 20)


def _summary(name: str, values: list[float]) -> str:
    return (
        f"{name}: n={len(values)} min {min(values):.3f} s  median {statistics.median(values):.3f} s  "
        f"max {max(values):.3f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations per repetition")
    parser.add_argument("--saves", type=int, default=3, help="timed checkpoint saves per repetition")
    parser.add_argument("--quick", action="store_true", help="1 repetition, 1 iteration, 1 save")
    parser.add_argument("--config", help="a run config (default: the defaults, what a bare `train` runs)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.iterations, args.saves = 1, 1, 1
    with tempfile.TemporaryDirectory(prefix="gradmon-ckpt-bench-") as tmp:
        root = Path(tmp)
        # The run config as `gradmon-ray train` builds it (only the store is a throwaway one).
        cfg = load_config(args.config, {"checkpoint_every": 1, "mlflow.tracking_uri": f"sqlite:///{root / 'm.db'}"})
        ray.init(num_cpus=cfg.resources.num_cpus, include_dashboard=False, log_to_driver=False)
        algo = build_ppo_config(cfg).build_algo()
        save = CheckpointReporter(cfg, lambda timeout_s: "bench-run", root=root / "ckpt")
        iteration_s: list[float] = []
        save_s: list[float] = []
        iteration = 0
        try:
            algo.train()  # warm-up: first-call compilation and EnvRunner start are not steady state
            iteration += 1
            for repeat in range(args.repeats):
                for _ in range(args.iterations):
                    start = time.perf_counter()
                    algo.train()
                    iteration_s.append(time.perf_counter() - start)
                    iteration += 1
                for _ in range(args.saves):
                    start = time.perf_counter()
                    save(iteration, {}, algo, None, None)
                    save_s.append(time.perf_counter() - start)
                print(
                    f"repetition {repeat + 1}: iterations {[round(s, 3) for s in iteration_s[-args.iterations :]]} s, "
                    f"saves {[round(s, 3) for s in save_s[-args.saves :]]} s",
                    flush=True,
                )
            size = sum(p.stat().st_size for p in (root / "ckpt").rglob("*") if p.is_file())
        finally:
            algo.stop()
            ray.shutdown()
    print(_summary("iteration", iteration_s))
    print(_summary("checkpoint save", save_s))
    print(f"checkpoint size on disk: {size / 1e6:.2f} MB")
    it, sv = statistics.median(iteration_s), statistics.median(save_s)
    worst = max(save_s) / min(iteration_s)
    for every in CADENCES:
        print(
            f"checkpoint_every {every:>2}: {100 * sv / (every * it):5.2f}% of training time "
            f"(worst save / fastest iteration: {100 * worst / every:5.2f}%)"
        )


if __name__ == "__main__":
    main()
