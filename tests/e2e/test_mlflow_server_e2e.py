"""Users' real entry points: `gradmon-ray train` against a real `mlflow server` on 127.0.0.1.

The server runs in its own process group and is torn down even when a test fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
SMALL = ["--iterations", "2", "--set", "ppo.train_batch_size=256", "--set", "ppo.minibatch_size=128"]
SMALL += ["--set", "ppo.num_epochs=1", "--set", "model.trunk_hiddens=[32]"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout_s: float, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2):
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
            return
        except subprocess.TimeoutExpired:
            continue


def _clean_env(**extra: str) -> dict[str, str]:
    drop = ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    proc = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{tmp / 'server.db'}",
            "--default-artifact-root",
            str(tmp / "art"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", 90)
        yield f"http://127.0.0.1:{port}"
    finally:
        _kill_group(proc)


def test_cli_train_against_a_real_mlflow_server(mlflow_server):
    proc = subprocess.run(
        [str(BIN / "gradmon-ray"), "train", *SMALL, "--mlflow-uri", mlflow_server, "--experiment", "server"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("server").experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, "op"))
    assert [m.step for m in history] == [1, 2]
