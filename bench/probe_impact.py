"""Does the gradient probe slow training?  Env steps per second with the probe off vs on.

Two live PPO algorithms with identical configs, except that one hands every iteration's
batch to its own GradientProbe actor (``probe.gradient_analysis_every: 1``, the actor on
its own CPU, writing to a throwaway sqlite MLflow run).  They are trained alternately in
this process, in alternating order.

How the probe's asynchronous work is accounted: the learner hands the request off at the
end of its update and never waits; the actor then analyses the batch and writes the
metrics through its own asynchronous ``MlflowSink``.  Left alone, that work would run on
during the *other* arm's timed window (on 2 cores it competes with it) and push the ratio
towards 1.0.  So the "probe on" arm's timed window ends only when all of its work is done:
after ``train()`` returns, the bench waits for the learner's in-flight probe through the
learner's own ``ProbeClient.finish()`` (what the end of a run does; it also collects the
outcome into the counters) and then for the actor's MLflow writes with
``GradientProbe.flush()`` (a call queued behind the analysis: the actor runs one call at a
time).  Nothing of one arm is left running when the next arm's window starts, and every
iteration's probe really runs (none is dropped as "previous still busy").

Two figures per arm, both printed: ``drained`` (steps / time until the arm's async work
finished: all the probe's work charged to training, the right figure when the machine has
no spare core) and ``foreground`` (steps / time until ``train()`` returned: what training
sees when the probe has a core of its own).  The ``tail`` (drained - foreground) is the
probe work that did not overlap its own arm's ``train()``; it is reported with the probe's
own analysis time, so the measured overlap is visible.  The iterations run in
``--repeats`` repetitions; ratios are computed per repetition and printed as
``ratio <name> median <x> min <y> max <z>`` (target on/off >= 0.95).

Part 2 isolates the learner's own share: two in-process learners update on the same batch,
alternating, one of them snapshotting and handing off every update to a live probe actor.
Its window likewise ends only once the probe it handed off has finished (``finish()``),
so the probe never runs during the other learner's update; the hand-off alone (update
returned) and the drained time are both printed, with ratios.

    python bench/probe_impact.py [--iterations 6] [--repeats 3] [--batch 1024] [--rounds 10]
    python bench/probe_impact.py --quick    # smoke run: 1 iteration, 2 rounds, 256-step batches
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import ray
from mlflow.tracking import MlflowClient

from gradmon_ray.config import config_from_dict
from gradmon_ray.probe import start_probe_actor
from gradmon_ray.rllib.config import build_ppo_config, probe_actor_name_of

DRAIN_TIMEOUT_S = 300.0


def _finish_probe(learner: Any) -> tuple[float, dict[str, int]] | None:
    """On the learner: wait for its probe in flight; (analysis seconds of the last probe, counters)."""
    client = getattr(learner, "_probe", None)
    if client is None:  # not rank 0, or no probe
        return None
    if not client.finish(DRAIN_TIMEOUT_S):
        raise RuntimeError(f"the probe did not finish within {DRAIN_TIMEOUT_S:.0f} s")
    outcome = client.last_outcome
    return (outcome.duration_s if outcome is not None else float("nan")), dict(client.counters)


def drain_probe(algo: Any, probe: Any) -> tuple[float, dict[str, int]]:
    """Wait until the probe work this arm started is done: the analysis, then the actor's MLflow writes."""
    results = [r.get() for r in algo.learner_group.foreach_learner(_finish_probe)]
    analysis_s, counters = next(r for r in results if r is not None)
    if not ray.get(probe.flush.remote(DRAIN_TIMEOUT_S)):
        raise RuntimeError("the probe actor's MLflow writes did not finish")
    return analysis_s, counters


