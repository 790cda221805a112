"""Cost of the cross-learner telemetry reduction against RLlib's own metrics aggregation, side by side.

Part 1 (the reduction alone, one step of the 9-head telemetry): ``--world-size`` Ray actors
stand in for the learners and run gradmon's own code on a filled ``IterationAccumulator``
(4 minibatches' worth of lanes, plus the checksum and noise-scale lanes that ride along).
Per round the driver asks every actor for one telemetry step and waits for all of them; the
arms, in alternating order each round (same actors, same process):

* ``rllib-aggregate``: what happens without the packed reduction (``reduce_telemetry: false``,
  and what RLlib itself offers): each rank copies its *local* lanes to the host once
  (``reduce_iteration`` with no collective), turns them into the metrics dict
  (``TelemetryTracker.finish_iteration(...).to_metrics()``), logs every metric into its
  ``MetricsLogger`` with the learner's keys and ``window=1`` and returns
  ``MetricsLogger.reduce()`` through Ray, exactly what ``Learner.update`` returns; the driver
  merges the returned dicts with RLlib's ``MetricsLogger(root=True).aggregate(results,
  key="learners")`` and ``compile()``, as ``PPO.training_step`` and ``Algorithm.step`` do.
  (RLlib means every metric over the learners, so counts and NaN/Inf flags come out as means,
  not sums or ORs, and per-head norms as means of per-learner means: this baseline is cheaper
  than an exact one would be.)
* ``packed``: the packed collective and its one host copy alone: ``reduce_iteration`` with a
  gloo ``LearnerCollective`` (ONE SUM allreduce of the whole buffer); each rank returns the
  merged lanes, the driver takes them as they are.
* ``packed+rllib``: what gradmon does with ``reduce_telemetry: true``: the packed collective
  and host copy, then the same metrics dict, ``MetricsLogger`` logging and driver-side
  aggregation as ``rllib-aggregate`` (the reduced values still travel through RLlib's path).

Times: each rank times its own share (from the start of the step to the return value, the
collective's wait for the slowest peer included) and reports every round; printed per rank
(median) and as the max over ranks.  The driver times each round end to end (dispatch to
every rank, results back through Ray, aggregation).  The whole set of rounds is repeated
``--repeats`` times; every ratio is computed per repetition and printed as
``ratio <name> median <x> min <y> max <z>`` over the repetitions.

Part 2: end-to-end iteration time of 2-learner PPO with the packed reduction on vs off
(``distributed.reduce_telemetry``), three live algorithms trained in rotating order in this
process; per repetition the median iteration time of each, and the ratios to "reduce off".

    python bench/collective.py [--rounds 200] [--repeats 3] [--iterations 4] [--world-size 2] [--skip-e2e]
    python bench/collective.py --quick    # smoke run: 20 rounds, 1 iteration per repetition
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import numpy as np
import ray
import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.utils.metrics import LEARNER_RESULTS
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from gradmon_ray.distributed import LearnerCollective, reduce_iteration
from gradmon_ray.telemetry import GradientNorms, IterationAccumulator, TelemetryTracker
from gradmon_ray.telemetry.noise_scale import noise_lane_count

NUM_ACTION = 8
HEADS = [f"h{i}" for i in range(NUM_ACTION)] + ["value"]  # 9 reported heads, 8 latch heads
MINIBATCHES = 4
ARMS = ("rllib-aggregate", "packed", "packed+rllib")
RLLIB_ARMS = ("rllib-aggregate", "packed+rllib")


@ray.remote(num_cpus=0)
class TelemetryRank:
    """One learner's telemetry step, per arm (each arm keeps its own tracker and logger, like its own learner)."""

    def __init__(self, rank: int, world_size: int, group: str) -> None:
        self.rank = rank
        self.reducing = LearnerCollective(group, world_size, rank, "gloo", torch.device("cpu"))
        self.local_only = LearnerCollective(f"{group}-unused", 1, 0, "gloo", torch.device("cpu"))  # inactive
        self.trackers = {arm: TelemetryTracker(HEADS, HEADS[:-1]) for arm in ARMS}
        self.accumulators = {arm: IterationAccumulator(self.trackers[arm].layout) for arm in ARMS}
        self.loggers = {arm: MetricsLogger() for arm in RLLIB_ARMS}
        self.times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        self._gen = torch.Generator().manual_seed(rank)

    def setup(self) -> int:
        """Create the gloo group (every rank must call this concurrently)."""
        self.reducing.allreduce_sum(torch.zeros(1, dtype=torch.float64))
        return self.rank

    def _fill(self, arm: str) -> None:
        """What the minibatches leave in the accumulator (untimed: identical in every arm)."""
        for _ in range(MINIBATCHES):
            norms = GradientNorms(
                head_norms=torch.rand(len(HEADS), generator=self._gen, dtype=torch.float32),
                global_norm=torch.rand((), generator=self._gen, dtype=torch.float32),
                nan_count=torch.zeros(()),
                inf_count=torch.zeros(()),
            )
            flags = torch.zeros(NUM_ACTION)
            self.accumulators[arm].add_minibatch(norms, flags, flags, torch.zeros(()))

    def step(self, arm: str) -> Any:
        self._fill(arm)
        checksum = torch.zeros(2, dtype=torch.float64)
        noise = torch.rand(noise_lane_count(len(HEADS)), generator=self._gen, dtype=torch.float64)
        empty = torch.zeros(0, dtype=torch.float64)
        collective = self.local_only if arm == "rllib-aggregate" else self.reducing
        start = time.perf_counter()
        reduced = reduce_iteration(self.accumulators[arm], collective, checksum=checksum, noise=noise, local=empty)
        if arm == "packed":
            out: Any = reduced.lanes
        else:
            logger = self.loggers[arm]
            for name, value in self.trackers[arm].finish_iteration(reduced.lanes).to_metrics().items():
                logger.log_value((DEFAULT_MODULE_ID, name), value, window=1)  # as GradmonReporting does
            out = logger.reduce()  # what Learner.update returns
        self.times[arm].append(time.perf_counter() - start)
        return out

    def take_times(self) -> dict[str, list[float]]:
        times, self.times = self.times, {arm: [] for arm in ARMS}
        return times


