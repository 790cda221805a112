"""Issue 27 item 1: a password in the tracking URI is used, and found nowhere afterwards.

The server is the one ``cluster.yaml`` starts on the head: its own ``mlflow server`` command
(MLflow's basic-auth app, the admin login from ``~/.gradmon-ray/mlflow.env``), run here on
127.0.0.1 with a temporary home.  Its password is a unique marker.  A real short ``gradmon-ray
train`` (and ``gradmon-ray tune``), through the CLI's ``main`` on the session's Ray, then connects
with ``http://admin:MARKER@127.0.0.1:PORT``:
the run must reach the server (a wrong password is refused with 401, so that proves the
marker was used) and the marker must be in no file under the working directory (checkpoints,
``gradmon_resume.json``, Tune's trial state included), in nothing the command printed (fd 2 included), in no row of any
table of the server's database and in no logged artifact.

Without Flask-WTF (``mlflow[auth]``) MLflow's basic-auth app cannot start: then a plain
``mlflow server``, which ignores the password, stands in and the login test is skipped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import main as cli_main
from gradmon_ray.tracking.algorithm_info import TAG_TRIAL_DIR
from gradmon_ray.tracking.mlflow_io import mlflow_value
from gradmon_ray.tracking.store_check import tracking_server_problem
from tests.e2e.in_process import CliResult, run_cli
from tests.e2e.processes import (
    MLFLOW_SERVER_ENV,
    SMALL_TRAIN_ARGS,
    clean_env,
    free_port,
    kill_group,
    mlflow_auth_config,
    mlflow_server_argv,
    session_commands,
    wait_http,
)
from tests.tracking.test_callback import _same

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HAS_AUTH_APP = importlib.util.find_spec("flask_wtf") is not None
CREDENTIAL_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


@dataclass
class Server:
    port: int
    marker: str
    store: Path
    """The server's sqlite backend store."""
    artifacts: Path
    auth: bool
    session: int
    """The session id of its processes (the one it was started in)."""

    def uri(self, password: str | None = None) -> str:
        login = f"admin:{password}@" if password else ""
        return f"http://{login}127.0.0.1:{self.port}"


def _head_mlflow_command(port: int) -> str:
    """cluster.yaml's own command that starts MLflow on the head, bound to 127.0.0.1:``port``."""
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    (command,) = [c for c in cluster["head_start_ray_commands"] if "mlflow server" in c and "pkill" not in c]
    head_ip = "HEAD_IP=$(hostname -I | awk '{print $1}')"
    assert head_ip in command and "--port 5000" in command
    return command.replace(head_ip, "HEAD_IP=127.0.0.1").replace("--port 5000", f"--port {port} --workers 1")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-auth")
    marker = f"Zq{uuid.uuid4().hex}"  # 34 characters: the auth app wants 12 at least
    home = root / "home"
    (home / ".gradmon-ray").mkdir(parents=True)
    credentials = home / ".gradmon-ray" / "mlflow.env"
    credentials.write_text(f"MLFLOW_TRACKING_USERNAME=admin\nMLFLOW_TRACKING_PASSWORD={marker}\n")
    credentials.chmod(0o600)
    port = free_port()
    env = clean_env(HOME=str(home))
    for name in CREDENTIAL_VARS:
        env.pop(name, None)
    if HAS_AUTH_APP:
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(mlflow_auth_config(root / "auth.ini"))
        argv = ["bash", "-c", _head_mlflow_command(port)]
        store, artifacts = home / "mlflow" / "mlflow.db", home / "mlflow" / "artifacts"
    else:
        store, artifacts = root / "server.db", root / "artifacts"
        argv = mlflow_server_argv(port, "--backend-store-uri", f"sqlite:///{store}")
        argv += ["--artifacts-destination", str(artifacts)]
        env.update(MLFLOW_SERVER_ENV)  # cluster.yaml's command sets it itself
    # cluster.yaml's command backgrounds the server (nohup ... &): it stays in this process group.
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 180)
        yield Server(port, marker, store, artifacts, HAS_AUTH_APP, proc.pid)
    finally:
        kill_group(proc, grace_s=10)


@pytest.fixture
def no_credential_env(monkeypatch):
    for name in CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.skipif(not HAS_AUTH_APP, reason="MLflow's basic-auth app needs Flask-WTF (pip install 'mlflow[auth]')")
def test_the_cluster_yaml_server_asks_for_its_login(server, no_credential_env, monkeypatch):
    assert "refused the credentials (HTTP 401)" in tracking_server_problem(server.uri())
    assert "refused the credentials (HTTP 401)" in tracking_server_problem(server.uri("not-the-password-1"))
    assert tracking_server_problem(server.uri(server.marker)) is None
    # How the cluster's nodes authenticate: the variables every `ray start` exports, a plain URI.
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.marker)
    assert tracking_server_problem(server.uri()) is None


