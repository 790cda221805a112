"""The MLflow sink against a real sqlite store, and against a server that is not there."""

from __future__ import annotations

import math
import time

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray.tracking import MlflowSink


def test_writes_params_metrics_tags_in_chunks_to_sqlite(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    sink = MlflowSink(uri, "exp", run_name="r", params={"ppo.lr": 0.001, "long": "x" * 9000})
    wide = {f"m/{i}": float(i) for i in range(1500)}  # > 1000 per log_batch call
    for step in (1, 2, 3):
        sink.log_iteration(
            step, {**wide, "loss": step * 0.5, "bad": float("nan"), "big": float("inf")}, {"t": str(step)}
        )
    assert sink.close() is True
    client = MlflowClient(uri)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r"
    assert run.data.params["ppo.lr"] == "0.001" and len(run.data.params["long"]) == 6000
    assert run.data.tags["t"] == "3"
    history = client.get_metric_history(sink.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert len(client.get_metric_history(sink.run_id, "m/1499")) == 3
    assert math.isnan(client.get_metric_history(sink.run_id, "bad")[0].value)
    assert client.get_metric_history(sink.run_id, "big")[0].value > 1e300
    assert sink.written_iterations == 3 and sink.dropped_iterations == 0


def test_dead_server_never_blocks_or_raises(dead_uri):
    sink = MlflowSink(dead_uri, "exp", max_pending=3, retry_backoff_s=0.05)
    start = time.perf_counter()
    for step in range(10):
        sink.log_iteration(step, {"x": 1.0})
    assert time.perf_counter() - start < 0.1  # log_iteration only enqueues
    assert sink.dropped_iterations == 7  # bounded buffer: oldest dropped, counted
    start = time.perf_counter()
    assert sink.close(timeout_s=1.0) is False
    assert time.perf_counter() - start < 3.0
    assert sink.run_id is None and sink.failed_writes >= 1 and "Error" in (sink.last_error or "")


def test_an_outage_costs_a_few_backed_off_requests_not_one_per_iteration(dead_uri):
    """New iterations wait in the buffer; they do not cut the retry backoff short."""
    sink = MlflowSink(dead_uri, "exp", retry_backoff_s=0.2)
    start = time.monotonic()
    for step in range(30):  # 1.5 s or more of iterations against a dead server
        sink.log_iteration(step, {"x": 1.0})
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    # Attempts no earlier than t = 0, 0.2, 0.6, 1.4, 3.0, ... (backoff 0.2, 0.4, 0.8, ...): 4 in
    # the first 1.5 s. Waking on every put, as the sink once did, makes it about 30.
    nominal = sum(1 for k in range(30) if 0.2 * (2**k - 1) <= elapsed)
    assert 3 <= sink.failed_writes <= nominal, (sink.failed_writes, elapsed)
    assert sink.close(timeout_s=0.5) is False


def test_close_cuts_a_long_backoff_short(dead_uri):
    """Once closing, the sink retries every second rather than finishing a 5 s backoff."""
    sink = MlflowSink(dead_uri, "exp", retry_backoff_s=5.0)
    sink.log_iteration(1, {"x": 1.0})
    deadline = time.monotonic() + 10
    while sink.failed_writes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.failed_writes == 1  # now in a 5 s backoff
    start = time.monotonic()
    assert sink.close(timeout_s=2.5) is False
    assert time.monotonic() - start < 4.0
    assert sink.failed_writes >= 2  # retried within 2.5 s: without the cut, not before 5 s


def test_failed_run_status(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    sink = MlflowSink(uri, "exp")
    sink.log_iteration(1, {"x": 1.0})
    assert sink.close(status="FAILED")
    assert MlflowClient(uri).get_run(sink.run_id).info.status == "FAILED"


@pytest.mark.parametrize("existing", [False, True])
def test_reuses_existing_experiment(tmp_path, existing):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    if existing:
        MlflowClient(uri).create_experiment("exp")
    sink = MlflowSink(uri, "exp")
    assert sink.close()
    client = MlflowClient(uri)
    assert client.get_experiment_by_name("exp").experiment_id == client.get_run(sink.run_id).info.experiment_id


def test_attached_sink_writes_into_an_existing_run_and_leaves_its_status(tmp_path):
    uri = f"sqlite:///{tmp_path / 'attached.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("owner")).info.run_id
    sink = MlflowSink(uri, "ignored", run_id=run_id, params={"ignored": 1})
    sink.log_iteration(3, {"grad_norm/bucket_1/task": 0.5})
    assert sink.flush(30.0)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "grad_norm/bucket_1/task")] == [(3, 0.5)]
    sink.log_iteration(4, {"grad_norm/bucket_1/task": 0.25})
    assert sink.close(status="FAILED", timeout_s=30.0)
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and run.data.params == {}
    assert client.get_experiment_by_name("ignored") is None
    assert len(client.get_metric_history(run_id, "grad_norm/bucket_1/task")) == 2


def test_run_id_waiting_once_waits_only_for_the_first_try(dead_uri, tmp_path):
    """While MLflow cannot create the run, the first ask waits until the writer's first try has
    failed (not its whole timeout: the CLI's start line and the first checkpoint would hold
    training up for nothing) and later asks do not wait at all; once the run exists it is returned
    without waiting."""
    sink = MlflowSink(dead_uri, "exp", retry_backoff_s=5.0)
    start = time.monotonic()
    assert sink.run_id_waiting_once(30) is None
    assert time.monotonic() - start < 10 and sink.failed_writes == 1  # woken by the refused first try
    assert "Error" in (sink.last_error or "")  # why, readable once woken
    start = time.monotonic()
    assert sink.run_id_waiting_once(30) is None
    assert time.monotonic() - start < 0.1
    sink.close(timeout_s=0.5)

    live = MlflowSink(f"sqlite:///{tmp_path / 'm.db'}", "exp")
    run_id = live.run_id_waiting_once(60)  # the sqlite store is created first: this one waits
    assert run_id is not None and live.run_id_waiting_once(0) == run_id
    assert live.close() is True
    assert MlflowClient(f"sqlite:///{tmp_path / 'm.db'}").get_run(run_id).info.status == "FINISHED"


def test_close_gives_a_server_that_never_took_the_run_a_short_last_chance(dead_uri, tmp_path, monkeypatch):
    """Every try failed: close waits NEVER_CREATED_CLOSE_S, not its 30 s, and what was pending is
    in the spill file; a server that took the run keeps the full wait (the test above)."""
    from gradmon_ray.tracking import mlflow_sink
    from gradmon_ray.tracking.spill import read_spill

    last_chance = 1.5  # 5 s in production; still well apart from the 30 s asked for and the 0.5 s grace
    monkeypatch.setattr(mlflow_sink, "NEVER_CREATED_CLOSE_S", last_chance)
    spill = tmp_path / "spill.jsonl"
    sink = MlflowSink(dead_uri, "exp", retry_backoff_s=0.05, spill_path=spill)
    sink.log_iteration(1, {"x": 1.0})
    assert sink.run_id_waiting_once(30) is None
    start = time.monotonic()
    assert sink.close(timeout_s=30.0) is False
    assert last_chance - 0.1 <= time.monotonic() - start < last_chance + 3
    _, records, _ = read_spill(spill)
    assert [(r["step"], r["metrics"]) for r in records if r["metrics"]] == [(1, {"x": 1.0})]


def test_a_relative_sqlite_uri_is_the_store_of_the_directory_the_sink_was_opened_in(tmp_path, monkeypatch):
    """MLflow caches a store per URI string for the whole process: without the sink resolving
    ``sqlite:///mlflow.db`` where it is opened, a second directory's run lands in the first's file."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        sink = MlflowSink("sqlite:///mlflow.db", "exp", run_name=name)
        sink.log_iteration(1, {"x": 1.0})
        assert sink.close() is True
    for name in ("a", "b"):
        client = MlflowClient(f"sqlite:///{tmp_path / name / 'mlflow.db'}")
        runs = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
        assert [r.info.run_name for r in runs] == [name]


def test_a_sink_resuming_its_own_run_sets_it_running_and_one_attached_to_another_leaves_it(tmp_path):
    """``end_run=True`` with a ``run_id`` (a resumed run, a retried trial): the run left KILLED is
    RUNNING again, with the sink's tags, once the writer reached MLflow, and ends with the sink's
    status.  A sink writing into someone else's run (the probe's: no ``end_run``) changes neither."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e"), tags={"gradmon.status": "killed"}).info.run_id
    client.set_terminated(run_id, "KILLED")
    probe = MlflowSink(uri, "e", run_id=run_id, tags={"gradmon.status": "running"})
    assert probe.wait_for_run(60) == run_id and probe.close(timeout_s=60) is True
    run = client.get_run(run_id)
    assert (run.info.status, run.data.tags["gradmon.status"]) == ("KILLED", "killed")
    resumed = MlflowSink(uri, "e", run_id=run_id, end_run=True, tags={"gradmon.status": "running"})
    assert resumed.run_id_waiting_once(60) == run_id
    run = client.get_run(run_id)
    assert (run.info.status, run.data.tags["gradmon.status"]) == ("RUNNING", "running")
    assert resumed.close(status="FINISHED", timeout_s=60) is True
    assert client.get_run(run_id).info.status == "FINISHED"