def part1(rounds: int, repeats: int, world_size: int) -> None:
    group = f"bench-{time.time_ns()}"
    ranks = [TelemetryRank.remote(r, world_size, group) for r in range(world_size)]
    ray.get([a.setup.remote() for a in ranks])
    roots = {arm: MetricsLogger(root=True) for arm in RLLIB_ARMS}  # the driver's, one per "algorithm"
    num_metrics = 0

    def round_trip(arm: str) -> tuple[float, float]:
        nonlocal num_metrics
        start = time.perf_counter()
        results = ray.get([a.step.remote(arm) for a in ranks])
        got = time.perf_counter()
        if arm in roots:
            roots[arm].aggregate(results, key=LEARNER_RESULTS)
            compiled = roots[arm].compile()
            num_metrics = len(compiled[LEARNER_RESULTS][DEFAULT_MODULE_ID])
        else:
            assert isinstance(results[0], np.ndarray)
        end = time.perf_counter()
        return end - start, end - got

    for _ in range(10):  # warm-up, untimed
        for arm in ARMS:
            round_trip(arm)
    ray.get([a.take_times.remote() for a in ranks])
    per_repeat: list[dict[str, Any]] = []
    for _ in range(repeats):
        e2e: dict[str, list[float]] = {arm: [] for arm in ARMS}
        agg: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for r in range(rounds):
            for arm in ARMS[r % 3 :] + ARMS[: r % 3]:
                total, driver_side = round_trip(arm)
                e2e[arm].append(total)
                agg[arm].append(driver_side)
        rank_times = ray.get([a.take_times.remote() for a in ranks])
        per_rank = {arm: [statistics.median(t[arm]) for t in rank_times] for arm in ARMS}
        per_repeat.append(
            {
                "e2e": {arm: statistics.median(v) for arm, v in e2e.items()},
                "driver": {arm: statistics.median(v) for arm, v in agg.items()},
                "per_rank": per_rank,
                "rank_max": {arm: max(v) for arm, v in per_rank.items()},
            }
        )
    for a in ranks:
        ray.kill(a)

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:.3f} ms (min {min(values) * 1e3:.3f}, max {max(values) * 1e3:.3f})"

    print(
        f"part 1 (gloo, {world_size} ranks, {len(HEADS)} heads, {num_metrics} metrics per learner, "
        f"{repeats} x {rounds} rounds per arm; medians over repetitions):"
    )
    for arm in ARMS:
        ranks_txt = ", ".join(
            f"rank {k} {statistics.median([p['per_rank'][arm][k] for p in per_repeat]) * 1e3:.3f}"
            for k in range(world_size)
        )
        rank_max = ms([p["rank_max"][arm] for p in per_repeat])
        print(f"  {arm:16s} per rank (ms, median): {ranks_txt}; max over ranks {rank_max}")
        print(
            f"  {'':16s} end to end at the driver {ms([p['e2e'][arm] for p in per_repeat])}, "
            f"of which driver-side aggregation {ms([p['driver'][arm] for p in per_repeat])}"
        )
    for scope in ("e2e", "rank_max"):
        for num, den in (("rllib-aggregate", "packed"), ("packed+rllib", "rllib-aggregate")):
            _ratio(f"{scope}:{num}/{den}", [p[scope][num] / p[scope][den] for p in per_repeat])


