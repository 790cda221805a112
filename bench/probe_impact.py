"""Does the gradient probe slow training?  Env steps per second with the probe off vs on.

Two live PPO algorithms with identical configs, except that one hands every iteration's
batch to its own GradientProbe actor (``probe.gradient_analysis_every: 1``, the actor on
its own CPU, writing to a throwaway sqlite MLflow run).  They are trained alternately in
this process, in alternating order, and the median env steps per second of each is
printed with the ratio on/off (target >= 0.95).

Part 2 isolates the learner's own share: two in-process learners update on the same batch,
alternating, one of them snapshotting and handing off every update to a live probe actor
(the bench waits, untimed, for the previous probe to finish so that no request is dropped);
prints the median update times and their ratio.

    python bench/probe_impact.py [--iterations 12] [--batch 1024] [--rounds 30]
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
from gradmon_ray.probe import start_probe_actor
from gradmon_ray.rllib.config import build_ppo_config, probe_actor_name_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1024, help="env steps per iteration")
    parser.add_argument("--track-grad-norms", action="store_true", help="also probe two regularizers")
    parser.add_argument("--rounds", type=int, default=30, help="part 2: updates per learner")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    tmp = Path(tempfile.mkdtemp())
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("bench")).info.run_id
    algos, probe, outcomes = {}, None, []
    try:
        for name, every in (("probe off", 0), ("probe on", 1)):
            data = {
                "seed": 0,
                "ppo": {"train_batch_size": args.batch, "minibatch_size": 128, "num_epochs": 4},
                "probe": {"gradient_analysis_every": every, "track_grad_norms": args.track_grad_norms and every > 0},
            }
            if args.track_grad_norms:
                data["regularizers"] = [{"name": "logit_l2", "weight": 0.0}, {"name": "weight_l2", "weight": 0.0}]
            cfg = config_from_dict(data)
            ppo_config = build_ppo_config(cfg)
            actor_name = probe_actor_name_of(ppo_config)
            if actor_name is not None:
                probe = start_probe_actor(
                    actor_name,
                    tracking_uri=uri,
                    run_id=run_id,
                    num_buckets=cfg.probe.num_buckets,
                    regularizers=[vars(r) for r in cfg.regularizers],
                    track_grad_norms=cfg.probe.track_grad_norms,
                    num_cpus=cfg.probe.num_cpus,
                )
            algos[name] = ppo_config.build_algo()
        rates: dict[str, list[float]] = {k: [] for k in algos}
        for it in range(args.iterations + 2):
            order = list(algos) if it % 2 == 0 else list(reversed(algos))
            for name in order:
                start = time.perf_counter()
                result = algos[name].train()
                elapsed = time.perf_counter() - start
                steps = result["env_runners"]["num_env_steps_sampled"]
                if it >= 2:  # two warm-up iterations
                    rates[name].append(steps / elapsed)
                if name == "probe on":
                    outcomes.append(result["learners"]["default_policy"])
    finally:
        for algo in algos.values():
            algo.stop()
        if probe is not None:
            ray.get(probe.flush.remote(30.0))
            ray.kill(probe)
        ray.shutdown()
    med = {k: statistics.median(v) for k, v in rates.items()}
    last = outcomes[-1]
    counters = {k.split("/")[1]: int(last[k]) for k in last if str(k).startswith("probe/")}
    durations = [m.value for m in client.get_metric_history(run_id, "probe/duration_s")]
    print(f"{args.iterations} iterations each, {args.batch} env steps per iteration, median env steps/s:")
    for name in algos:
        print(f"  {name:10s} {med[name]:8.1f}")
    print(f"  ratio on/off = {med['probe on'] / med['probe off']:.3f}  (target >= 0.95)")
    print(f"  probe counters: {counters}")
    if durations:
        print(f"  probe analysis time: median {statistics.median(durations) * 1e3:.1f} ms over {len(durations)} probes")
    handoff_cost(args.batch, args.rounds)


def handoff_cost(batch_size: int, rounds: int) -> None:
    """Part 2: the learner-side cost of the hand-off (snapshot, host copy, send)."""
    from gradmon_ray.rllib.standalone import build_local_learner, sample_episodes, train_batch, update

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        data = {"seed": 0, "ppo": {"train_batch_size": batch_size, "minibatch_size": 128, "num_epochs": 4}}
        off = config_from_dict(data)
        on = config_from_dict({**data, "probe": {"gradient_analysis_every": 1}})
        learners = {"probe off": build_local_learner(off), "probe on": build_local_learner(on)}
        probe = start_probe_actor(learners["probe on"]._probe.actor_name, tracking_uri=None, run_id=None, num_buckets=4)
        batch = train_batch(learners["probe off"], sample_episodes(off, learners["probe off"], batch_size))
        times: dict[str, list[float]] = {k: [] for k in learners}
        for r in range(rounds + 3):
            for name in list(learners) if r % 2 == 0 else list(reversed(learners)):
                while learners["probe on"]._probe.busy:  # untimed: every "on" update really hands off
                    time.sleep(0.005)
                start = time.perf_counter()
                update(learners[name], batch, off)
                if r >= 3:
                    times[name].append(time.perf_counter() - start)
        counters = learners["probe on"]._probe.counters
        ray.kill(probe)
    finally:
        ray.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"part 2 (in-process learners, same {batch_size}-step batch, {rounds} updates each, median update):")
    for name in learners:
        print(f"  {name:10s} {med[name] * 1e3:8.2f} ms")
    print(f"  ratio on/off = {med['probe on'] / med['probe off']:.3f}   probe counters: {counters}")


if __name__ == "__main__":
    main()