@pytest.mark.skipif(not HAS_AUTH_APP, reason="MLflow's basic-auth app needs Flask-WTF (pip install 'mlflow[auth]')")
def test_the_cluster_yaml_server_runs_without_mlflows_job_workers(server):
    """MLflow 3 starts a job runner and its huey consumers with every server unless told not to:
    eight processes that keep an idle server busy (bench/mlflow_server_idle.py).  The server
    cluster.yaml starts has its web server and none of them."""
    commands = session_commands(server.session)
    assert any("uvicorn" in c and "mlflow.server" in c for c in commands), commands  # found the server's
    assert not [c for c in commands if "mlflow.server.jobs" in c or "huey" in c], commands


def _files_holding(marker: str, root: Path) -> list[str]:
    """Every file under ``root`` (hidden ones too) whose bytes contain ``marker``."""
    needle = marker.encode()
    return [str(p) for p in sorted(root.rglob("*")) if p.is_file() and needle in p.read_bytes()]


def _rows_holding(marker: str, store: Path) -> list[tuple[str, tuple]]:
    """Every row of every table of the sqlite database ``store`` whose text contains ``marker``."""
    with sqlite3.connect(store) as db:
        tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        assert {"runs", "params", "tags", "metrics"} <= set(tables)
        found = []
        for table in tables:
            found += [(table, row) for row in db.execute(f'SELECT * FROM "{table}"') if marker in repr(row)]
    return found


def _assert_no_marker_left(server: Server, proc: CliResult, run_dir: Path) -> None:
    assert server.marker not in proc.stdout and server.marker not in proc.stderr
    assert _files_holding(server.marker, run_dir) == []
    assert _files_holding(server.marker, server.artifacts) == []
    assert _rows_holding(server.marker, server.store) == []


def test_train_uses_the_password_and_leaves_it_nowhere(server, ray_session, no_credential_env, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # One checkpoint (iteration 2) and one round of plots (the default plots_every 10: at the run's end):
    # what the search below needs (each further one is seconds of the box, and no new kind of file).
    argv = ["train", *SMALL_TRAIN_ARGS, "--mlflow-uri", server.uri(server.marker), "--experiment", "no-secret"]
    argv += ["--set", "checkpoint_every=2"]
    proc = run_cli(argv, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = f"http://admin:***@127.0.0.1:{server.port}"
    assert f"MLflow: {shown}" in proc.stdout and f"open {shown} in a browser" in proc.stdout

    # The run reached the server with the marker (it is the only login that server accepts) ...
    client = MlflowClient(server.uri(server.marker))
    (run,) = client.search_runs([client.get_experiment_by_name("no-secret").experiment_id])
    assert run.info.status == "FINISHED"
    assert f"gradmon-ray: MLflow run {run.info.run_id} " in proc.stdout  # the run the server holds
    history = client.get_metric_history(run.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, "op"))
    assert sorted(m.step for m in history) == [1, 2]
    # ... the URI's param is there, masked (not just left out) ...
    assert run.data.params["mlflow.tracking_uri"] == shown
    # ... and what the search below covers exists: artifacts on the server, checkpoints here.
    assert client.list_artifacts(run.info.run_id) and list(server.artifacts.rglob("*.png"))
    assert list(run_dir.rglob("gradmon_resume.json"))
    _assert_no_marker_left(server, proc, run_dir)


def test_tune_uses_the_password_and_leaves_it_nowhere(server, ray_session, no_credential_env, tmp_path):
    """Tune writes every trial's config to disk (params.json, its experiment state): the sweep's
    param space holds the URI masked, and the trials get the real one through Ray's object store."""
    run_dir = tmp_path / "sweep"
    run_dir.mkdir()
    (run_dir / "tiny_sweep.yaml").write_text(
        yaml.safe_dump(
            {
                "base": {
                    "iterations": 1,
                    "ppo": {"train_batch_size": 128, "minibatch_size": 64, "num_epochs": 1},
                    "model": {"trunk_hiddens": [16]},
                    "resources": {"num_env_runners": 0},
                    "mlflow": {"experiment": "no-secret-sweep", "plots_every": 0},
                },
                "search_space": {"ppo.lr": {"choice": [0.001]}},
                "max_failures": 0,
            }
        )
    )
    argv = ["tune", "tiny_sweep.yaml", "--mlflow-uri", server.uri(server.marker)]
    proc = run_cli(argv, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(server.uri(server.marker))
    runs = client.search_runs([client.get_experiment_by_name("no-secret-sweep").experiment_id])
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)  # the parent and its one trial
    (trial,) = [r for r in runs if "trial.ppo.lr" in r.data.params]
    assert trial.data.params["mlflow.tracking_uri"] == f"http://admin:***@127.0.0.1:{server.port}"
    assert client.get_metric_history(trial.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, "op"))
    assert list(run_dir.rglob("params.json"))  # Tune's own record of the trial config is searched too
    _assert_no_marker_left(server, proc, run_dir)


