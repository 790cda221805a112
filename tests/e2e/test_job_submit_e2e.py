"""`ray job submit` against a real local head node with token authentication left on.

The head node (``ray start --head --block`` on 127.0.0.1, its own ports, its own temp dir and a
fresh random token) runs in its own process group and is torn down even when a test fails.
The job ships a working directory holding the run config and a user regularizer module, the way
users submit to a cluster (docs/operations.md: "Submitting a job").
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import tempfile
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from tests.e2e.processes import BIN, clean_env, free_port, kill_group, wait_http

pytestmark = pytest.mark.e2e

JOB_TIMEOUT_S = 480


@dataclass(frozen=True)
class HeadNode:
    """A running local head node: its dashboard (job server) address and its auth token."""

    dashboard: str
    token: str
    tracking_uri: str

    def env(self, token: str | None = "own") -> dict[str, str]:
        """Environment for a Ray CLI call: the cluster's token, another token, or none at all."""
        if token is None:
            # No token anywhere: not in the env and no ~/.ray/auth_token (HOME is empty).
            return clean_env(RAY_AUTH_MODE="token", HOME=tempfile.mkdtemp(prefix="gradmon-nohome-"))
        return clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token if token == "own" else token)

    def api(self, path: str) -> object:
        """GET ``path`` of the cluster's job API with its token: the REST calls under ``ray job status``
        and ``ray job list`` (a Ray CLI process costs seconds; the submissions themselves use the CLI)."""
        request = urllib.request.Request(f"{self.dashboard}{path}", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def ray(self, *args: str, token: str | None = "own", timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``ray <args> --address <dashboard>`` in a subprocess (the SDK caches the auth mode per process)."""
        return subprocess.run(
            [str(BIN / "ray"), *args[:2], "--address", self.dashboard, *args[2:]],
            env=self.env(token),
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture(scope="module")
def head_node(tmp_path_factory) -> Iterator[HeadNode]:
    # A short temp dir: Ray's unix socket paths must stay under ~107 characters.
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    token = secrets.token_hex(32)
    # As cluster.yaml does: every node's `ray start` carries MLFLOW_TRACKING_URI, so jobs need no flag.
    tracking_uri = f"sqlite:///{tmp_path_factory.mktemp('cluster-mlflow') / 'mlflow.db'}"
    dashboard_port = free_port()
    cmd = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={free_port()}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        # Workers' ports away from the test session's own Ray (which uses the default 10002-19999).
        "--min-worker-port=20100",
        "--max-worker-port=20999",
        "--num-cpus=3",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]
    log = Path(temp_dir) / "ray-start.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            env=clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, MLFLOW_TRACKING_URI=tracking_uri),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # The job API answers 401 until we send the token: that is the server being up.
        wait_http(f"http://127.0.0.1:{dashboard_port}/api/version", 120, ok_codes=(401,))
        yield HeadNode(dashboard=f"http://127.0.0.1:{dashboard_port}", token=token, tracking_uri=tracking_uri)
    except Exception:
        print(log.read_text()[-4000:])
        raise
    finally:
        kill_group(proc, grace_s=5)  # the whole group (raylet, GCS, dashboard) goes with it
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def working_dir(tmp_path: Path) -> Path:
    """What a user ships with ``--working-dir``: a run config and their own regularizer module."""
    wd = tmp_path / "job"
    wd.mkdir()
    (wd / "job_regs.py").write_text(
        textwrap.dedent(
            '''
            def bias_l1(module, batch, fwd_out):
                """A user regularizer that only exists in the job's working directory."""
                return sum(head[-1].bias.abs().sum() for head in module.heads.values())
            '''
        )
    )
    (wd / "job.yaml").write_text(
        textwrap.dedent(
            """
            iterations: 2
            ppo: {train_batch_size: 256, minibatch_size: 128, num_epochs: 1}
            model: {trunk_hiddens: [32]}
            regularizers: [{name: bias_l1, fn: "job_regs:bias_l1", weight: 0.001}]
            mlflow: {experiment: job}
            """
        )
    )
    return wd


def test_submitted_training_job_succeeds_and_writes_mlflow(head_node: HeadNode, working_dir: Path):
    submit = head_node.ray(
        "job",
        "submit",
        "--submission-id",
        "gradmon-e2e-train",
        "--working-dir",
        str(working_dir),
        "--",
        "gradmon-ray",
        "train",
        "--config",
        "job.yaml",
        timeout=JOB_TIMEOUT_S,
    )
    # Without --no-wait the CLI follows the job's logs and exits 1 when it fails.
    assert submit.returncode == 0, (submit.stdout + submit.stderr)[-4000:]
    assert "gradmon-ray: done." in submit.stdout

    assert head_node.api("/api/jobs/gradmon-e2e-train")["status"] == "SUCCEEDED"

    client = MlflowClient(head_node.tracking_uri)  # the node's MLFLOW_TRACKING_URI reached the job
    (run,) = client.search_runs([client.get_experiment_by_name("job").experiment_id])
    assert run.info.status == "FINISHED"
    assert "job_regs:bias_l1" in run.data.params["regularizers"]  # imported from the shipped working dir
    for head in ("op", "value"):
        history = client.get_metric_history(run.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, head))
        assert [m.step for m in history] == [1, 2]


def test_a_job_without_a_lasting_tracking_uri_is_refused(head_node: HeadNode, working_dir: Path):
    """No --mlflow-uri and no MLFLOW_TRACKING_URI: the embedded sqlite:///mlflow.db would land in
    Ray's throwaway copy of the working directory, so the job exits 2 with one line, and no
    store is left in it."""
    submit = head_node.ray(
        "job",
        "submit",
        "--submission-id",
        "gradmon-e2e-no-uri",
        "--working-dir",
        str(working_dir),
        "--",
        "env",
        "-u",
        "MLFLOW_TRACKING_URI",
        "gradmon-ray",
        "train",
        "--config",
        "job.yaml",
        timeout=JOB_TIMEOUT_S,
    )
    logs = submit.stdout + submit.stderr
    assert submit.returncode != 0, logs[-4000:]
    assert "gradmon-ray: config error: mlflow.tracking_uri: sqlite:///mlflow.db would be written inside" in logs
    assert "working_dir_files" in logs and "Traceback" not in logs
    assert "gradmon-ray: training" not in logs  # refused before the banner, Ray or MLflow


@pytest.mark.parametrize("token", [None, "0" * 64], ids=["no-token", "wrong-token"])
def test_submission_without_the_clusters_token_is_refused(head_node: HeadNode, token: str | None):
    refused = head_node.ray("job", "submit", "--no-wait", "--", "echo", "should-not-run", token=token)
    assert refused.returncode != 0
    assert "AuthenticationError" in refused.stderr
    assert (
        ("Missing" in refused.stderr or "couldn't find" in refused.stderr)
        if token is None
        else ("Invalid authentication token" in refused.stderr)
    )
    # The raw job API agrees: no header -> 401, wrong bearer token -> 403.
    request = urllib.request.Request(
        f"{head_node.dashboard}/api/jobs/",
        data=json.dumps({"entrypoint": "echo should-not-run"}).encode(),
        headers={"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {}),
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == (401 if token is None else 403)
    # And nothing was queued.
    assert not [job for job in head_node.api("/api/jobs/") if "should-not-run" in job["entrypoint"]]
