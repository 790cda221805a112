"""Users' real entry points: `gradmon-ray train` against a real `mlflow server` on 127.0.0.1.

The server runs in its own process group and is torn down even when a test fails.
"""

from __future__ import annotations

import subprocess

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from tests.e2e.processes import BIN, SMALL_TRAIN_ARGS, clean_env, free_port, kill_group, wait_http

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
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
        wait_http(f"http://127.0.0.1:{port}/health", 90)
        yield f"http://127.0.0.1:{port}"
    finally:
        kill_group(proc)


def test_cli_train_against_a_real_mlflow_server(mlflow_server):
    proc = subprocess.run(
        [str(BIN / "gradmon-ray"), "train", *SMALL_TRAIN_ARGS, "--mlflow-uri", mlflow_server, "--experiment", "server"],
        env=clean_env(),
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
