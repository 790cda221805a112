"""What the MLflow sink says during an outage (``tracking/sink_outage.py``, issue #47 item 6).

Before: every failed retry logged MLflow's whole exception (~420 characters of urllib3), the
shutdown wait logged "retrying in 30.0s" once a second, and MLflow's HTTP client added urllib3's
own ``Retrying (...)`` warning per retry of every request.  Now: one line when the outage starts,
naming the server and the cause in a few words; at most one per ``REMINDER_S`` while it lasts; one
when it ends; one line in the shutdown wait; what urllib3 and MLflow's SQL store log on the sink's
thread at DEBUG.  Against a port nothing listens on (connection refused, in-process) and, for the
end of an outage, a real ``mlflow server`` started on that port.  The oracle for "what was
delivered" is what a fresh ``MlflowClient`` reads.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray.tracking import MlflowSink, sink_outage
from gradmon_ray.tracking.sink_outage import outage_cause
from tests.e2e.processes import MlflowServer, free_port

SINK_LOGGER = "gradmon_ray.tracking.mlflow_sink"


@pytest.fixture(autouse=True)
def no_retry_filter_yet():
    """Each test starts with the loggers as a fresh process has them (a sink installs the filter once
    per process: an earlier test's sink must not make this one pass), and leaves them as it found them."""
    loggers = [logging.getLogger(name) for name in ("urllib3.connectionpool", "mlflow.store.db.utils")]
    before = {lg.name: list(lg.filters) for lg in loggers}
    for lg in loggers:
        lg.filters = [f for f in lg.filters if type(f).__module__ != sink_outage.__name__]
    yield
    for lg in loggers:
        lg.filters = before[lg.name]


def _sink_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == SINK_LOGGER]


REMINDER = 0.25
"""``sink_outage.REMINDER_S`` in the reminder test: a few of its tries (backoff 0.01 s, doubling) apart."""


def _wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


def _metrics(step: int) -> dict[str, float]:
    return {"grad/global_norm": step * 1.5, "loss": -step / 4}