def _ratio(name: str, values: list[float]) -> None:
    print(
        f"ratio {name} median {statistics.median(values):.3f} min {min(values):.3f} max {max(values):.3f}", flush=True
    )


def part2(iterations: int, repeats: int) -> None:
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
    names = list(algos)
    per_repeat: list[dict[str, float]] = []
    try:
        for _ in range(2):  # warm-up, untimed
            for name in names:
                algos[name].train()
        for _ in range(repeats):
            times: dict[str, list[float]] = {k: [] for k in names}
            for it in range(iterations):
                for name in names[it % 3 :] + names[: it % 3]:
                    start = time.perf_counter()
                    algos[name].train()  # synchronous: nothing of this arm runs on after it returns
                    times[name].append(time.perf_counter() - start)
            per_repeat.append({k: statistics.median(v) for k, v in times.items()})
    finally:
        for algo in algos.values():
            algo.stop()
    print(
        f"part 2 (2-learner PPO, 1000-step batches, {repeats} x {iterations} iterations each, "
        "median s/iteration, median over repetitions):"
    )
    for name in names:
        print(f"  {name:13s} {statistics.median([p[name] for p in per_repeat]):.3f}")
    _ratio("iteration:reduce-on/reduce-off", [p["reduce on"] / p["reduce off"] for p in per_repeat])
    _ratio("iteration:reduce+noise/reduce-off", [p["reduce+noise"] / p["reduce off"] for p in per_repeat])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="part 1: rounds per arm per repetition")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions (>= 3: min and max mean something)")
    parser.add_argument("--iterations", type=int, default=4, help="part 2: iterations per arm per repetition")
    parser.add_argument("--world-size", type=int, default=2, help="part 1: number of ranks")
    parser.add_argument("--skip-e2e", action="store_true", help="only part 1")
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 rounds, 1 iteration per repetition")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.iterations = 20, 1
    warnings.filterwarnings("ignore")
    ray.init(num_cpus=10, include_dashboard=False, log_to_driver=False)
    try:
        part1(args.rounds, args.repeats, args.world_size)
        if not args.skip_e2e:
            part2(args.iterations, args.repeats)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
