"""The README's Tuner example (a user's own ``Tuner`` with ``GradmonMLflowCallback``) where it used to
lose or strand runs: a tracking server that is not there, one killed mid-trial, and a trial that
never updated.

Tune asks a finished trial's actor to stop and kills it 10 s later; before, the callback's close
waited 30 s for MLflow, so the kill took every iteration with it (no spill file, no warning, exit
0) or left the run ``RUNNING``.  The oracle for the values is the trial's last result as Tune kept
it (``result_to_metrics``), compared with what MLflow holds after ``gradmon-ray replay``.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import main as cli_main
from gradmon_ray.tracking.algorithm_info import TAG_TRIAL_DIR
from gradmon_ray.tracking.mlflow_io import mlflow_value
from gradmon_ray.tracking.result_metrics import result_to_metrics
from gradmon_ray.tracking.spill import read_spill
from tests.e2e.processes import MlflowServer, free_port
from tests.tracking.test_callback import ONE_ENV_RUNNER, _same, readme_tuner_example

pytestmark = pytest.mark.e2e

USER_CONFIG = 'PPOConfig().environment("CartPole-v1")'
RUN_CONFIG = 'tune.RunConfig(stop={"training_iteration": 2})'


def _run_readme_example(tmp_path: Path, *, iterations: int = 2, env_runners: str = "") -> tuple[Any, str]:
    """The README block, CI-sized, run in ``tmp_path``; its result grid and the trial's stderr.

    Sampled in the trial's own process unless ``env_runners`` (an ``.env_runners(...)`` call) asks
    for the block's EnvRunner: an EnvRunner actor is one more process importing torch and RLlib,
    and these tests are about the tracking server (the block as written runs in the doc-block
    runner, ``tests/e2e/test_doc_commands_e2e.py``)."""
    code = readme_tuner_example()
    assert code.count(USER_CONFIG) == 1 and code.count(RUN_CONFIG) == 1 and "\ntune.Tuner(" in code
    assert code.count(ONE_ENV_RUNNER) == 1
    if not env_runners:
        code = code.replace(ONE_ENV_RUNNER, "num_env_runners=0")
    small = ".training(train_batch_size=256, minibatch_size=128, num_epochs=1)" + env_runners
    code = code.replace(USER_CONFIG, USER_CONFIG + small)
    run_config = f'tune.RunConfig(stop={{"training_iteration": {iterations}}}, storage_path={str(tmp_path / "tune")!r}'
    code = code.replace(RUN_CONFIG, run_config + ", verbose=0, log_to_file=True)")
    namespace: dict[str, Any] = {}
    exec(compile(code.replace("\ntune.Tuner(", "\ngrid = tune.Tuner("), "README.md", "exec"), namespace)
    grid = namespace["grid"]
    assert not grid.errors and len(grid) == 1
    # log_to_file: Tune keeps the trial's output in its working directory under Ray's session directory
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    (stderr,) = session.glob(f"artifacts/*/*/working_dirs/{Path(grid[0].path).name}/stderr")
    return grid, stderr.read_text()


def test_a_dead_server_loses_nothing_the_trial_logged_and_the_driver_is_told_where(ray_session, tmp_path, monkeypatch):
    """MLflow's own HTTP client retries a refused connection for minutes, so no write *fails* before
    Tune stops the trial: every iteration must be on disk anyway, the trial's output (which Tune
    shows on the driver) must name the file, and the file must replay to what Tune reported."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # the driver's setting
    grid, stderr = _run_readme_example(tmp_path)
    (spill,) = (tmp_path / "gradmon-spill").glob("*.jsonl")
    assert f"gradmon-ray replay {spill}" in stderr, stderr[-3000:]
    _, records, trailer = read_spill(spill)
    assert sorted({r["step"] for r in records if r["metrics"]}) == [1, 2]
    assert trailer is not None and trailer["status"] == "FINISHED" and trailer["run_id"] is None

    store = f"sqlite:///{tmp_path / 'later.db'}"
    assert cli_main(["replay", str(spill), "--tracking-uri", store]) == 0
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("gradmon-ray").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags[TAG_TRIAL_DIR] == Path(grid[0].path).name
    for key, value in result_to_metrics(grid[0].metrics).items():  # Tune's last result is step 2
        points = {p.step: p.value for p in client.get_metric_history(run.info.run_id, key)}
        assert _same(points[2], mlflow_value(value)), key
    assert [p.step for p in client.get_metric_history(run.info.run_id, mn.LEARNERS_UPDATED)] == [1, 2]


