"""Issue #28: ``train`` said "3 iterations kept" for a 2-iteration run whose ``replay`` then wrote 2.

``run_training`` logs each iteration, then one end-of-run record at the last step (the final
status tag, and the probe's last counters when a probe ran); with MLflow away all of them are
spilled, and the warning counted spilled *records*.  Here a real sink writes to a dead server
exactly what ``run_training`` writes, and the number the warning gives is compared with the
iterations MLflow holds after the replay (its metric history, a fresh sqlite store) and with
what ``gradmon-ray replay`` prints.  No Ray.
"""

from __future__ import annotations

import logging
import re

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import main
from gradmon_ray.app.train.mlflow_run import warn_undelivered
from gradmon_ray.tracking import MlflowSink
from tests.e2e.processes import free_port


@pytest.fixture
def dead_uri(monkeypatch: pytest.MonkeyPatch) -> str:
    """An http:// URI nobody answers on, MLflow's client without its own retries (as ``train`` sets it)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    return f"http://127.0.0.1:{free_port()}"


@pytest.mark.parametrize(("iterations", "probe_counters"), [(2, {}), (3, {"probe/analyses": 1.0})])
def test_train_counts_the_iterations_replay_writes(dead_uri, tmp_path, caplog, capsys, iterations, probe_counters):
    spill = tmp_path / "spill" / "run.jsonl"
    sink = MlflowSink(dead_uri, "counts", run_name="r", retry_backoff_s=0.05, spill_path=spill)
    for step in range(1, iterations + 1):  # as run_training logs them ...
        sink.log_iteration(step, {mn.LEARNERS_UPDATED: 1.0, mn.GLOBAL_GRAD_NORM: 0.5 * step})
    sink.log_iteration(iterations, probe_counters, {mn.TAG_STATUS: "finished"})  # ... and the run's end
    assert sink.close(status="FINISHED", timeout_s=1.0) is False
    with caplog.at_level(logging.WARNING, logger="gradmon_ray.app.train.mlflow_run"):
        warn_undelivered(sink)
    (kept,) = re.findall(r"\((\d+) iterations kept in ", caplog.text)

    store = f"sqlite:///{tmp_path / 'later.db'}"
    capsys.readouterr()
    assert main(["replay", str(spill), "--tracking-uri", store]) == 0
    (replayed,) = re.findall(r"replayed (\d+) iterations", capsys.readouterr().out)
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("counts").experiment_id])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, mn.LEARNERS_UPDATED)]
    assert sorted(steps) == list(range(1, iterations + 1))  # the premise: MLflow has each iteration once
    assert int(kept) == int(replayed) == len(steps) == iterations
    assert run.data.tags[mn.TAG_STATUS] == "finished"  # the end record was replayed too, as no extra iteration
