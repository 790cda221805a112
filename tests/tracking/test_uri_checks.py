"""The up-front MLflow checks of store_check: the URI scheme, and one bounded probe of a server.

Oracles: MLflow 3.17's own store registry decides which schemes it can track to (a second code
path: MLflow's, not ours); a real HTTP server on 127.0.0.1 (``http.server`` in a thread, no
subprocess) records what the probe sent, and its Basic credentials are decoded with base64.
"""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest

from gradmon_ray.tracking.redact import redact_uri
from gradmon_ray.tracking.store_check import (
    SERVER_PROBE_ENDPOINT,
    local_store_problem,
    tracking_scheme,
    tracking_server_problem,
    uri_scheme_problem,
)
from tests.e2e.processes import free_port

URIS = [
    "mlfow://localhost:5000",
    "localhost:5000",
    "htp://host:5000",
    "s3://bucket/mlruns",
    "postgres://u@h/db",  # MLflow wants "postgresql"
    "http://127.0.0.1:5000",
    "HTTPS://host",
    "file:///tmp/mlruns",
    "sqlite:///mlflow.db",
    "postgresql://u:pw@h:5432/db",
    "postgresql+psycopg2://u@h/db",
    "mysql+pymysql://u@h/db",
    "mssql+pyodbc://u@h/db",
    "databricks",
    "databricks://profile",
    "mlruns",
    "/abs/mlruns",
]


def _mlflow_accepts(uri: str) -> bool:
    """Whether MLflow 3.17 has a tracking store for ``uri``'s scheme (its own registry and resolver)."""
    from mlflow.tracking._tracking_service.utils import _get_tracking_scheme_with_resolved_uri

    return _get_tracking_scheme_with_resolved_uri(uri) != "None"


@pytest.mark.parametrize("uri", URIS)
def test_the_scheme_check_agrees_with_mlflows_registry(uri):
    problem = uri_scheme_problem(uri)
    assert (problem is None) == _mlflow_accepts(uri), (uri, problem)
    if problem is not None:
        assert problem.startswith(f"{redact_uri(uri)}: unknown scheme {tracking_scheme(uri)!r}")
        assert "file, sqlite, postgresql, mysql, mssql, http, https, databricks" in problem
        assert local_store_problem(uri, must_exist=False) == problem  # the check every caller already makes


def test_registry_only_schemes_and_typos_are_named(tmp_path):
    assert "model registry scheme, not a tracking one" in uri_scheme_problem("databricks-uc")
    assert "(a server is http://localhost:5000)" in uri_scheme_problem("localhost:5000")
    assert uri_scheme_problem("mlfow://u:hunter2@h:5000") == (
        "mlfow://u:***@h:5000: unknown scheme 'mlfow'; MLflow tracks to file, sqlite, postgresql, mysql, mssql, "
        "http, https, databricks URIs or a local directory path"
    )
    # "databricks" is not a directory named databricks (it was, before the scheme check).
    assert local_store_problem("databricks", must_exist=True) is None


class _Recorder(http.server.BaseHTTPRequestHandler):
    status = 200
    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self) -> None:
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        body = b'{"experiments": []}'
        self.send_response(type(self).status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Handler", (_Recorder,), {"seen": [], "status": 200})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def _basic(header: str | None) -> str:
    assert header is not None and header.startswith("Basic ")
    return base64.b64decode(header.removeprefix("Basic ")).decode()


def test_a_server_that_answers_passes_and_gets_the_uris_login(recorder, monkeypatch):
    hostport, handler = recorder
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert tracking_server_problem(f"http://alice:pw-in-uri-1@{hostport}") is None
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw-from-env-2")
    assert tracking_server_problem(f"http://{hostport}") is None
    (first_path, first_auth), (_, second_auth) = handler.seen
    assert first_path == f"{SERVER_PROBE_ENDPOINT}?max_results=1"
    assert _basic(first_auth) == "alice:pw-in-uri-1"  # exactly what the run's MLflow client sends
    assert _basic(second_auth) == "bob:pw-from-env-2"


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (401, "refused the credentials (HTTP 401); give them in the URI"),
        (403, "refused the credentials (HTTP 403)"),
        (404, "answered HTTP 404 to /api/2.0/mlflow/experiments/search: not a working MLflow tracking server"),
    ],
)
def test_a_server_that_refuses_is_a_problem_even_offline_ok(recorder, status, expected):
    hostport, handler = recorder
    handler.status = status
    for offline_ok in (False, True):  # offline_ok covers a server that is not there, not a wrong one
        problem = tracking_server_problem(f"http://u:Zq9-hunter@{hostport}", offline_ok=offline_ok)
        assert problem is not None and expected in problem, problem
        assert "Zq9-hunter" not in problem and f"http://u:***@{hostport}" in problem


def test_a_server_that_is_not_there(caplog):
    uri = f"http://u:Zq9-hunter@127.0.0.1:{free_port()}"
    problem = tracking_server_problem(uri, timeout_s=2)
    assert problem is not None and problem.startswith("no MLflow tracking server answers at http://u:***@127.0.0.1:")
    assert "within 2 s (ConnectionRefusedError" in problem and "mlflow.offline_ok: true" in problem
    assert "Zq9-hunter" not in problem
    with caplog.at_level("WARNING"):
        assert tracking_server_problem(uri, timeout_s=2, offline_ok=True) is None
    assert "mlflow.offline_ok: training anyway" in caplog.text and "Zq9-hunter" not in caplog.text


@pytest.mark.parametrize("uri", ["sqlite:///mlflow.db", "file:///tmp/x", "mlruns", "databricks"])
def test_stores_that_are_not_http_servers_are_not_probed(uri):
    assert tracking_server_problem(uri, timeout_s=0.01) is None
