"""Where the telemetry's own cost goes: each piece's wall time inside a real learner update.

``bench/telemetry_overhead.py`` measures the whole cost (gradmon / telemetry off, paired); this
script splits it.  Two learners (``gradmon`` with full telemetry, ``off`` with telemetry
disabled) update on the same batch, alternating, and each telemetry piece is wrapped in a
``time.perf_counter`` timer for the run (instrumentation only: the wrappers add ~0.3 us a call,
counted inside each piece):

* per update (the drain, gradmon only): head entropy/KL of the last minibatch, the fold of the
  minibatch records with the log-prob NaN/Inf check, the whole packed reduction + host copy
  (``reduce_step``, which contains the two before), the host summary (``finish_iteration``),
  its metric names (``to_metrics``), logging them into RLlib's ``MetricsLogger``;
* RLlib's ``MetricsLogger.reduce`` at the end of each update, for each learner: the
  difference is what gradmon's ~90 values add;
* per minibatch (gradmon only): keeping the log-probs, the head-health inputs, the record.

Printed: each piece's median over updates in us and as a share of off's median update, and
their sum beside the measured per-update difference.  Usage:

    python bench/telemetry_pieces.py [--updates 40] [--trunk 128 128]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from gradmon_ray.config import GradmonConfig
from gradmon_ray.rllib import head_health, module_telemetry
from gradmon_ray.rllib import monitor_step as reporting
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update
from gradmon_ray.telemetry import accumulator
from gradmon_ray.telemetry import tracker as summary

# (owner, method, label, per): "update" pieces run once per update, "minibatch" ones per minibatch.
PIECES = [
    (head_health.HeadHealthRecorder, "lanes", "head entropy/KL (last minibatch)", "update"),
    (accumulator.IterationAccumulator, "_fold_records", "fold + log-prob NaN/Inf check", "update"),
    (reporting.GradmonReporting, "_reduce_step", "packed reduction + host copy (incl. the two above)", "update"),
    (summary.TelemetryTracker, "finish_iteration", "host summary", "update"),
    (summary.IterationTelemetry, "to_metrics", "metric names", "update"),
    (reporting.GradmonReporting, "_log_gradmon_metrics", "logging them into RLlib's MetricsLogger", "update"),
    (module_telemetry.ModuleTelemetry, "record_logp", "keep log-probs", "minibatch"),
    (module_telemetry.ModuleTelemetry, "record_head_inputs", "keep head-health inputs", "minibatch"),
    (accumulator.IterationAccumulator, "add_minibatch_logp", "record the minibatch", "minibatch"),
]


def _timed(fn: Callable[..., Any], record: Callable[[float], None]) -> Callable[..., Any]:
    """``fn`` with each call's wall time handed to ``record`` (seconds)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record(time.perf_counter() - start)

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=40, help="timed updates per learner")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--trunk", type=int, nargs="+", default=None, help="trunk widths (default: the config's)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    cfg = GradmonConfig()
    if args.trunk:
        cfg.model.trunk_hiddens = list(args.trunk)
    off_cfg = cfg.model_copy(deep=True)
    off_cfg.telemetry.enabled = False
    learners = {"gradmon": build_local_learner(cfg), "off": build_local_learner(off_cfg)}
    batch = train_batch(learners["gradmon"], sample_episodes(cfg, learners["gradmon"], cfg.ppo.train_batch_size))

    current = {"arm": ""}
    recording = {"on": False}
    samples: dict[str, list[float]] = defaultdict(list)
    reduce_samples: dict[str, list[float]] = defaultdict(list)
    for owner, name, label, _ in PIECES:

        def record_piece(seconds: float, label: str = label) -> None:
            if recording["on"] and current["arm"] == "gradmon":  # the off learner still logs a few values
                samples[label].append(seconds)

        setattr(owner, name, _timed(getattr(owner, name), record_piece))

    def record_reduce(seconds: float) -> None:
        if recording["on"]:
            reduce_samples[current["arm"]].append(seconds)

    MetricsLogger.reduce = _timed(MetricsLogger.reduce, record_reduce)  # type: ignore[method-assign]

    def one_update(arm: str) -> float:
        current["arm"] = arm
        start = time.perf_counter()
        update(learners[arm], batch, cfg)
        return time.perf_counter() - start

    for _ in range(args.warmup):
        for arm in learners:
            one_update(arm)
    recording["on"] = True
    totals: dict[str, list[float]] = {arm: [] for arm in learners}
    for i in range(args.updates):
        for arm in ("gradmon", "off") if i % 2 else ("off", "gradmon"):
            totals[arm].append(one_update(arm))
    recording["on"] = False

    minibatches = learners["gradmon"].last_telemetry.minibatches
    off_update = statistics.median(totals["off"])
    ratio = statistics.median(g / o for g, o in zip(totals["gradmon"], totals["off"], strict=True))
    print(
        f"trunk={cfg.model.trunk_hiddens} minibatches/update={minibatches} updates={args.updates}; "
        f"median update: gradmon {statistics.median(totals['gradmon']) * 1e3:.2f} ms, off {off_update * 1e3:.2f} ms; "
        f"paired ratio gradmon/off {ratio:.4f} = {(ratio - 1) * off_update * 1e6:.0f} us per update"
    )
    accounted = 0.0
    for _, _, label, per in PIECES:
        values = samples[label]
        if not values:
            continue
        each = statistics.median(values)
        per_update = each * (minibatches if per == "minibatch" else 1)
        if label not in ("head entropy/KL (last minibatch)", "fold + log-prob NaN/Inf check"):
            accounted += per_update  # the two are inside the packed reduction
        suffix = f" ({each * 1e6:.2f} us x {minibatches} minibatches)" if per == "minibatch" else ""
        print(f"  {label:52s} {per_update * 1e6:8.1f} us  {per_update / off_update * 100:6.3f}%{suffix}")
    extra_reduce = statistics.median(reduce_samples["gradmon"]) - statistics.median(reduce_samples["off"])
    accounted += extra_reduce
    print(
        f"  {'RLlib MetricsLogger.reduce: gradmon minus off':52s} {extra_reduce * 1e6:8.1f} us  "
        f"{extra_reduce / off_update * 100:6.3f}%"
    )
    print(f"  {'sum of the pieces':52s} {accounted * 1e6:8.1f} us  {accounted / off_update * 100:6.3f}%")


if __name__ == "__main__":
    main()
