"""``tracking/spill.py``: spill file and replay, nothing MLflow could not take is lost (real sqlite
store, dead HTTP server); the file format is strict JSON with non-finite values round-tripping."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray.app.cli import main
from gradmon_ray.tracking import MlflowSink
from gradmon_ray.tracking.spill import (
    REPLAYED_SUFFIX,
    SpillFormatError,
    SpillWriter,
    decode_value,
    read_spill,
    replayed_iterations,
)
from gradmon_ray.tracking.spill_replay import replay_spill

DEAD_CLOSE_S = 0.1
"""``close``'s wait for a server that is not there: it never ends the run, so close waits all of it and
then spills what is left, the same path at 0.1 s as at 0.5 (the spill grace, ``CLOSE_GRACE_S``)."""


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
    # steps 1..3 pushed out of the 2-iteration buffer; all 5 once the first failure was seen (spill ahead)
    assert sink.spilled_iterations == (5 if sink.spilling_ahead else 3)
    assert sink.close(timeout_s=DEAD_CLOSE_S) is False
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
    sink.close(timeout_s=DEAD_CLOSE_S)
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
    sink.close(timeout_s=DEAD_CLOSE_S)
    assert sink.dropped_iterations == 4 and sink.spilled_iterations == 0 and sink.spill_path is None


def test_cli_replay(tmp_path, dead_uri, capsys):
    spill = tmp_path / "s.jsonl"
    sink = MlflowSink(dead_uri, "cli", max_pending=1, retry_backoff_s=0.05, spill_path=spill)
    sink.log_iteration(1, {"x": 1.0})
    sink.close(timeout_s=DEAD_CLOSE_S)
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


def _spill_of_a_two_iteration_run(path, dead_uri) -> None:
    """What `run_training` leaves behind when MLflow is down the whole time: iterations 1 and 2,
    then the end-of-run record at the last step (final probe counters, the status tag)."""
    sink = MlflowSink(dead_uri, "two", run_name="two", retry_backoff_s=0.05, spill_path=path)
    sink.log_iteration(1, {"x": 1.0, "probe/completed": 0.0}, {"gradmon.head_names": "op,value"})
    sink.log_iteration(2, {"x": 2.0, "probe/completed": 1.0})
    sink.log_iteration(2, {"probe/completed": 2.0}, {"gradmon.status": "finished"})
    sink.log_iteration(2, {}, {"gradmon.note": "tags only"})
    assert sink.close(timeout_s=DEAD_CLOSE_S) is False


def test_replay_of_a_two_iteration_run_reports_two_iterations(tmp_path, dead_uri, capsys):
    spill = tmp_path / "two.jsonl"
    _spill_of_a_two_iteration_run(spill, dead_uri)
    store = f"sqlite:///{tmp_path / 'm.db'}"
    result = replay_spill(spill, store, mark_done=False)
    assert result.iterations == 2 and result.metrics == 5
    client = MlflowClient(store)
    assert client.get_run(result.run_id).data.metrics["probe/completed"] == 2.0  # the end-of-run value wins
    assert main(["replay", str(spill), "--tracking-uri", store]) == 0
    assert "replayed 2 iterations (5 metric points)" in capsys.readouterr().out


NON_FINITE = {"pos_inf": math.inf, "neg_inf": -math.inf, "nan": math.nan, "finite": 1.25, "big": 1e308}


def _recorded_log_batch(monkeypatch):
    """Record the metrics every MlflowClient.log_batch call hands MLflow (and still write them)."""
    from mlflow.tracking import MlflowClient as Client

    handed = []
    real = Client.log_batch

    def log_batch(self, run_id, metrics=(), params=(), tags=(), *args, **kwargs):
        handed.extend((m.key, m.step, repr(m.value)) for m in metrics)  # repr: NaN == NaN
        return real(self, run_id, metrics, params, tags, *args, **kwargs)

    monkeypatch.setattr(Client, "log_batch", log_batch)
    return handed


def _read_back(uri: str, run_id: str) -> dict[str, list[tuple[int, str]]]:
    client = MlflowClient(uri)
    # repr: NaN compares equal to NaN, and +-Inf / +-max-float stay distinct
    return {k: [(m.step, repr(m.value)) for m in client.get_metric_history(run_id, k)] for k in NON_FINITE}


def test_replay_writes_inf_and_nan_exactly_as_the_live_sink(tmp_path, dead_uri, monkeypatch):
    handed = _recorded_log_batch(monkeypatch)
    live_store = f"sqlite:///{tmp_path / 'live.db'}"
    live = MlflowSink(live_store, "e")
    live.log_iteration(3, NON_FINITE)
    assert live.close() is True
    live_handed, handed[:] = sorted(handed, key=repr), []

    spill = tmp_path / "s.jsonl"
    spilled = MlflowSink(dead_uri, "e", retry_backoff_s=0.05, spill_path=spill)
    spilled.log_iteration(3, NON_FINITE)
    spilled.close(timeout_s=DEAD_CLOSE_S)
    handed[:] = []  # the dead server's attempts
    replay_store = f"sqlite:///{tmp_path / 'replayed.db'}"
    result = replay_spill(spill, replay_store)
    # the same values handed to MLflow (replay used to hand over inf where the sink writes max float) ...
    assert sorted(handed, key=repr) == live_handed
    # ... and the same values stored, read back from two real sqlite stores
    assert _read_back(replay_store, result.run_id) == _read_back(live_store, live.run_id)
    stored = _read_back(live_store, live.run_id)
    assert stored["pos_inf"] == [(3, "1.7976931348623157e+308")] and stored["nan"] == [(3, "nan")]
    assert stored["neg_inf"] == [(3, "-1.7976931348623157e+308")]


# --- spill ahead: nothing logged after a failed write lives only in memory ------------------------


class _FailingWrites:
    """``MlflowClient.log_batch`` on a real sqlite store that raises while ``down`` is set (a server
    outage as the sink sees it); every other call goes to the store."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from mlflow.tracking import MlflowClient as Client

        self.down = False
        real = Client.log_batch

        def log_batch(client: Any, *args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise ConnectionError("tracking server unreachable (injected)")
            return real(client, *args, **kwargs)

        monkeypatch.setattr(Client, "log_batch", log_batch)


def _wait(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _steps_on_disk(path: Path) -> list[int]:
    """Iteration records in the file as bytes on disk say, whatever the sink still holds in memory."""
    lines = path.read_bytes().decode().splitlines()[1:]
    return [json.loads(line)["step"] for line in lines if '"step"' in line]


def test_after_a_failed_write_each_iteration_is_on_disk_before_log_iteration_returns(tmp_path, dead_uri):
    """The first write fails; from then on every ``log_iteration`` has put its iteration in the
    spill file (read back from disk, not from the sink) by the time it returns: a SIGKILL right
    after it would lose nothing.  Ordering only, no clock: the writer's one failure is waited for
    (it spills what was pending), and its backoff (an hour) keeps it from retrying before close, so
    the file cannot have been filled by a retry.  (Nothing before a failure: the test below.)"""
    spill = tmp_path / "s.jsonl"
    sink = MlflowSink(dead_uri, "e", retry_backoff_s=3600.0, spill_path=spill)
    sink.log_iteration(1, {"x": 1.0})

    def first_spilled() -> bool:  # the writer's thread spills step 1 after its failure
        try:
            return _steps_on_disk(spill) == [1]
        except (OSError, ValueError):  # not there yet, or a line read mid-write
            return False

    _wait(first_spilled, timeout_s=300.0)
    assert sink.spilling_ahead and sink.failed_writes == 1
    for step in range(2, 6):
        sink.log_iteration(step, {"x": float(step)})
        assert _steps_on_disk(spill) == list(range(1, step + 1))
    assert sink.failed_writes == 1  # in its hour-long backoff: the file did not wait for a retry
    sink.close(timeout_s=DEAD_CLOSE_S)
    _, iterations, trailer = read_spill(spill)
    assert [r["step"] for r in iterations] == [1, 2, 3, 4, 5] and trailer is not None


def test_no_spill_before_the_first_failure(tmp_path):
    spill = tmp_path / "s.jsonl"
    sink = MlflowSink(f"sqlite:///{tmp_path / 'm.db'}", "e", spill_path=spill)
    for step in (1, 2, 3):
        sink.log_iteration(step, {"x": float(step)})
        assert not spill.exists()
    assert sink.close() is True and not sink.spilling_ahead and not spill.exists()


def test_iterations_delivered_after_the_outage_are_marked_and_never_replayed_twice(tmp_path, monkeypatch):
    """Writes fail for a while (iterations 2-4 spilled ahead), then MLflow takes them: the spill
    file marks them delivered, so at the end it holds nothing to replay and is removed; the
    store has each step exactly once."""
    store = f"sqlite:///{tmp_path / 'm.db'}"
    outage = _FailingWrites(monkeypatch)
    spill = tmp_path / "s.jsonl"
    sink = MlflowSink(store, "e", retry_backoff_s=0.05, spill_path=spill)
    sink.log_iteration(1, {"x": 1.0})
    assert sink.flush(30)
    outage.down = True
    for step in (2, 3, 4):
        sink.log_iteration(step, {"x": float(step)})
        _wait(lambda: sink.spilling_ahead)
    assert _steps_on_disk(spill) == [2, 3, 4]
    outage.down = False
    assert sink.flush(30)
    sink.log_iteration(5, {"x": 5.0})
    assert _steps_on_disk(spill) == [2, 3, 4, 5]  # still spilled ahead after the server came back
    _, undelivered, _ = read_spill(spill)
    assert [r["step"] for r in undelivered] in ([], [5])  # 2-4 marked delivered
    assert sink.close() is True
    assert sink.spilled_iterations == 0 and not spill.exists() and sink.spill_path is None
    history = MlflowClient(store).get_metric_history(sink.run_id, "x")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]


def test_what_left_memory_during_the_outage_is_replayed_once_and_the_rest_not_at_all(tmp_path, monkeypatch):
    """A 2-iteration buffer through a 6-iteration outage: iterations 2-5 leave memory (they are in
    the spill file), 6-7 are delivered when MLflow is back. The spill file then holds exactly
    2-5 to replay, and after the replay the store has 1..8 once each."""
    store = f"sqlite:///{tmp_path / 'm.db'}"
    outage = _FailingWrites(monkeypatch)
    spill = tmp_path / "s.jsonl"
    sink = MlflowSink(store, "e", max_pending=2, retry_backoff_s=0.05, spill_path=spill)
    sink.log_iteration(1, {"x": 1.0})
    assert sink.flush(30)
    outage.down = True
    sink.log_iteration(2, {"x": 2.0})
    _wait(lambda: sink.spilling_ahead)
    for step in range(3, 8):
        sink.log_iteration(step, {"x": float(step)})
    outage.down = False
    assert sink.flush(30)  # 6 and 7, still in memory, delivered
    sink.log_iteration(8, {"x": 8.0})
    assert sink.close(timeout_s=30) is False  # 2-5 are only in the spill file
    assert sink.spilled_iterations == 4 and sink.dropped_iterations == 0
    _, undelivered, trailer = read_spill(spill)
    assert [r["step"] for r in undelivered] == [2, 3, 4, 5] and trailer["run_id"] == sink.run_id
    result = replay_spill(spill, store)
    assert result.run_id == sink.run_id and result.iterations == 4 and not result.created_run
    history = MlflowClient(store).get_metric_history(sink.run_id, "x")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(1, 9)]


