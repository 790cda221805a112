"""Do the MLflow plots slow training?  Env steps per second with plots drawn every iteration vs never.

Two live PPO algorithms with identical configs are trained alternately in this process (in
alternating order). Each logs every iteration's telemetry through its own ``MlflowSink`` into
a throwaway sqlite store: one with ``plots_every=1`` (``--every``; the worst case, the default
is 10) and ``plot_fn=log_plots``, one with ``plots_every=0``.

How the sinks' asynchronous work is accounted: ``log_iteration`` only queues; the sink's
thread writes the metrics and, on a plotting iteration, draws the plots (history read back,
2 PNGs, artifact upload) after the write.  Left alone, that thread would keep drawing
during the *other* arm's timed window (on 2 cores it competes with it) and push the ratio
towards 1.0.  So each arm's timed window ends only when its own sink is idle again:
``MlflowSink.flush()`` (waits until everything queued is written; it returns before the
drawing, which follows the write on the same thread) and then a wait for the drawing this
iteration triggered, seen through the ``plot_fn`` the bench hands the sink (``log_plots``
wrapped to count finished drawings; the sink has no call that waits for a drawing).  Both
arms are drained the same way (the no-plots arm's sink still writes metrics).

Two figures per arm, both printed: ``drained`` (steps / time until the arm's sink was idle:
all the writing and drawing charged to training, the right figure when the machine has no
spare core) and ``foreground`` (steps / time until ``log_iteration`` returned: what the
training loop sees when the sink thread has a core of its own).  The ``tail`` (drained -
foreground) is the sink work that did not overlap its own arm's iteration.  The iterations
run in ``--repeats`` repetitions; ratios are computed per repetition and printed as
``ratio <name> median <x> min <y> max <z>``.  Then it times one drawing of the run at its
final length.

    python bench/plots_impact.py [--iterations 6] [--repeats 3] [--batch 1024] [--every 1]
    python bench/plots_impact.py --quick    # smoke run: 1 iteration, 256-step batches
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import ray
from mlflow.tracking import MlflowClient

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.config import build_ppo_config
from gradmon_ray.tracking import MlflowSink, result_to_metrics
from gradmon_ray.viz.report import log_plots

DRAIN_TIMEOUT_S = 300.0


class CountingPlotter:
    """``log_plots`` that counts finished drawings and records their duration (the sink's ``plot_fn``)."""

    def __init__(self) -> None:
        self.done = 0
        self.seconds: list[float] = []
        self._cond = threading.Condition()

    def __call__(self, client: Any, run_id: str) -> list[str]:
        start = time.perf_counter()
        try:
            return log_plots(client, run_id)
        finally:
            with self._cond:
                self.done += 1
                self.seconds.append(time.perf_counter() - start)
                self._cond.notify_all()

    def wait_for(self, count: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.done >= count, timeout_s)


def _ratio(name: str, values: list[float]) -> None:
    print(
        f"ratio {name} median {statistics.median(values):.3f} min {min(values):.3f} max {max(values):.3f}", flush=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6, help="timed iterations per arm per repetition")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions (>= 3: min and max mean something)")
    parser.add_argument("--batch", type=int, default=1024, help="env steps per iteration")
    parser.add_argument("--every", type=int, default=1, help="plots_every of the plotting variant (default 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 iteration, 256-step batches")
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.batch = 1, 256
    warnings.filterwarnings("ignore")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    uri = f"sqlite:///{Path(tempfile.mkdtemp()) / 'mlflow.db'}"
    cfg = config_from_dict({"seed": 0, "ppo": {"train_batch_size": args.batch, "minibatch_size": min(128, args.batch)}})
    plotting = f"plots every {args.every}"
    variants = {"no plots": 0, plotting: args.every}
    names = list(variants)
    plotter = CountingPlotter()
    algos = {name: build_ppo_config(cfg).build_algo() for name in variants}
    sinks = {
        name: MlflowSink(uri, "bench", run_name=name, plots_every=every, plot_fn=plotter if every else None)
        for name, every in variants.items()
    }
    draws_expected = 0
    per_repeat: list[dict[str, float]] = []
    step = 0
    warm_draws = 0

    def window(name: str) -> tuple[float, float, float]:
        """(env steps, foreground s, drained s) of one iteration of arm ``name``."""
        nonlocal draws_expected
        start = time.perf_counter()
        result = algos[name].train()
        sinks[name].log_iteration(step, result_to_metrics(result))  # what run_training does
        foreground = time.perf_counter() - start
        if not sinks[name].flush(DRAIN_TIMEOUT_S):
            raise RuntimeError(f"{name}: the sink did not write within {DRAIN_TIMEOUT_S:.0f} s")
        if variants[name] and step % variants[name] == 0:
            # The sink was idle when this iteration was queued (the previous window drained it),
            # so this write is a batch of its own and triggers exactly one drawing.
            draws_expected += 1
            if not plotter.wait_for(draws_expected, DRAIN_TIMEOUT_S):
                raise RuntimeError(f"{name}: the drawing did not finish within {DRAIN_TIMEOUT_S:.0f} s")
        drained = time.perf_counter() - start
        return result["env_runners"]["num_env_steps_sampled"], foreground, drained

    try:
        for _ in range(2):  # warm-up, untimed
            step += 1
            for name in names:
                window(name)
        warm_draws = draws_expected
        for _ in range(args.repeats):
            fg: dict[str, list[float]] = {k: [] for k in names}
            dr: dict[str, list[float]] = {k: [] for k in names}
            tail: dict[str, list[float]] = {k: [] for k in names}
            for it in range(args.iterations):
                step += 1
                for name in names if it % 2 == 0 else names[::-1]:
                    steps, foreground, drained = window(name)
                    fg[name].append(steps / foreground)
                    dr[name].append(steps / drained)
                    tail[name].append(drained - foreground)
            per_repeat.append(
                {
                    **{f"fg {k}": statistics.median(v) for k, v in fg.items()},
                    **{f"dr {k}": statistics.median(v) for k, v in dr.items()},
                    **{f"tail {k}": statistics.median(v) for k, v in tail.items()},
                }
            )
    finally:
        for algo in algos.values():
            algo.stop()
        for sink in sinks.values():
            sink.close(timeout_s=120)
        ray.shutdown()

    def med(key: str) -> float:
        return statistics.median([p[key] for p in per_repeat])

    print(
        f"{args.repeats} x {args.iterations} iterations per arm, {args.batch} env steps per iteration, "
        "env steps/s (median over repetitions of per-repetition medians):"
    )
    for name in names:
        print(
            f"  {name:18s} drained {med('dr ' + name):8.1f}   foreground {med('fg ' + name):8.1f}   "
            f"tail after log_iteration {med('tail ' + name) * 1e3:7.1f} ms"
        )
    drawings = plotter.seconds[warm_draws:draws_expected]
    if drawings:
        print(f"  drawings in the timed windows: median {statistics.median(drawings) * 1e3:.0f} ms ({len(drawings)})")
    print(f"  plot failures: {sinks[plotting].plot_failures}")
    _ratio("steps_per_s:plots/no-plots:drained", [p[f"dr {plotting}"] / p["dr no plots"] for p in per_repeat])
    _ratio("steps_per_s:plots/no-plots:foreground", [p[f"fg {plotting}"] / p["fg no plots"] for p in per_repeat])
    client = MlflowClient(uri)
    run_id = sinks[plotting].run_id
    draws = []
    for _ in range(5):
        start = time.perf_counter()
        log_plots(client, run_id)
        draws.append(time.perf_counter() - start)
    print(f"  one drawing at {step} iterations x 9 heads: median {statistics.median(draws) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