def _kill_when_step_arrives(server: MlflowServer, step: int, timeout_s: float = 240) -> threading.Thread:
    """Kill ``server`` (SIGKILL) once its store holds an iteration ``step``: read in its sqlite file."""

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with sqlite3.connect(server.store / "server.db", timeout=1) as db:
                    (top,) = db.execute(
                        "SELECT max(step) FROM metrics WHERE key = ?", (mn.LEARNERS_UPDATED,)
                    ).fetchone()
            except sqlite3.Error:
                top = None
            if top is not None and top >= step:
                server.kill(grace_s=0)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_server_killed_mid_trial_loses_nothing_and_replay_completes_the_run(ray_session, tmp_path, monkeypatch):
    """The server dies after the trial's iteration 2 reached it: what it had not taken is in the spill
    file, and replaying that file into the server's own store leaves every iteration there exactly
    once, the last one with Tune's values, and the run FINISHED."""
    server = MlflowServer(free_port(), tmp_path)
    server.start()
    try:
        server.wait(120)
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
        killer = _kill_when_step_arrives(server, 2)
        grid, stderr = _run_readme_example(tmp_path, iterations=6)
        killer.join(1)
        assert not server.processes, "the server was never killed: the test saw no iteration 2 in its store"
    finally:
        server.kill(grace_s=0)
    (spill,) = (tmp_path / "gradmon-spill").glob("*.jsonl")
    assert f"gradmon-ray replay {spill}" in stderr, stderr[-3000:]
    _, records, trailer = read_spill(spill)
    undelivered = sorted({r["step"] for r in records if r["metrics"]})
    assert undelivered and undelivered[-1] == 6 and trailer["status"] == "FINISHED"  # the premise: an outage

    store = f"sqlite:///{tmp_path / 'server.db'}"  # the dead server's own store
    assert cli_main(["replay", str(spill), "--tracking-uri", store]) == 0
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("gradmon-ray").experiment_id])
    assert run.info.status == "FINISHED"
    for key in result_to_metrics(grid[0].metrics):
        steps = [p.step for p in client.get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == sorted(set(steps)), key  # never twice
    assert sorted(p.step for p in client.get_metric_history(run.info.run_id, mn.LEARNERS_UPDATED)) == [1, 2, 3, 4, 5, 6]
    for key, value in result_to_metrics(grid[0].metrics).items():
        points = {p.step: p.value for p in client.get_metric_history(run.info.run_id, key)}
        assert _same(points[6], mlflow_value(value)), key


def test_a_trial_that_never_updated_still_ends_its_run(ray_session, tmp_path, monkeypatch):
    """An EnvRunner that returns no samples in time (what a loaded box did to the README's example):
    the trial reports an iteration without an update, and its MLflow run must end FINISHED with
    that iteration's values, never stay RUNNING."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    grid, stderr = _run_readme_example(tmp_path, iterations=1, env_runners=".env_runners(sample_timeout_s=1e-6)")
    result = grid[0].metrics
    assert result_to_metrics(result)[mn.LEARNERS_UPDATED] == 0  # the premise: no update happened
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gradmon-ray").experiment_id])
    assert run.info.status == "FINISHED" and run.info.end_time is not None, stderr[-3000:]
    assert run.data.tags[mn.TAG_STATUS] == "finished"
    for key, value in result_to_metrics(result).items():
        history = client.get_metric_history(run.info.run_id, key)
        assert [p.step for p in history] == [1] and _same(history[0].value, mlflow_value(value)), key
    assert not re.search(r"did not receive everything", stderr)
