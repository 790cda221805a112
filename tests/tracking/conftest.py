"""Shared fixtures for the tracking tests: an MLflow HTTP endpoint that nobody answers."""

from __future__ import annotations

import pytest

from tests.e2e.processes import free_port


@pytest.fixture
def fast_failing_http(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's HTTP client without its own retries (what `gradmon-ray train` sets), so failures are quick."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")


@pytest.fixture
def dead_uri(fast_failing_http: None) -> str:
    """An http:// tracking URI on a 127.0.0.1 port with no server behind it."""
    return f"http://127.0.0.1:{free_port()}"
