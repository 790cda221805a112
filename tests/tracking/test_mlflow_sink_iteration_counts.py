"""The sink's end-of-run counts are iterations as ``gradmon-ray replay`` counts them, not records.

A run logs each iteration, then one end-of-run record at the last step (the final status tag, and
the probe's last counters when a probe ran): with MLflow away, ``spilled_iterations`` and
``dropped_iterations`` once counted that record as one more iteration ("3 iterations kept" for a
2-iteration run whose replay wrote 2).  A real sink against a dead http:// server, a real replay
into a fresh sqlite store.  No Ray is started.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.tracking import MlflowSink
from gradmon_ray.tracking.spill_replay import replay_spill


def _log_a_run(sink: MlflowSink, iterations: int, end_metrics: dict[str, float]) -> None:
    """What ``run_training`` and the callback log: the iterations, then the end record at the last step."""
    for step in range(1, iterations + 1):
        sink.log_iteration(step, {mn.LEARNERS_UPDATED: 1.0, mn.GLOBAL_GRAD_NORM: 0.5 * step}, {"t": str(step)})
    sink.log_iteration(iterations, end_metrics, {mn.TAG_STATUS: "finished"})


@pytest.mark.parametrize(
    ("iterations", "end_metrics"), [(1, {}), (3, {}), (2, {"probe/analyses": 1.0})], ids=["1", "3", "2-probe"]
)
def test_spilled_iterations_match_what_replay_writes(dead_uri, tmp_path, iterations, end_metrics):
    spill = tmp_path / "spill" / "run.jsonl"
    sink = MlflowSink(dead_uri, "counts", run_name="r", retry_backoff_s=0.05, spill_path=spill)
    _log_a_run(sink, iterations, end_metrics)
    assert sink.close(status="FINISHED", timeout_s=1.0) is False  # the end record is undelivered too
    kept = sink.spilled_iterations

    store = f"sqlite:///{tmp_path / 'fresh.db'}"
    result = replay_spill(spill, store)
    client = MlflowClient(store)
    steps = [m.step for m in client.get_metric_history(result.run_id, mn.LEARNERS_UPDATED)]
    assert sorted(steps) == list(range(1, iterations + 1))  # the premise: each iteration once in MLflow
    assert kept == result.iterations == iterations
    assert sink.dropped_iterations == 0
    run = client.get_run(result.run_id)
    assert run.data.tags[mn.TAG_STATUS] == "finished" and run.info.status == "FINISHED"  # the end record came too


def test_dropped_iterations_count_iterations_not_records(dead_uri):
    sink = MlflowSink(dead_uri, "counts", max_pending=1, retry_backoff_s=0.05)  # no spill file: overflow is lost
    _log_a_run(sink, 3, {})
    assert sink.close(timeout_s=0.5) is False
    assert sink.dropped_iterations == 3 and sink.spilled_iterations == 0


def test_the_callbacks_end_of_run_warning_counts_iterations(dead_uri, tmp_path, caplog):
    from gradmon_ray.tracking.callback import GradmonMLflowCallback

    spill = tmp_path / "spill" / "run.jsonl"
    callback = GradmonMLflowCallback()
    callback.sink = MlflowSink(dead_uri, "counts", run_name="r", retry_backoff_s=0.05, spill_path=spill)
    callback.settings = dataclasses.replace(callback.settings, close_timeout_s=1.0)  # this instance only
    for step in (1, 2):  # as on_train_result logs them
        callback.sink.log_iteration(step, {mn.LEARNERS_UPDATED: 1.0})
    callback._last_step = 2
    with caplog.at_level(logging.WARNING, logger="gradmon_ray.tracking.callback"):
        assert callback.close() is False  # logs the end record (the status tag at step 2), then warns
    (warning,) = [line for line in caplog.text.splitlines() if "did not receive everything" in line]
    (kept,) = re.findall(r"\((\d+) iterations kept in \S+; last error: ", warning)
    assert int(kept) == 2 and " lost" not in warning  # nothing was lost: no figure for it
    assert f"replay with: gradmon-ray replay {spill}" in caplog.text
    assert replay_spill(spill, f"sqlite:///{tmp_path / 'fresh.db'}").iterations == 2