def _ratio(name: str, values: list[float]) -> None:
    print(
        f"ratio {name} median {statistics.median(values):.3f} min {min(values):.3f} max {max(values):.3f}", flush=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6, help="timed iterations per arm per repetition")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions (>= 3: min and max mean something)")
    parser.add_argument("--batch", type=int, default=1024, help="env steps per iteration")
    parser.add_argument("--track-grad-norms", action="store_true", help="also probe two regularizers")
    parser.add_argument("--rounds", type=int, default=10, help="part 2: updates per learner per repetition")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 iteration, 2 rounds, 256-step batches")
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.rounds, args.batch = 1, 2, 256
    warnings.filterwarnings("ignore")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    tmp = Path(tempfile.mkdtemp())
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("bench")).info.run_id
    algos, probe = {}, None
    counters: dict[str, int] = {}
    analysis: list[float] = []
    per_repeat: list[dict[str, float]] = []
    try:
        for name, every in (("probe off", 0), ("probe on", 1)):
            data = {
                "seed": 0,
                "ppo": {"train_batch_size": args.batch, "minibatch_size": min(128, args.batch), "num_epochs": 4},
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
        names = list(algos)

        def window(name: str) -> tuple[float, float, float]:
            """(env steps, foreground s, drained s) of one iteration of arm ``name``."""
            nonlocal counters
            start = time.perf_counter()
            result = algos[name].train()
            foreground = time.perf_counter() - start
            if name == "probe on":
                analysis_s, counters = drain_probe(algos[name], probe)
                analysis.append(analysis_s)
            drained = time.perf_counter() - start
            return result["env_runners"]["num_env_steps_sampled"], foreground, drained

        for _ in range(2):  # warm-up, untimed
            for name in names:
                window(name)
        analysis.clear()
        for _ in range(args.repeats):
            fg: dict[str, list[float]] = {k: [] for k in names}
            dr: dict[str, list[float]] = {k: [] for k in names}
            tail: list[float] = []
            for it in range(args.iterations):
                for name in names if it % 2 == 0 else names[::-1]:
                    steps, foreground, drained = window(name)
                    fg[name].append(steps / foreground)
                    dr[name].append(steps / drained)
                    if name == "probe on":
                        tail.append(drained - foreground)
            per_repeat.append(
                {
                    **{f"fg {k}": statistics.median(v) for k, v in fg.items()},
                    **{f"dr {k}": statistics.median(v) for k, v in dr.items()},
                    "tail": statistics.median(tail),
                }
            )
    finally:
        for algo in algos.values():
            algo.stop()
        if probe is not None:
            ray.get(probe.flush.remote(30.0))
            ray.kill(probe)
        ray.shutdown()

    def med(key: str) -> float:
        return statistics.median([p[key] for p in per_repeat])

    print(
        f"{args.repeats} x {args.iterations} iterations per arm, {args.batch} env steps per iteration, "
        "env steps/s (median over repetitions of per-repetition medians):"
    )
    for name in names:
        print(f"  {name:10s} drained {med('dr ' + name):8.1f}   foreground {med('fg ' + name):8.1f}")
    print(
        f"  probe tail after train() (probe work not overlapped by its own arm): median {med('tail') * 1e3:.1f} ms; "
        f"probe analysis: median {statistics.median(analysis) * 1e3:.1f} ms over {len(analysis)} probes"
    )
    print(f"  probe counters: {counters}")
    _ratio("steps_per_s:probe-on/probe-off:drained", [p["dr probe on"] / p["dr probe off"] for p in per_repeat])
    _ratio("steps_per_s:probe-on/probe-off:foreground", [p["fg probe on"] / p["fg probe off"] for p in per_repeat])
    handoff_cost(args.batch, args.rounds, args.repeats)


def handoff_cost(batch_size: int, rounds: int, repeats: int) -> None:
    """Part 2: the learner-side cost of the hand-off (snapshot, host copy, send), and of the probe drained."""
    from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    per_repeat: list[dict[str, float]] = []
    try:
        ppo = {"train_batch_size": batch_size, "minibatch_size": min(128, batch_size), "num_epochs": 4}
        data = {"seed": 0, "ppo": ppo}
        off = config_from_dict(data)
        on = config_from_dict({**data, "probe": {"gradient_analysis_every": 1}})
        learners = {"probe off": build_local_learner(off), "probe on": build_local_learner(on)}
        probe = start_probe_actor(learners["probe on"]._probe.actor_name, tracking_uri=None, run_id=None, num_buckets=4)
        batch = train_batch(learners["probe off"], sample_episodes(off, learners["probe off"], batch_size))
        names = list(learners)

        def window(name: str) -> tuple[float, float]:
            start = time.perf_counter()
            update(learners[name], batch, off)
            handoff = time.perf_counter() - start
            _finish_probe(learners[name])  # the probe this update handed off belongs to this window
            return handoff, time.perf_counter() - start

        for _ in range(3):  # warm-up, untimed
            for name in names:
                window(name)
        for _ in range(repeats):
            times: dict[str, list[float]] = {f"{kind} {k}": [] for k in names for kind in ("handoff", "drained")}
            for r in range(rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    handoff, drained = window(name)
                    times[f"handoff {name}"].append(handoff)
                    times[f"drained {name}"].append(drained)
            per_repeat.append({k: statistics.median(v) for k, v in times.items()})
        counters = learners["probe on"]._probe.counters
        ray.kill(probe)
    finally:
        ray.shutdown()

    def med(key: str) -> float:
        return statistics.median([p[key] for p in per_repeat])

    print(
        f"part 2 (in-process learners, same {batch_size}-step batch, {repeats} x {rounds} updates each, "
        "median update, median over repetitions):"
    )
    for name in names:
        print(
            f"  {name:10s} until update returned {med('handoff ' + name) * 1e3:8.2f} ms   "
            f"until its probe finished {med('drained ' + name) * 1e3:8.2f} ms"
        )
    print(f"  probe counters: {counters}")
    _ratio("update:probe-on/probe-off:handoff", [p["handoff probe on"] / p["handoff probe off"] for p in per_repeat])
    _ratio("update:probe-on/probe-off:drained", [p["drained probe on"] / p["drained probe off"] for p in per_repeat])


if __name__ == "__main__":
    main()
