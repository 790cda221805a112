"""``tracking/sink_spill.py``: what a kill at any point leaves on disk, against a server that hangs.

A server that accepts connections and never answers is the case a kill meets in practice (a
tracking server killed or stalled mid-run, MLflow's own HTTP retries running for minutes): no
write *fails*, so the old rule "spill after a failed write" never fired, and Tune's kill of the
trial's actor took every iteration with it.  The oracle is the spill file read back with
``read_spill`` and replayed by ``replay_spill`` into a fresh sqlite store: the values there must be
the values logged, and the run's end status the one ``close`` was given.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray.tracking import MlflowSink, sink_spill
from gradmon_ray.tracking.spill import read_spill
from gradmon_ray.tracking.spill_replay import replay_spill


@pytest.fixture
def hanging_uri() -> Iterator[str]:
    """http:// on a port whose socket listens and never accepts: requests connect, then hang."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def _metrics(step: int) -> dict[str, float]:
    return {"grad/global_norm": step * 1.5, "loss": -step / 4}


def test_a_hanging_server_gets_every_iteration_spilled_once_it_lags(hanging_uri, tmp_path, caplog, monkeypatch):
    spill = tmp_path / "run.jsonl"
    monkeypatch.setattr(sink_spill, "LAG_S", 3600.0)
    sink = MlflowSink(hanging_uri, "exp", run_name="r", spill_path=spill)
    sink.log_iteration(1, _metrics(1))  # the run's creation asked for less than LAG_S ago: not lagging
    assert not spill.exists()
    monkeypatch.setattr(sink_spill, "LAG_S", 0.0)  # (no sleep: the fast lane has no timing in it)
    with caplog.at_level("WARNING", logger="gradmon_ray.tracking.mlflow_sink"):
        sink.log_iteration(2, _metrics(2))  # lagging: iteration 1, still pending, and 2 on disk now
        sink.log_iteration(3, _metrics(3))
    header, records, trailer = read_spill(spill)
    assert [(r["step"], r["metrics"]) for r in records] == [(s, _metrics(s)) for s in (1, 2, 3)]
    assert trailer is None and header["run_id"] is None
    assert caplog.text.count("has not created the run after") == 1  # said once, naming the file
    assert f"gradmon-ray replay {spill}" in caplog.text
    assert sink.close(timeout_s=0.6) is False


def test_close_puts_the_pending_iteration_and_the_status_on_disk_before_a_kill(hanging_uri, tmp_path, caplog):
    """A healthy-looking sink (no lag yet) whose server hangs at the end: within ``CLOSE_GRACE_S``
    of ``close`` the file holds the last iteration and the status, as a kill would find it; a
    replay of that file alone gives the run with its values, ended FAILED."""
    spill = tmp_path / "run.jsonl"
    sink = MlflowSink(hanging_uri, "exp", run_name="r", spill_path=spill)
    sink.log_iteration(7, _metrics(7), {"gradmon.status": "failed"})
    assert not spill.exists()
    closing = threading.Thread(target=sink.close, kwargs={"status": "FAILED", "timeout_s": 3.0})
    with caplog.at_level("WARNING", logger="gradmon_ray.tracking.mlflow_sink"):
        closing.start()
        at_kill = b""  # what a SIGKILL while close still waits would leave (read only while it waits)
        while closing.is_alive() and b'"final"' not in at_kill:
            at_kill = spill.read_bytes() if spill.exists() else b""
            time.sleep(0.05)
        closing.join(60)
    assert "waiting up to 3 s for MLflow" in caplog.text and f"gradmon-ray replay {spill}" in caplog.text
    killed = tmp_path / "killed.jsonl"
    killed.write_bytes(at_kill)
    _, records, trailer = read_spill(killed)
    assert [(r["step"], r["metrics"], r["tags"]) for r in records] == [(7, _metrics(7), {"gradmon.status": "failed"})]
    assert trailer == {"final": True, "run_id": None, "status": "FAILED"}
    store = f"sqlite:///{tmp_path / 'm.db'}"
    result = replay_spill(killed, store)
    client = MlflowClient(store)
    run = client.get_run(result.run_id)
    assert run.info.status == "FAILED" and run.info.run_name == "r"
    assert {k: [(p.step, p.value) for p in client.get_metric_history(result.run_id, k)] for k in _metrics(7)} == {
        k: [(7, v)] for k, v in _metrics(7).items()
    }


def test_a_store_that_keeps_up_never_gets_a_spill_file(tmp_path, monkeypatch):
    monkeypatch.setattr(sink_spill, "LAG_S", 3600.0)  # a first sqlite store takes seconds to create here
    spill_dir = tmp_path / "spill"
    sink = MlflowSink(f"sqlite:///{tmp_path / 'm.db'}", "exp", spill_path=spill_dir / "r.jsonl")
    for step in range(1, 6):
        sink.log_iteration(step, _metrics(step))
    assert sink.close() is True
    assert not spill_dir.exists()


def test_slow_end_of_run_plots_never_make_a_complete_run_incomplete(tmp_path, caplog):
    """The plots come after the run's end, on their own budget: a close whose budget is shorter
    than the plots still returns True with the run FINISHED and every value in it.  No clock
    decides it: the first sink's plots end only when the test lets them (after its close returned);
    the second's take 1.5 s, which the default budget (60 s) waits for.  MLflow's own budget is
    generous: a first sqlite store takes seconds to create on a loaded box (1 s failed there)."""
    drawn, release, drawn2 = threading.Event(), threading.Event(), threading.Event()

    def slow_plots(client, run_id):
        release.wait(60)
        drawn.set()
        return []

    def plots_of_1_5_s(client, run_id):
        time.sleep(1.5)
        drawn2.set()
        return []

    store = f"sqlite:///{tmp_path / 'm.db'}"
    sink = MlflowSink(store, "exp", plots_every=100, plot_fn=slow_plots, spill_path=tmp_path / "s" / "r.jsonl")
    sink.log_iteration(1, _metrics(1))
    with caplog.at_level("WARNING", logger="gradmon_ray.tracking.mlflow_sink"):
        assert sink.close(timeout_s=120.0, plots_timeout_s=0.2) is True  # MLflow's budget: a loaded box's
    assert "end-of-run plots not done after 0 s" in caplog.text and not drawn.is_set()
    client = MlflowClient(store)
    assert client.get_run(sink.run_id).info.status == "FINISHED"
    assert [(p.step, p.value) for p in client.get_metric_history(sink.run_id, "loss")] == [(1, -0.25)]
    # nothing left to replay (on a loaded box MLflow may lag past the close grace: the file then
    # written is removed once delivered, its directory stays)
    assert not list((tmp_path / "s").rglob("*"))
    release.set()  # the first sink's plots may end now
    sink2 = MlflowSink(store, "exp", plots_every=100, plot_fn=plots_of_1_5_s)
    sink2.log_iteration(1, _metrics(1))
    assert sink2.close(timeout_s=120.0) is True and drawn2.wait(0)  # the default plots budget waits for them
