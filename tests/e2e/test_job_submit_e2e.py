"""`ray job submit` against a real local head node with token authentication left on.

The head node (``ray start --head --block`` on 127.0.0.1, its own ports, its own temp dir, its own
``HOME`` and a fresh random token) runs in its own process group and is torn down even when a
test fails.  It is started the way docs/operations.md ("Submitting a job") tells a cluster's
nodes to be started, and as cluster.yaml does: ``MLFLOW_TRACKING_URI`` and the MLflow login from
``~/.gradmon-ray/mlflow.env`` (mode 600) in the environment of ``ray start``, nothing on the
submit command line.  The tracking server asks for that login (MLflow's basic-auth app; its
password is a unique marker).  The job ships a working directory holding the run config and a
user regularizer module, the way users submit to a cluster.

One submitted training job carries the module's checks (a Ray job costs tens of seconds): it
succeeds and writes its MLflow run; the tracking server is frozen (SIGSTOP) while it trains, so
the iterations it could not deliver go to its spill file, which must be in the node's
``~/gradmon-spill``, outside Ray's copy of the working directory that Ray deletes, and named in
the job's first lines; then the server is thawed and gets every iteration.  Afterwards the
password must be in no file under Ray's temp directory (``runtime_env_agent.log`` included), no
file under the node's home but the credentials file, and no process's command line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from tests.e2e.processes import (
    BIN,
    MLFLOW_SERVER_ENV,
    clean_env,
    free_port,
    kill_group,
    mlflow_auth_config,
    mlflow_server_argv,
    wait_http,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("flask_wtf") is None,
        reason="MLflow's basic-auth app needs Flask-WTF (pip install 'mlflow[auth]')",
    ),
]

JOB_TIMEOUT_S = 480
CREDENTIALS = Path(".gradmon-ray") / "mlflow.env"
"""Where cluster.yaml and the docs keep the MLflow login on every node, relative to the home directory."""


@dataclass(frozen=True)
class HeadNode:
    """A running local head node: its dashboard (job server) address and its auth token."""

    dashboard: str
    token: str
    tracking_uri: str
    """What the node's ``ray start`` exported as ``MLFLOW_TRACKING_URI``: the login-protected server."""
    store_uri: str
    """The server's own backend store, which the test reads directly (no login needed)."""
    password: str
    """The MLflow login's password: a unique marker, searched for afterwards."""
    home: Path
    """The head's ``HOME``: where its job's driver runs, ``~/gradmon-spill`` is there."""
    temp_dir: Path
    """Ray's temp directory (``--temp-dir``): the session directory and everything Ray writes."""
    mlflow_group: int
    """The tracking server's process group (frozen and thawed with SIGSTOP/SIGCONT)."""

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

    def ray_argv(self, *args: str) -> list[str]:
        """``ray <args> --address <dashboard>``."""
        return [str(BIN / "ray"), *args[:2], "--address", self.dashboard, *args[2:]]

    def ray(self, *args: str, token: str | None = "own", timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``ray <args> --address <dashboard>`` in a subprocess (the SDK caches the auth mode per process)."""
        return subprocess.run(
            self.ray_argv(*args), env=self.env(token), capture_output=True, text=True, timeout=timeout
        )


def _start_mlflow_server(root: Path, port: int, password: str) -> subprocess.Popen:
    """cluster.yaml's head server on 127.0.0.1: MLflow's basic-auth app, the admin login ``password``
    (from the environment, as cluster.yaml's command passes it), no job workers."""
    store = root / "mlflow"
    store.mkdir()
    argv = mlflow_server_argv(port, "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}")
    argv += ["--artifacts-destination", str(store / "artifacts"), "--app-name", "basic-auth"]
    env = clean_env(**MLFLOW_SERVER_ENV, MLFLOW_AUTH_CONFIG_PATH=str(mlflow_auth_config(root / "auth.ini")))
    env.update(MLFLOW_AUTH_ADMIN_USERNAME="admin", MLFLOW_AUTH_ADMIN_PASSWORD=password)
    env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = secrets.token_hex(32)
    log = (root / "mlflow-server.log").open("w")
    # cwd: the auth app keeps its users in ./basic_auth.db, as cluster.yaml's `cd ~/mlflow` does.
    return subprocess.Popen(argv, env=env, cwd=store, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def head_node(tmp_path_factory) -> Iterator[HeadNode]:
    root = tmp_path_factory.mktemp("job-cluster")
    # A short temp dir: Ray's unix socket paths must stay under ~107 characters.
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    token = secrets.token_hex(32)
    password = f"Pw{secrets.token_hex(16)}"  # unique: found nowhere by chance; 12 characters at least for MLflow
    home = root / "home"
    (home / CREDENTIALS).parent.mkdir(parents=True)
    (home / CREDENTIALS).write_text(f"MLFLOW_TRACKING_USERNAME=admin\nMLFLOW_TRACKING_PASSWORD={password}\n")
    (home / CREDENTIALS).chmod(0o600)
    mlflow_port = free_port()
    server = _start_mlflow_server(root, mlflow_port, password)  # starts while the head node does
    tracking_uri = f"http://127.0.0.1:{mlflow_port}"
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
    # As docs/operations.md and cluster.yaml start every node: the login from the credentials file into
    # the environment of `ray start` (never a command line), MLFLOW_TRACKING_URI beside it.
    login_then = 'set -a; . "$HOME/.gradmon-ray/mlflow.env"; set +a; exec "$@"'
    log = Path(temp_dir) / "ray-start.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", login_then, "bash", *cmd],
            env=clean_env(
                RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, MLFLOW_TRACKING_URI=tracking_uri, HOME=str(home)
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # The job API answers 401 until we send the token: that is the server being up.
        wait_http(f"http://127.0.0.1:{dashboard_port}/api/version", 120, ok_codes=(401,))
        wait_http(f"{tracking_uri}/health", 120, proc=server)
        yield HeadNode(
            dashboard=f"http://127.0.0.1:{dashboard_port}",
            token=token,
            tracking_uri=tracking_uri,
            store_uri=f"sqlite:///{root / 'mlflow' / 'mlflow.db'}",
            password=password,
            home=home,
            temp_dir=Path(temp_dir),
            mlflow_group=server.pid,
        )
    except Exception:
        print(log.read_text()[-4000:], (root / "mlflow-server.log").read_text()[-3000:])
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGCONT)  # a frozen server cannot take its SIGTERM
        kill_group(server, grace_s=1)  # its store was read already; a graceful stop only costs time
        kill_group(proc, grace_s=5)  # the whole group (raylet, GCS, dashboard) goes with it
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def working_dir(tmp_path_factory) -> Path:
    """What a user ships with ``--working-dir``: a run config and their own regularizer module.

    The regularizer also holds the job's first update until the test says go (``signals/go``),
    after saying it got there (``signals/training``): the test freezes the tracking server in
    between, when the MLflow run exists and no iteration has been logged."""
    root = tmp_path_factory.mktemp("job-wd")
    wd, signals = root / "job", root / "signals"
    wd.mkdir()
    signals.mkdir()
    (wd / "signals.txt").write_text(str(signals))
    (wd / "job_regs.py").write_text(
        textwrap.dedent(
            '''
            import pathlib
            import time

            SIGNALS = pathlib.Path(pathlib.Path(__file__).with_name("signals.txt").read_text())
            _held = []


            def bias_l1(module, batch, fwd_out):
                """A user regularizer that only exists in the job's working directory."""
                if not _held:  # the first update: wait until the test has frozen the MLflow server
                    _held.append(True)
                    (SIGNALS / "training").touch()
                    deadline = time.monotonic() + 120
                    while not (SIGNALS / "go").exists() and time.monotonic() < deadline:
                        time.sleep(0.05)
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


@dataclass
class SubmittedJob:
    """What the module's one training job left: the submit command's output and exit code, the spill
    file as it was while the tracking server was frozen, and every process's command line then."""

    returncode: int
    output: str
    spill: Path | None
    """The job's spill file, found while the server was frozen (None: none was written in time)."""
    spill_text: str
    spilled_elsewhere: list[Path]
    """Spill files in Ray's copy of the working directory (under its temp directory), which Ray deletes."""
    command_lines: list[str]
    """``/proc/*/cmdline`` of every process, read while the job was training and after it."""
    canary: str
    """A value given the way the old docs gave the MLflow login (``--runtime-env-json``)."""


def _command_lines() -> list[str]:
    """Every process's command line, as any user of the machine can read it."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            found.append(cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return found


def _spill_files(head_node: HeadNode) -> tuple[list[Path], list[Path]]:
    """The spill files in the node's ``~/gradmon-spill`` and those in Ray's copies of the working directory."""
    home = sorted((head_node.home / "gradmon-spill").glob("*.jsonl"))
    ray_copy = head_node.temp_dir.glob("session_*/runtime_resources/working_dir_files/*/gradmon-spill/*.jsonl")
    return home, sorted(ray_copy)


@pytest.fixture(scope="module")
def training_job(head_node: HeadNode, working_dir: Path) -> SubmittedJob:
    """The docs' job command, run from the shipped directory (``--working-dir .``), with the MLflow
    server frozen from the job's first update until its spill file appears, then thawed."""
    signals = Path((working_dir / "signals.txt").read_text())
    log = working_dir.parent / "submit.log"
    # --runtime-env-json: a control for the scan, never a login: Ray writes a job's runtime environment,
    # values included, into its session directory (runtime_env_agent.log), and this command line is in
    # /proc while it runs: the scan must find the canary both ways, as it would the old docs' password.
    canary = f"Cn{secrets.token_hex(16)}"
    runtime_env = json.dumps({"env_vars": {"GRADMON_CANARY": canary}})
    argv = head_node.ray_argv("job", "submit", "--submission-id", "gradmon-e2e-train", "--entrypoint-num-cpus", "1")
    argv += ["--working-dir", ".", "--runtime-env-json", runtime_env]
    argv += ["--", "gradmon-ray", "train", "--config", "job.yaml"]
    spill, text, elsewhere, lines = None, "", [], []
    with log.open("w") as out:
        submit = subprocess.Popen(argv, cwd=working_dir, env=head_node.env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not (signals / "training").exists() and submit.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(head_node.mlflow_group, signal.SIGSTOP)  # the MLflow run exists; no iteration is logged yet
        (signals / "go").touch()
        while submit.poll() is None and time.monotonic() < deadline:
            home, elsewhere = _spill_files(head_node)
            if home or elsewhere:
                spill, lines = (home or [None])[0], _command_lines()  # mid-job: every Ray process is alive
                text = spill.read_text() if spill else ""
                break
            time.sleep(0.1)
        os.killpg(head_node.mlflow_group, signal.SIGCONT)  # MLflow takes it all now: the job ends FINISHED
        submit.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head_node.mlflow_group, signal.SIGCONT)
        if submit.poll() is None:
            submit.kill()
            submit.wait()
    lines += _command_lines()
    return SubmittedJob(submit.returncode, log.read_text(), spill, text, elsewhere, lines, canary)


def test_submitted_training_job_succeeds_and_writes_mlflow(head_node: HeadNode, training_job: SubmittedJob):
    # Without --no-wait the CLI follows the job's logs and exits 1 when it fails.
    assert training_job.returncode == 0, training_job.output[-4000:]
    assert "gradmon-ray: done." in training_job.output
    assert "MLflow did not receive everything" not in training_job.output  # the thawed server got all of it

    assert head_node.api("/api/jobs/gradmon-e2e-train")["status"] == "SUCCEEDED"

    client = MlflowClient(head_node.store_uri)  # the node's MLFLOW_TRACKING_URI and login reached the job
    (run,) = client.search_runs([client.get_experiment_by_name("job").experiment_id])
    assert run.info.status == "FINISHED"
    assert "job_regs:bias_l1" in run.data.params["regularizers"]  # imported from the shipped working dir
    for head in ("op", "value"):
        history = client.get_metric_history(run.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, head))
        assert [m.step for m in history] == [1, 2]  # each once: the spilled ones delivered, none twice


def test_the_jobs_spill_file_is_in_the_nodes_home_and_named_at_start(head_node: HeadNode, training_job: SubmittedJob):
    """Issue #47 item 1: Ray deletes its copy of ``--working-dir`` (the job's working directory), so
    the default ``gradmon-spill`` goes to ``~/gradmon-spill`` of the node running the job's driver."""
    spill_dir = head_node.home / "gradmon-spill"
    assert training_job.spill is not None, f"no spill file in {spill_dir}; found {training_job.spilled_elsewhere}"
    assert training_job.spilled_elsewhere == []  # none in Ray's copy of the working directory
    assert training_job.spill.parent == spill_dir
    records = [json.loads(line) for line in training_job.spill_text.splitlines()]
    client = MlflowClient(head_node.store_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("job").experiment_id])
    iterations = [r for r in records[1:] if "step" in r]
    assert records[0]["gradmon_spill"] == 1 and {r["run_id"] for r in iterations} == {run.info.run_id}
    # Frozen before iteration 1 was logged: the spill file held both iterations MLflow had not taken.
    assert sorted({r["step"] for r in iterations if r.get("metrics")}) == [1, 2]
    assert not training_job.spill.exists()  # delivered once the server was back: the file is gone again
    # The job's first lines say where: the banner, then the spill place on this node.
    lines = [line for line in training_job.output.splitlines() if line.startswith("gradmon-ray:")]
    assert lines[0].startswith("gradmon-ray: training 2 iterations on "), lines
    assert lines[1].startswith(f"gradmon-ray: iterations MLflow cannot take are kept in {spill_dir} on node "), lines


def _files_holding(needle: str, root: Path, skip: tuple[Path, ...] = ()) -> list[str]:
    """Every regular file under ``root`` (hidden ones too) whose bytes contain ``needle``."""
    found = []
    for path in sorted(root.rglob("*")):
        with contextlib.suppress(OSError):  # a file Ray removed meanwhile
            if path.is_file() and not path.is_symlink() and path not in skip and needle.encode() in path.read_bytes():
                found.append(str(path))
    return found


def test_the_documented_login_reaches_the_job_and_is_written_nowhere(head_node: HeadNode, training_job: SubmittedJob):
    """Issue #47 item 2: the login in the nodes' environment (docs/operations.md, cluster.yaml) is in no
    file Ray writes and on no command line; the canary given the way the old docs gave the login
    (``--runtime-env-json``) is found both ways, so the scan would have caught that."""
    canary = training_job.canary
    assert training_job.returncode == 0, training_job.output[-4000:]  # the server, which asks for it, took the run
    session = head_node.temp_dir
    assert any("runtime_env_agent.log" in path for path in _files_holding(canary, session))
    assert any(canary in line for line in training_job.command_lines)
    assert _files_holding(head_node.password, session) == []
    assert [line for line in training_job.command_lines if head_node.password in line] == []
    assert head_node.password not in training_job.output and head_node.password not in training_job.spill_text
    assert _files_holding(head_node.password, head_node.home, skip=(head_node.home / CREDENTIALS,)) == []


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