def test_replay_into_another_store_creates_the_run_there(tmp_path, dead_uri):
    """A spill file naming a run id the target store does not have (the run's server is gone for
    good): replay creates the run there from the header instead of failing."""
    live = f"sqlite:///{tmp_path / 'live.db'}"
    client = MlflowClient(live)
    run_id = client.create_run(client.create_experiment("gone")).info.run_id
    spill = tmp_path / "s.jsonl"
    sink = MlflowSink(dead_uri, "gone", run_id=run_id, run_name="r", retry_backoff_s=0.05, spill_path=spill)
    for step in (4, 5):
        sink.log_iteration(step, {"x": float(step)})
    sink.close(timeout_s=DEAD_CLOSE_S)
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    result = replay_spill(spill, fresh)
    assert result.created_run and result.run_id != run_id and result.iterations == 2
    assert sorted(m.step for m in MlflowClient(fresh).get_metric_history(result.run_id, "x")) == [4, 5]


def test_a_torn_last_line_is_skipped_and_the_fsynced_lines_replay(tmp_path, dead_uri):
    """A writer killed mid-line leaves a last line without its newline: read and replay skip it
    (everything before it was fsynced whole); a broken line elsewhere is still an error."""
    spill = tmp_path / "s.jsonl"
    sink = MlflowSink(dead_uri, "torn", retry_backoff_s=5.0, spill_path=spill)
    sink.log_iteration(1, {"x": 1.0})
    _wait(lambda: sink.spilling_ahead)
    sink.log_iteration(2, {"x": 2.0})
    with spill.open("a") as handle:
        handle.write('{"seq": 3, "step": 3, "timestamp_ms": 1, "metr')
    _, iterations, trailer = read_spill(spill)
    assert [r["step"] for r in iterations] == [1, 2] and trailer is None
    result = replay_spill(spill, f"sqlite:///{tmp_path / 'm.db'}", mark_done=False)
    assert result.iterations == 2
    # The replay cut the torn line off before recording its run: the file is whole lines again.
    lines = spill.read_text().splitlines()
    assert [json.loads(line).get("replayed_into") for line in lines[-2:]] == [
        result.run_id,
        None,
    ]  # then how far it got
    assert all(json.loads(line) for line in lines) and spill.read_text().endswith("\n")
    with spill.open("a") as handle:
        handle.write('{"seq": 3, "step": 3, "metr\n' + json.dumps({"seq": 4, "step": 4, "metrics": {}}) + "\n")
    with pytest.raises(SpillFormatError, match=rf"line {len(lines) + 1}: not JSON"):
        read_spill(spill)
    sink.close(timeout_s=DEAD_CLOSE_S)


