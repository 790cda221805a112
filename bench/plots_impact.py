"""Do the MLflow plots slow training?  Env steps per second with plots drawn every iteration vs never.

Two live PPO algorithms with identical configs are trained alternately in this process (in
alternating order). Each logs every iteration's telemetry through its own ``MlflowSink`` into
a throwaway sqlite store: one with ``plots_every=1`` (``--every``; the worst case, the default is 10), one
with ``plots_every=0``. Prints the median env steps per second of each and the ratio
plots/no plots. Then it times one drawing (history read back + 2 PNGs + artifact upload)
of the run at its final length.

    python bench/plots_impact.py [--iterations 12] [--batch 1024]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import ray
from mlflow.tracking import MlflowClient

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.config import build_ppo_config
from gradmon_ray.tracking import MlflowSink, result_to_metrics
from gradmon_ray.viz.report import log_plots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1024, help="env steps per iteration")
    parser.add_argument("--every", type=int, default=1, help="plots_every of the plotting variant (default 1)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    uri = f"sqlite:///{Path(tempfile.mkdtemp()) / 'mlflow.db'}"
    cfg = config_from_dict({"seed": 0, "ppo": {"train_batch_size": args.batch, "minibatch_size": 128}})
    plotting = f"plots every {args.every}"
    variants = {"no plots": 0, plotting: args.every}
    algos = {name: build_ppo_config(cfg).build_algo() for name in variants}
    sinks = {name: MlflowSink(uri, "bench", run_name=name, plots_every=every) for name, every in variants.items()}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for it in range(1, args.iterations + 3):
            for name in list(variants) if it % 2 else list(reversed(variants)):
                start = time.perf_counter()
                result = algos[name].train()
                sinks[name].log_iteration(it, result_to_metrics(result))  # what run_training does
                elapsed = time.perf_counter() - start
                if it > 2:  # two warm-up iterations
                    rates[name].append(result["env_runners"]["num_env_steps_sampled"] / elapsed)
    finally:
        for algo in algos.values():
            algo.stop()
        for sink in sinks.values():
            sink.close(timeout_s=120)
        ray.shutdown()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{args.iterations} iterations each, {args.batch} env steps per iteration, median env steps/s:")
    for name in variants:
        print(f"  {name:18s} {med[name]:8.1f}")
    print(f"  ratio plots/no plots = {med[plotting] / med['no plots']:.3f}")
    print(f"  plot failures: {sinks[plotting].plot_failures}")
    client = MlflowClient(uri)
    run_id = sinks[plotting].run_id
    draws = []
    for _ in range(5):
        start = time.perf_counter()
        log_plots(client, run_id)
        draws.append(time.perf_counter() - start)
    print(
        f"  one drawing at {args.iterations + 2} iterations x 9 heads: median {statistics.median(draws) * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