def test_offline_ok_spills_without_the_password(ray_session, no_credential_env, tmp_path, monkeypatch):
    """``mlflow.offline_ok`` against a server that is not there: training runs, everything goes to
    the spill file, whose header names the server without its password; no 'MLflow run None'."""
    from gradmon_ray.tracking import mlflow_sink

    # The sink's last chance at close for a server that never took the run (5 s of a real clock, its
    # own test: tracking/test_mlflow_sink.py) is no part of this test: shortened, everything spills sooner.
    monkeypatch.setattr(mlflow_sink, "NEVER_CREATED_CLOSE_S", 0.5)
    marker = f"Zq{uuid.uuid4().hex}"
    run_dir = tmp_path / "offline"
    run_dir.mkdir()
    uri = f"http://admin:{marker}@127.0.0.1:{free_port()}"
    argv = ["train", *SMALL_TRAIN_ARGS, "--mlflow-uri", uri]
    argv += ["--iterations", "1", "--set", "mlflow.offline_ok=true", "--set", "mlflow.plots_every=0"]
    proc = run_cli(argv, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mlflow.offline_ok: training anyway" in proc.stderr
    assert "never took the run; replay it with: gradmon-ray replay" in proc.stdout
    spills = list((run_dir / "gradmon-spill").glob("*.jsonl"))
    assert len(spills) == 1 and "http://admin:***@127.0.0.1:" in spills[0].read_text().splitlines()[0]
    assert marker not in proc.stdout + proc.stderr
    assert _files_holding(marker, run_dir) == []
    assert not any(p.name in ("mlflow.db", "mlruns") for p in run_dir.iterdir())
    assert os.listdir(run_dir)  # the search above saw the spill directory


def _pickled_strings(path: Path) -> str:
    """Every string inside the pickle ``path``, decoded (``pickletools``: opcodes only, nothing is
    loaded): a password held in a pickled object shows here whatever its encoding on disk."""
    import pickletools

    found = []
    with contextlib.suppress(Exception):  # a pickle using an opcode pickletools cannot read: the byte scan still ran
        for _, arg, _ in pickletools.genops(path.read_bytes()):
            if isinstance(arg, (str, bytes)):
                found.append(arg.decode(errors="replace") if isinstance(arg, bytes) else arg)
    return "\n".join(found)


@dataclass
class TunerScript:
    work: Path
    ray_tmp: Path
    proc: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def tuner_script(server, tmp_path_factory):
    """The README's Tuner script (``readme_tuner_script``), the password given the README's way:
    in ``MLFLOW_TRACKING_URI``, with the plain callback class, which is pinned to that URI when
    Tune pickles the config.  Its own local Ray, as the README's user gets: the trial actors
    inherit the script's environment, the variable with the password included.

    The other two ways differ only before Ray starts, in what the driver pickles and sets, and
    are checked there without Ray: ``GradmonMLflowCallback.configured(tracking_uri=...)``'s
    class pickles without the password (``tracking/test_uri_credentials.py``, cloudpickle and
    Ray's), which it moves into ``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``: the variables a user
    may set directly, which the trial actors inherit as they inherit this script's URI (three
    scripts, each a Ray of its own, cost about 80 CPU-seconds of the suite)."""
    work = tmp_path_factory.mktemp("tuner")
    ray_tmp = Path(tempfile.mkdtemp(prefix="gr-", dir="/tmp"))  # Ray's socket paths must fit 107 bytes
    env = clean_env(RAY_TMPDIR=str(ray_tmp), PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=server.uri(server.marker))
    for name in CREDENTIAL_VARS:
        env.pop(name, None)
    argv = [sys.executable, "-m", "tests.e2e.readme_tuner_script", str(work / "tune"), str(work / "result.json")]
    try:
        proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=420)
        yield TunerScript(work, ray_tmp, proc)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_the_readme_tuner_example_uses_the_password_and_writes_it_nowhere(server, tuner_script):
    """The README's own ``Tuner`` with ``GradmonMLflowCallback`` (a script of the user's, its own local
    Ray): the trial logs into the server, and the password is in no file under Tune's storage
    path, the working directory, Ray's session directory (Tune's copies of params.pkl, the logs)
    or the spill directory, in no string of any pickle there, and not in anything the script printed."""
    work, ray_tmp, proc = tuner_script.work, tuner_script.ray_tmp, tuner_script.proc
    assert proc.returncode == 0 and "\ntrials: 2\n" in proc.stdout, proc.stderr[-3000:]

    client = MlflowClient(server.uri(server.marker))  # the trial's run reached the server: it logged in
    trials = {p.name for p in (work / "tune").glob("*/*") if p.is_dir()}
    experiment = client.get_experiment_by_name("gradmon-ray").experiment_id
    (run,) = [r for r in client.search_runs([experiment]) if r.data.tags.get(TAG_TRIAL_DIR) in trials]
    assert run.info.status == "FINISHED"
    assert [p.step for p in client.get_metric_history(run.info.run_id, mn.LEARNERS_UPDATED)] == [1, 2]

    pickles = sorted(p for root in (work, ray_tmp) for p in root.rglob("*.pkl"))
    assert any(p.name == "params.pkl" for p in pickles) and any(p.name == "tuner.pkl" for p in pickles)
    assert any(p.name == "class_and_ctor_args.pkl" for p in pickles)  # a checkpoint's, the config in it
    assert [str(p) for p in pickles if server.marker in _pickled_strings(p)] == []
    assert _files_holding(server.marker, work) == [] and _files_holding(server.marker, ray_tmp) == []
    assert server.marker not in proc.stdout + proc.stderr