def test_the_header_keeps_no_password_and_replay_asks_for_the_uri(tmp_path, fast_failing_http):
    """A tracking URI with a password: the spill header holds it masked, and a replay without
    ``--tracking-uri`` says it needs one (one line, exit 2) instead of logging in with ``***``."""
    from tests.e2e.processes import free_port

    uri = f"http://alice:MARKER-pw-7@127.0.0.1:{free_port()}"
    spill = tmp_path / "s.jsonl"
    sink = MlflowSink(uri, "e", retry_backoff_s=0.05, spill_path=spill)
    sink.log_iteration(1, {"x": 1.0})
    sink.close(timeout_s=DEAD_CLOSE_S)
    assert "MARKER-pw-7" not in spill.read_text()
    header, _, _ = read_spill(spill)
    assert header["tracking_uri"] == uri.replace("MARKER-pw-7", "***")
    with pytest.raises(SpillFormatError, match=r"had credentials.*give --tracking-uri"):
        replay_spill(spill)
    result = replay_spill(spill, f"sqlite:///{tmp_path / 'm.db'}")
    assert result.iterations == 1


def _strict(text: str):
    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_spill_lines_are_strict_json_and_non_finite_values_round_trip(tmp_path):
    path = tmp_path / "run.jsonl"
    writer = SpillWriter(path, {"tracking_uri": "sqlite:///x.db", "experiment": "e"})
    values = {"pos": math.inf, "neg": -math.inf, "nan": math.nan, "x": 1.25}
    assert writer.write_iterations([(3, 1000, values, {"t": "a"})], run_id=None) == 1
    writer.write_trailer("rid", "FINISHED")
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3
    for line in lines:  # every line parses without NaN / Infinity extensions
        _strict(line)
    header, iterations, trailer = read_spill(path)
    assert header["experiment"] == "e" and trailer == {"final": True, "run_id": "rid", "status": "FINISHED"}
    (record,) = iterations
    assert record["step"] == 3 and record["tags"] == {"t": "a"}
    decoded = {k: decode_value(v) for k, v in record["metrics"].items()}
    assert decoded["pos"] == math.inf and decoded["neg"] == -math.inf and math.isnan(decoded["nan"])
    assert decoded["x"] == 1.25


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([{"step": 1, "metrics": {"a": 1}}, {"step": 1, "metrics": {"b": 2}}], 1),  # same step twice
        ([{"step": 1, "metrics": {"a": 1}}, {"step": 2, "metrics": {}, "tags": {"t": "x"}}], 1),  # tags only
        ([{"step": 1, "metrics": {"a": 1}}, {"step": 2, "metrics": {"a": 2}}], 2),
    ],
)
def test_replayed_iterations_counts_distinct_steps_with_metrics(records, expected):
    assert replayed_iterations(records) == expected


def test_a_spill_file_delivered_in_the_end_leaves_no_trace_but_a_directory_it_found(tmp_path):
    """Spilled while MLflow lagged, then every record delivered and the run ended: the file goes, and
    the directory too if this writer made it (a healthy run under load left an empty gradmon-spill/);
    a directory that was there before, or that still holds another run's file, stays."""
    made, found = tmp_path / "made" / "spill", tmp_path / "found"
    found.mkdir()
    (found / "other-run.jsonl").write_text("{}\n")
    for directory in (made, found):
        writer = SpillWriter(directory / "r.jsonl", {"tracking_uri": "sqlite:///m.db", "experiment": "e"})
        writer.write_iterations([(1, 1000, {"loss": 0.5}, {})], run_id="abc", seqs=[1])
        writer.mark_delivered([1])
        writer.finish("abc", "FINISHED", run_done=True)
        assert not (directory / "r.jsonl").exists()
    assert not made.exists() and (tmp_path / "made").is_dir()  # only what the writer created
    assert sorted(p.name for p in found.iterdir()) == ["other-run.jsonl"]