def test_an_outage_is_one_line_then_a_reminder_per_interval_not_a_line_per_retry(
    dead_uri, tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(sink_outage, "REMINDER_S", REMINDER)  # a minute in production
    spill = tmp_path / "run.jsonl"
    with caplog.at_level("WARNING", logger=SINK_LOGGER):
        sink = MlflowSink(dead_uri, "exp", spill_path=spill, retry_backoff_s=0.01)
        for step in (1, 2, 3):
            sink.log_iteration(step, _metrics(step))
        _wait_for(lambda: sink.failed_writes >= 7)  # tries at 0, 0.01, 0.03, ... 0.31, 0.63 s: 2 reminders
        lines = _sink_lines(caplog)
        tries = sink.failed_writes  # after the lines: each line's count of tries is at most this
    sink.close(timeout_s=0)
    first, *reminders = lines
    assert first.getMessage() == (
        f"gradmon MLflow sink: MLflow at {dead_uri} unavailable (connection refused); training goes on, "
        f"the iterations wait in memory and in {spill} until it is back"
    )
    assert reminders and len(lines) < tries, [r.getMessage() for r in lines]  # not one per try
    for before, line in zip(lines, reminders, strict=False):
        assert line.created - before.created >= REMINDER - 0.05  # the interval (logging's clock is time.time)
        match = re.fullmatch(
            rf"gradmon MLflow sink: MLflow at {re.escape(dead_uri)} still unavailable after (\d+) s "
            r"\((\d+) tries, last: connection refused\); 3 iterations waiting",
            line.getMessage(),
        )
        assert match, line.getMessage()
        assert abs(int(match[1]) - (line.created - first.created)) <= 1 and int(match[2]) <= tries


def test_the_shutdown_wait_is_one_line_and_the_summary_names_the_cause_in_a_few_words(dead_uri, tmp_path, caplog):
    spill = tmp_path / "run.jsonl"
    with caplog.at_level("WARNING", logger=SINK_LOGGER):
        sink = MlflowSink(dead_uri, "exp", spill_path=spill, retry_backoff_s=30.0)
        for step in (1, 2, 3):
            sink.log_iteration(step, _metrics(step))
        _wait_for(lambda: _sink_lines(caplog))  # the outage has started; the sink backs off 30 s
        assert sink.close(timeout_s=3.0) is False  # retries every second while closing
    assert sink.failed_writes >= 3  # retried, silently
    assert [r.getMessage() for r in _sink_lines(caplog)] == [
        f"gradmon MLflow sink: MLflow at {dead_uri} unavailable (connection refused); training goes on, "
        f"the iterations wait in memory and in {spill} until it is back",
        f"gradmon MLflow sink: waiting up to 3 s for MLflow at {dead_uri} (unavailable: connection refused) to "
        f"take 3 iterations and the run's end; they are kept in {spill} meanwhile (if this process is stopped "
        f"first: gradmon-ray replay {spill})",
    ]
    assert sink.undelivered_summary() == (
        f"MLflow at {dead_uri} did not receive everything (3 iterations kept in {spill}; last error: connection "
        f"refused); replay with: gradmon-ray replay {spill}"
    )


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_outage_lines_by_the_clock(caplog):
    """``OutageLog`` alone (pure logic, a hand-wound clock): the reminder a minute after the last line,
    none while closing, the end with how long it lasted and what is left for a replay."""
    clock, logger = _Clock(), logging.getLogger("test.outage")
    log = sink_outage.OutageLog("http://u:pw@h:5000", logger, clock=clock)
    with caplog.at_level("WARNING", logger="test.outage"):
        log.failed("connection refused", closing=False, waiting=1, kept_in=None)
        clock.now += 59.0
        log.failed("connection refused", closing=False, waiting=2, kept_in=None)  # 59 s: no line
        clock.now += 1.0
        log.failed("timed out", closing=False, waiting=3, kept_in=None)  # 60 s: a reminder
        clock.now += 120.0
        log.failed("timed out", closing=True, waiting=3, kept_in=None)  # in the shutdown wait: silent
        clock.now += 5.0
        log.delivered(3, only_in_spill=2, spill="s.jsonl")
        log.delivered(1)  # no outage: nothing
    assert [r.getMessage() for r in caplog.records] == [
        "gradmon MLflow sink: MLflow at http://u:***@h:5000 unavailable (connection refused); training goes on, "
        "the iterations wait in memory until it is back",
        "gradmon MLflow sink: MLflow at http://u:***@h:5000 still unavailable after 60 s (3 tries, last: timed out); "
        "3 iterations waiting",
        "gradmon MLflow sink: MLflow at http://u:***@h:5000 back after 185 s; 3 iterations delivered; 2 iterations "
        "only in s.jsonl: gradmon-ray replay s.jsonl",
    ]
    assert not log.active and log.cause == "timed out"


def test_mlflows_sql_store_errors_on_the_sinks_thread_are_lowered_too(dead_uri, caplog):
    """MLflow's SQL store logs an error and its traceback for every failed statement (a locked
    sqlite file: once per try, each after MLflow's 20 s busy wait); on the sink's thread that is a
    try the sink retries.  The same record on another thread is the user's: left alone."""
    import threading

    MlflowSink(dead_uri, "exp").close(timeout_s=0)  # any sink quiets them, for the whole process
    store_log = logging.getLogger("mlflow.store.db.utils")

    def log_error() -> None:
        store_log.error("SQLAlchemy database error. The following exception is caught.\n%s", "database is locked")

    with caplog.at_level("WARNING"):
        thread = threading.Thread(target=log_error, name=sink_outage.SINK_THREAD_NAME)
        thread.start()
        thread.join()
        log_error()
    assert [(r.threadName, r.levelname) for r in caplog.records if r.name == store_log.name] == [
        ("MainThread", "ERROR")
    ]


def test_mlflows_own_http_retry_warnings_are_lowered_to_debug_not_lost(dead_uri, caplog, monkeypatch):
    """MLflow's client retries each request itself (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, 7 unless the
    CLI set 0): urllib3 logged a ~420-character warning per retry, to the user's terminal."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    port = dead_uri.rsplit(":", 1)[1]
    for level, expected in ((logging.WARNING, []), (logging.DEBUG, ["DEBUG", "DEBUG"])):
        caplog.clear()
        with caplog.at_level(level):
            sink = MlflowSink(dead_uri, "exp", retry_backoff_s=30.0)
            _wait_for(lambda: sink.failed_writes >= 1)  # noqa: B023 (waited for within the iteration)
            sink.close(timeout_s=0)
        # This sink's port only: an earlier test's abandoned sink (``close(timeout_s=0)``) may still be
        # finishing its last request on a loaded box, and its retries are logged here too.
        retries = [
            r
            for r in caplog.records
            if r.name == "urllib3.connectionpool" and "Retrying (" in r.msg and f"port={port}" in r.getMessage()
        ]
        assert [r.levelname for r in retries] == expected  # 2 retries of the first request, at DEBUG only
    with caplog.at_level(logging.WARNING):  # the user's own requests, on their own thread: left alone
        logging.getLogger("urllib3.connectionpool").warning("Retrying (%r) after %r: %s", "r", "e", "/api/2.0/mlflow")
    assert caplog.records[-1].levelname == "WARNING"


@pytest.mark.parametrize(
    ("uri", "cause"),
    [
        ("http://127.0.0.1:{port}", "connection refused"),
        ("http://no-such-host.invalid:5000", "host not found"),
    ],
)
def test_the_cause_is_a_few_words(uri, cause, fast_failing_http):
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException) as raised:
        MlflowClient(uri.format(port=free_port())).get_experiment_by_name("x")
    assert outage_cause(raised.value) == cause
    assert len(str(raised.value)) > 300  # what was logged per retry before


@contextlib.contextmanager
def _relay(port: int, to_port: int) -> Iterator[None]:
    """127.0.0.1:``port`` relayed to 127.0.0.1:``to_port`` while the block runs: the server is back on
    the sink's port the moment the test says, not whenever a starting ``mlflow server`` binds it."""
    listener = socket.create_server(("127.0.0.1", port))

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # the listener was shut down
                return
            upstream = socket.create_connection(("127.0.0.1", to_port))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(src, dst), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()


@pytest.mark.e2e  # a real ``mlflow server``, reached on the port the sink found dead
def test_the_outage_ends_with_one_line_naming_how_long_and_what_was_delivered(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # what `gradmon-ray train` sets
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    server = MlflowServer(free_port(), Path(tmp_path))
    server.start()
    uri = f"http://127.0.0.1:{(port := free_port())}"  # nothing listens on it until the relay starts
    spill = tmp_path / "run.jsonl"
    try:
        server.wait(90)  # up first: the sink's backoff (doubling from 0.2 s) never waits out a slow start
        with caplog.at_level("WARNING", logger=SINK_LOGGER):
            sink = MlflowSink(uri, "outage", spill_path=spill, retry_backoff_s=0.2)
            for step in (1, 2, 3):
                sink.log_iteration(step, _metrics(step))
            _wait_for(lambda: sink.failed_writes >= 2)  # tries at 0 and 0.2 s refused: an outage
            down_at = time.monotonic()
            with _relay(port, server.port):
                assert sink.flush(60.0)
                up_for = time.monotonic() - down_at
                assert sink.close(timeout_s=30.0) is True
            client = MlflowClient(server.uri)
            for key in _metrics(1):
                history = sorted((m.step, m.value) for m in client.get_metric_history(sink.run_id, key))
                assert history == [(step, _metrics(step)[key]) for step in (1, 2, 3)]
    finally:
        server.kill(grace_s=0)  # read above: nothing of it is needed any more
    lines = [r.getMessage() for r in _sink_lines(caplog)]
    assert lines[0].startswith(f"gradmon MLflow sink: MLflow at {uri} unavailable (connection refused)")
    back = [line for line in lines if " back after " in line]
    assert len(back) == 1 and lines[-1] == back[0], lines
    match = re.fullmatch(
        rf"gradmon MLflow sink: MLflow at {re.escape(uri)} back after (\d+) s; 3 iterations delivered", back[0]
    )
    assert match and int(match[1]) <= up_for + 1, back
