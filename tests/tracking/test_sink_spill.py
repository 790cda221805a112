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
    # 1 s: past CLOSE_GRACE_S (0.5 s), when the file must hold everything; the rest of it is only waited out
    closing = threading.Thread(target=sink.close, kwargs={"status": "FAILED", "timeout_s": 1.0})
    with caplog.at_level("WARNING", logger="gradmon_ray.tracking.mlflow_sink"):
        closing.start()
        at_kill = b""  # what a SIGKILL while close still waits would leave (read only while it waits)
        while closing.is_alive() and b'"final"' not in at_kill:
            at_kill = spill.read_bytes() if spill.exists() else b""
            time.sleep(0.05)
        closing.join(60)
    assert "waiting up to 1 s for MLflow" in caplog.text and f"gradmon-ray replay {spill}" in caplog.text
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
    the second's take 0.6 s (past ``CLOSE_GRACE_S``), which the default budget (60 s) waits for.
    MLflow's own budget is generous: a first sqlite store takes seconds to create on a loaded box
    (1 s failed there)."""
    drawn, release, drawn2 = threading.Event(), threading.Event(), threading.Event()

    def slow_plots(client, run_id):
        release.wait(60)
        drawn.set()
        return []

    def plots_of_0_6_s(client, run_id):
        time.sleep(0.6)
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
    sink2 = MlflowSink(store, "exp", plots_every=100, plot_fn=plots_of_0_6_s)
    sink2.log_iteration(1, _metrics(1))
    assert sink2.close(timeout_s=120.0) is True and drawn2.wait(0)  # the default plots budget waits for them


LAG = 0.5
"""``sink_spill.LAG_S`` for the tests below: short, and 1000 times it (or its thousandth) far out of their range."""


@pytest.fixture
def hung_after_first_write(monkeypatch):
    """``MlflowClient.log_batch`` answering at once until the run has its first metrics, then hanging
    (a server that stalled mid-run) until the test sets the returned event."""
    original = MlflowClient.log_batch
    answer, metric_writes = threading.Event(), []

    def log_batch(self: MlflowClient, run_id: str, metrics=(), **kwargs):
        if metrics:
            metric_writes.append(sorted({m.step for m in metrics}))
            if len(metric_writes) > 1:
                answer.wait(60)
        return original(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)
    monkeypatch.setattr(sink_spill, "LAG_S", LAG)
    return answer, metric_writes


def _spilled_steps(spill) -> list[int]:
    return [r["step"] for r in read_spill(spill)[1]] if spill.exists() else []


def test_a_later_write_that_hangs_past_the_lag_limit_spills_within_it_and_loses_nothing(
    tmp_path, hung_after_first_write
):
    """The run exists and took iteration 1; the write of iteration 2 hangs.  Iterations logged every
    50 ms go to the spill file as soon as iteration 2 has waited ``LAG_S`` (0.5 s), not before: each
    call is timed, and ``spilled`` must equal ``waited > LAG_S`` for every call whose start and end
    lie on one side of the limit (a ms/s mix-up spills at once, or after 500 s).  Once MLflow answers,
    it has every step once with its value, the spilled ones are marked delivered and the file goes."""
    answer, metric_writes = hung_after_first_write
    store, spill = f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "spill" / "r.jsonl"
    sink = MlflowSink(store, "exp", spill_path=spill)
    assert sink.wait_for_run(120) is not None
    sink.log_iteration(1, _metrics(1))
    assert sink.flush(120) and not spill.exists()  # the run exists and has iteration 1: healthy so far
    t0 = time.time()
    sink.log_iteration(2, _metrics(2))  # its write hangs
    calls = []  # (waited when the call began, waited when it returned, spilled steps then)
    step = 2
    while time.time() - t0 < LAG + 0.4:
        time.sleep(0.05)
        step += 1
        begun = time.time() - t0
        sink.log_iteration(step, _metrics(step))
        calls.append((begun, time.time() - t0, _spilled_steps(spill)))
    clear = [(b, e, s) for b, e, s in calls if e < LAG - 0.005 or b > LAG + 0.005]  # ms-rounded timestamps
    assert [bool(s) for _, _, s in clear] == [b > LAG for b, _, _ in clear], calls
    assert any(b > LAG for b, _, _ in clear) and any(e < LAG for _, e, _ in clear), calls  # both sides seen
    first = next(i for i, (_, _, s) in enumerate(calls) if s)
    assert calls[first][2] == list(range(2, first + 4))  # everything pending went with it, in order
    assert all(s == list(range(2, i + 4)) for i, (_, _, s) in enumerate(calls) if i >= first)  # then each as it came
    assert sink.spilling_ahead is False  # no write failed: it only lagged

    answer.set()  # MLflow answers again
    assert sink.close(timeout_s=120) is True
    history = MlflowClient(store).get_metric_history(sink.run_id, "loss")
    assert sorted((p.step, p.value) for p in history) == [(s, _metrics(s)["loss"]) for s in range(1, step + 1)]
    assert metric_writes[0] == [1] and metric_writes[1] == [2]
    assert not spill.exists() and not spill.parent.exists()  # all delivered: nothing left to replay


def test_a_hang_past_the_lag_limit_then_a_kill_leaves_every_untaken_iteration_to_replay(
    tmp_path, hung_after_first_write
):
    """As above, but the process dies while the write still hangs (the file read as a SIGKILL would
    leave it): a replay into the run's store adds the spilled steps, and MLflow then holds each step
    of the run once, the one MLflow took before the hang included."""
    answer, _ = hung_after_first_write
    store, spill = f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "r.jsonl"
    sink = MlflowSink(store, "exp", spill_path=spill)
    assert sink.wait_for_run(120) is not None
    sink.log_iteration(1, _metrics(1))
    assert sink.flush(120)
    t0 = time.time()
    for step in (2, 3, 4):
        sink.log_iteration(step, _metrics(step))
        time.sleep(max(0.0, t0 + LAG + 0.05 - time.time()) if step == 3 else 0.0)
    assert time.time() - t0 < 10 * LAG and _spilled_steps(spill) == [2, 3, 4]
    killed = tmp_path / "killed.jsonl"
    killed.write_bytes(spill.read_bytes())
    header, records, trailer = read_spill(killed)
    assert header["run_id"] is None and {r["run_id"] for r in records} == {sink.run_id} and trailer is None
    answer.set()
    sink.close(timeout_s=120)  # the live sink delivers them too: the replay must not add them twice
    replay_spill(killed, store)
    history = MlflowClient(store).get_metric_history(sink.run_id, "loss")
    assert sorted((p.step, p.value) for p in history) == [(s, _metrics(s)["loss"]) for s in (1, 2, 3, 4)]
