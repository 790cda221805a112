"""A real MLflow sqlite run with hand-picked telemetry, so every cell of the panel, every
pixel-column of the heatmap and every line of the report has a known expected value."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.trends import trend_arrow

NAN = float("nan")
NORMS: dict[str, list[float]] = {
    "op": [0.5, 0.6, 0.7],  # healthy, rising
    "slot": [0.005, 0.005, 0.005],  # dead, flat
    "tempo": [9.0, 8.0, 7.0],  # exploding, falling
    "a3": [0.05, 0.05, 0.05],  # weak
    "a4": [3.0, 3.0, 3.0],  # elevated
    "a5": [1.0, 1.0, NAN],  # missing at the end
    "a6": [1.0, 1.0, 1.0],  # NaN latch from iteration 2
    "a7": [1.5, 1.5, 1.5],  # Inf latch from iteration 3
    "value": [0.8, 0.8, 0.8],
}
HEADS = list(NORMS)
NAN_LATCH = {"a6": [0.0, 1.0, 1.0]}
INF_LATCH = {"a7": [0.0, 0.0, 1.0]}
VGS_SCALE = [1.0, 0.7, 0.5]
NOISE = {"op": [10.0, 11.0, 12.5]}
PROBE_STEP = 2
PROBE = {
    "bucket_1": {"task": 0.3, "entropy": 0.02},
    "bucket_2": {"task": 0.5, "entropy": 0.04},
}
PROBE_SHARES = {"bucket_1": {"task": 0.9, "entropy": 0.1}, "bucket_2": {"task": 0.8, "entropy": 0.2}}


def artifacts_beside(tracking_uri: str) -> str:
    """An artifact folder next to the sqlite store: MLflow's default, ``./mlruns``, is the working
    directory's (the repository's when pytest runs there)."""
    return str(Path(tracking_uri.removeprefix("sqlite:///")).parent / "artifacts")


@dataclass
class KnownRun:
    tracking_uri: str
    run_id: str
    experiment: str


def make_known_run(
    tracking_uri: str,
    experiment: str = "viz",
    with_probe: bool = True,
    log_order: Sequence[str] | None = None,
    head_names_tag: Sequence[str] | None = tuple(HEADS),
) -> KnownRun:
    """``log_order``: the heads' metrics are logged in this order (default: ``HEADS``);
    ``head_names_tag``: the ``gradmon.head_names`` tag's heads (None: no tag, as in an old run)."""
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        exp_id = client.create_experiment(experiment, artifact_location=artifacts_beside(tracking_uri))
    else:
        exp_id = exp.experiment_id
    run = client.create_run(exp_id, run_name="known")
    run_id = run.info.run_id
    metrics: list[Metric] = []

    def put(name: str, values: list[float], first_step: int = 1) -> None:
        metrics.extend(Metric(name, v, 1000 + s, s) for s, v in enumerate(values, start=first_step))

    for head in log_order or HEADS:
        norms = NORMS[head]
        put(mn.head_metric(mn.HEAD_GRAD_NORM, head), norms)
        prev = [NAN, *norms[:-1]]
        put(
            mn.head_metric(mn.HEAD_GRAD_TREND, head),
            [float(mn.TREND_CODES[trend_arrow(p, c)]) for p, c in zip(prev, norms, strict=True)],
        )
        if not mn.is_value_head(head):  # as the learner: the value head has no log-prob latch
            put(mn.head_metric(mn.HEAD_NAN_LATCH, head), NAN_LATCH.get(head, [0.0] * 3))
            put(mn.head_metric(mn.HEAD_INF_LATCH, head), INF_LATCH.get(head, [0.0] * 3))
    for head, values in NOISE.items():
        put(mn.head_metric(mn.HEAD_NOISE_SCALE, head), values)
    put(mn.head_metric(mn.HEAD_NAN_LATCH_FIRST_ITERATION, "a6"), [2.0], first_step=2)
    put(mn.VGS_SCALING_FACTOR, VGS_SCALE)
    put(mn.ENV_STEPS_SAMPLED_LIFETIME, [1024.0, 2048.0, 3072.0])
    put(mn.EPISODE_RETURN_MEAN, [-0.75, -0.5, -0.25])
    put(mn.SKIPPED_UPDATES_TOTAL, [0.0, 1.0, 2.0])
    put(mn.GLOBAL_NOISE_SCALE, [20.0, 30.0, 40.0])
    if with_probe:
        for bucket, components in PROBE.items():
            for component, value in components.items():
                put(mn.probe_metric(mn.PROBE_COMPONENT_NORM, bucket, component=component), [value], PROBE_STEP)
                share = PROBE_SHARES[bucket][component]
                put(mn.probe_metric(mn.PROBE_SHARE, bucket, component=component), [share], PROBE_STEP)
            put(mn.probe_metric(mn.PROBE_REWARD_STD_MEAN, bucket), [0.1], PROBE_STEP)
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i : i + 1000])
    tags = [RunTag(mn.TAG_STATUS, "finished")]
    if head_names_tag is not None:
        tags.append(RunTag(mn.TAG_HEAD_NAMES, ",".join(head_names_tag)))
    client.log_batch(run_id, tags=tags)
    client.set_terminated(run_id)
    assert math.isnan(NORMS["a5"][-1])
    return KnownRun(tracking_uri, run_id, experiment)


def shuffled_known_runs(tracking_uri: str, seed: int) -> Iterator[tuple[KnownRun, Sequence[str] | None, list[str]]]:
    """The known run logged with its heads in a shuffled order (``seed``), once with the
    ``gradmon.head_names`` tag and once without (an old run); yields ``(run, tag, the head
    order a reader must show)``: the tag's order, else sorted action heads then ``value``."""
    log_order = random.Random(seed).sample(HEADS, len(HEADS))
    fallback = [*sorted(h for h in HEADS if h != "value"), "value"]
    assert log_order not in (HEADS, fallback)  # the shuffle really differs from both answers
    for tag, expected in ((HEADS, HEADS), (None, fallback)):
        yield make_known_run(tracking_uri, with_probe=False, log_order=log_order, head_names_tag=tag), tag, expected
