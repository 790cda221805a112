"""Cost of the cross-learner telemetry reduction, measured side by side.

Part 1: two Ray actors in a ``ray.util.collective`` gloo group reduce the 9-head telemetry:
ONE packed SUM allreduce of the whole buffer vs one allreduce per metric (what a naive
implementation does), alternating, same actors; prints per-iteration times and the ratio.

Part 2: end-to-end iteration time of 2-learner PPO with the packed reduction on vs off
(``distributed.reduce_telemetry``), two live algorithms trained alternately in this process;
prints the median iteration time of each and the ratio (target <= 1.03).

    python bench/collective.py [--rounds 200] [--iterations 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import ray
import torch

from gradmon_ray.telemetry import TelemetryLayout

NUM_REPORTED, NUM_ACTION = 9, 8


@ray.remote(num_cpus=0)
class Reducer:
    def __init__(self, rank: int, group: str) -> None:
        self.rank, self.group = rank, group

    def setup(self) -> int:
        from ray.util import collective

        collective.init_collective_group(2, self.rank, backend="gloo", group_name=self.group)
        return self.rank

    def run(self, rounds: int) -> dict[str, float]:
        from ray.util import collective

        layout = TelemetryLayout(NUM_REPORTED, NUM_ACTION)
        size = layout.size + 2 + (2 * NUM_REPORTED + 3)  # + checksum digits + noise lanes
        lanes = [slice(i, i + 1) for i in range(layout.num_sum_lanes)]  # one call per scalar metric
        lanes += [layout.logp_nan, layout.logp_inf]  # flags: one call per vector (MAX)
        packed_t, per_metric_t = [], []
        for r in range(rounds):
            buf = torch.rand(size, dtype=torch.float64)
            for variant in ("packed", "per_metric") if r % 2 == 0 else ("per_metric", "packed"):
                start = time.perf_counter()
                if variant == "packed":
                    collective.allreduce(buf, group_name=self.group)
                    packed_t.append(time.perf_counter() - start)
                else:
                    for sl in lanes:
                        collective.allreduce(buf[sl], group_name=self.group)
                    per_metric_t.append(time.perf_counter() - start)
        return {
            "packed_ms": statistics.median(packed_t) * 1e3,
            "per_metric_ms": statistics.median(per_metric_t) * 1e3,
            "calls_per_metric": len(lanes),
            "lanes": size,
        }


def part1(rounds: int) -> None:
    group = f"bench-{time.time_ns()}"
    actors = [Reducer.remote(r, group) for r in range(2)]
    ray.get([a.setup.remote() for a in actors])
    results = ray.get([a.run.remote(rounds) for a in actors])
    r = results[0]
    print(
        f"part 1 (gloo, 2 actors, {r['lanes']} lanes, {rounds} rounds): packed {r['packed_ms']:.3f} ms/iteration, "
        f"per-metric ({r['calls_per_metric']} calls) {r['per_metric_ms']:.3f} ms/iteration, "
        f"ratio per-metric/packed = {r['per_metric_ms'] / r['packed_ms']:.1f}x"
    )


def part2(iterations: int) -> None:
    from gradmon_ray.config import config_from_dict
    from gradmon_ray.rllib import build_ppo_config

    algos = {}
    variants = {
        "reduce on": {"reduce_telemetry": True, "noise_scale": False},
        "reduce off": {"reduce_telemetry": False},
        "reduce+noise": {"reduce_telemetry": True, "noise_scale": True},
    }
    for name, distributed in variants.items():
        cfg = config_from_dict(
            {
                "resources": {"num_learners": 2, "num_env_runners": 1},
                "ppo": {"train_batch_size": 1000, "minibatch_size": 125, "num_epochs": 4},
                "distributed": distributed,
            }
        )
        algos[name] = build_ppo_config(cfg).build_algo()
    times: dict[str, list[float]] = {k: [] for k in algos}
    try:
        for it in range(iterations + 2):
            names = list(algos)[it % 3 :] + list(algos)[: it % 3]
            for name in names:
                start = time.perf_counter()
                algos[name].train()
                if it >= 2:  # first two iterations warm up
                    times[name].append(time.perf_counter() - start)
    finally:
        for algo in algos.values():
            algo.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"part 2 (2-learner PPO, 1000-step batches, {iterations} iterations each, median s/iteration):")
    for name in algos:
        print(f"  {name:13s} {med[name]:.3f}")
    print(f"  ratio reduce on / off            = {med['reduce on'] / med['reduce off']:.3f}  (packed reduction)")
    print(
        f"  ratio reduce+noise / off         = {med['reduce+noise'] / med['reduce off']:.3f}  (+ noise-scale comm hook)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--skip-e2e", action="store_true", help="only part 1")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    ray.init(num_cpus=10, include_dashboard=False, log_to_driver=False)
    try:
        part1(args.rounds)
        if not args.skip_e2e:
            part2(args.iterations)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