def test_the_readme_tuner_example_logs_tunes_values_and_watch_shows_its_run(
    server, tuner_script, no_credential_env, monkeypatch, capfd
):
    """The same script's run, as its user sees it: named after the trial's directory; at step 2
    (the last), every metric of the trial's last result as Tune kept it has that value; the
    README's heads (``pi``, ``vf``) have norms at both steps; the trial printed the run and its
    store once (in its output, which Tune shows on the driver); and ``gradmon-ray watch --once``
    in the user's directory, with the user's ``MLFLOW_TRACKING_URI`` and no flags, shows it,
    without the password."""
    work, ray_tmp = tuner_script.work, tuner_script.ray_tmp
    assert tuner_script.proc.returncode == 0, tuner_script.proc.stderr[-3000:]
    (trial,) = json.loads((work / "result.json").read_text())
    client = MlflowClient(server.uri(server.marker))
    experiment = client.get_experiment_by_name("gradmon-ray").experiment_id
    (run,) = [r for r in client.search_runs([experiment]) if r.data.tags.get(TAG_TRIAL_DIR) == trial["dir"]]
    assert run.info.run_name == trial["dir"]
    # A run's latest value of each metric is its value at the highest step: one request, not one per key.
    expected = {key: mlflow_value(value) for key, value in trial["metrics"].items()}
    assert run.data.metrics.keys() >= expected.keys()
    assert [key for key, value in expected.items() if not _same(run.data.metrics[key], value)] == []
    for head in ("pi", "vf"):
        norms = client.get_metric_history(run.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, head))
        assert sorted(p.step for p in norms) == [1, 2]

    # log_to_file: Tune keeps the trial's output in its working directory under Ray's session directory
    (stdout,) = ray_tmp.rglob(f"working_dirs/{trial['dir']}/stdout")
    printed = [line for line in stdout.read_text().splitlines() if line.startswith("gradmon: MLflow run")]
    shown = f"http://127.0.0.1:{server.port}"
    assert printed == [
        f"gradmon: MLflow run {run.info.run_id} (experiment 'gradmon-ray') in {shown}; "
        f"follow it: gradmon-ray watch --tracking-uri '{shown}' --run-id {run.info.run_id}"
    ]

    monkeypatch.chdir(work)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri(server.marker))
    capfd.readouterr()
    assert cli_main(["watch", "--once"]) == 0
    out, err = capfd.readouterr()
    assert f"run {run.info.run_name} (finished)" in out and "iteration 2" in out, out
    assert "pi" in out and "grad norm" in out
    assert server.marker not in out + err


def test_the_sink_ends_a_run_on_the_server_without_printing_its_login(server, no_credential_env, monkeypatch, capfd):
    """MLflow's ``set_terminated`` writes "View run ... at: <the URI as given>" to stdout for an HTTP
    store: with a login in the URI (a library user's sink, or a trial that inherited such a URI),
    that line carried the password.  The sink turns MLflow's URL printing off for such a URI."""
    from gradmon_ray.tracking import MlflowSink

    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    sink = MlflowSink(server.uri(server.marker), "no-secret-sink", run_name="sink")
    sink.log_iteration(1, {"loss": 0.5})
    assert sink.close() is True
    out, err = capfd.readouterr()
    assert server.marker not in out + err
    run = MlflowClient(server.uri(server.marker)).get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics == {"loss": 0.5}
