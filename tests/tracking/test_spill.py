"""Spill file and replay: nothing MLflow could not take is lost (real sqlite store, dead HTTP server)."""

from __future__ import annotations

import json
import math

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray.cli import main
from gradmon_ray.tracking import MlflowSink
from gradmon_ray.tracking.spill import REPLAYED_SUFFIX, SpillFormatError, read_spill, replay_spill


def test_overflow_and_close_leftovers_are_spilled_then_replayed_into_a_new_run(tmp_path, dead_uri):
    spill = tmp_path / "spill" / "run.jsonl"
    sink = MlflowSink(
        dead_uri,
        "exp",
        run_name="r",
        params={"ppo.lr": 0.001},
        max_pending=2,
        retry_backoff_s=0.05,
        spill_path=spill,
    )
    for step in range(1, 6):
        sink.log_iteration(step, {"x": float(step), "bad": math.nan, "big": math.inf}, {"t": str(step)})
    assert sink.spilled_iterations == 3  # steps 1..3 pushed out of the 2-iteration buffer
    assert sink.close(timeout_s=1.0) is False
    assert sink.spilled_iterations == 5 and sink.dropped_iterations == 0 and sink.spill_path == spill
    header, iterations, trailer = read_spill(spill)
    assert header["experiment"] == "exp" and header["params"] == {"ppo.lr": "0.001"} and header["run_id"] is None
    assert sorted(r["step"] for r in iterations) == [1, 2, 3, 4, 5]
    assert trailer == {"final": True, "run_id": None, "status": "FINISHED"}

    store = f"sqlite:///{tmp_path / 'later.db'}"
    result = replay_spill(spill, store)
    assert result.created_run and result.iterations == 5 and result.metrics == 15 and result.status == "FINISHED"
    assert not spill.exists() and spill.with_name(spill.name + REPLAYED_SUFFIX).exists()
    client = MlflowClient(store)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r" and run.data.params["ppo.lr"] == "0.001"
    assert sorted((m.step, m.value) for m in client.get_metric_history(result.run_id, "x")) == [
        (s, float(s)) for s in range(1, 6)
    ]
    assert math.isnan(client.get_metric_history(result.run_id, "bad")[0].value)  # NaN survives JSON
    assert run.data.tags["t"] == "5"


def test_replay_into_the_runs_own_id_is_idempotent(tmp_path, dead_uri):
    store = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    client.log_metric(run_id, "x", 1.0, step=1)  # delivered before the outage
    spill = tmp_path / "s.jsonl"
    sink = MlflowSink(dead_uri, "e", run_id=run_id, max_pending=1, retry_backoff_s=0.05, spill_path=spill)
    for step in (2, 3):
        sink.log_iteration(step, {"x": float(step)})
    sink.close(timeout_s=0.5)
    for _ in range(2):  # twice: MLflow ignores metric points it already has
        result = replay_spill(spill, store, mark_done=False)
        assert result.run_id == run_id and not result.created_run and result.status is None  # not our run to end
    assert sorted(m.step for m in client.get_metric_history(run_id, "x")) == [1, 2, 3]
    assert client.get_run(run_id).info.status == "RUNNING"


def test_no_spill_file_when_everything_was_delivered(tmp_path):
    spill = tmp_path / "s.jsonl"
    sink = MlflowSink(f"sqlite:///{tmp_path / 'm.db'}", "e", spill_path=spill)
    sink.log_iteration(1, {"x": 1.0})
    assert sink.close() is True
    assert sink.spill_path is None and not spill.exists()


def test_without_a_spill_path_overflow_is_dropped_and_counted(dead_uri):
    sink = MlflowSink(dead_uri, "e", max_pending=1, retry_backoff_s=0.05)
    for step in range(4):
        sink.log_iteration(step, {"x": 1.0})
    sink.close(timeout_s=0.5)
    assert sink.dropped_iterations == 4 and sink.spilled_iterations == 0 and sink.spill_path is None


def test_cli_replay(tmp_path, dead_uri, capsys):
    spill = tmp_path / "s.jsonl"
    sink = MlflowSink(dead_uri, "cli", max_pending=1, retry_backoff_s=0.05, spill_path=spill)
    sink.log_iteration(1, {"x": 1.0})
    sink.close(timeout_s=0.5)
    store = f"sqlite:///{tmp_path / 'm.db'}"
    assert main(["replay", str(spill), "--tracking-uri", store]) == 0
    assert "replayed 1 iterations (1 metric points) into created run" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "no such file"),
        ("not json\n", "line 1: not JSON"),
        (json.dumps({"step": 1}) + "\n", "not a gradmon-ray spill file"),
        ("", "not a gradmon-ray spill file"),
    ],
    ids=["missing", "not-json", "no-header", "empty"],
)
def test_bad_spill_files_exit_2_with_one_line(tmp_path, capsys, content, fragment):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpillFormatError, match=fragment):
        read_spill(path)
    assert main(["replay", str(path), "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0]
