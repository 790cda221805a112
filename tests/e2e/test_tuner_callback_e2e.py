"""The README's Tuner example (a user's own ``Tuner`` with ``GradmonMLflowCallback``) where it used to
lose or strand runs: a tracking server killed mid-trial.

Tune asks a finished trial's actor to stop and kills it 10 s later; before, the callback's close
waited 30 s for MLflow, so the kill took every iteration with it (no spill file, no warning, exit
0) or left the run ``RUNNING``.  The oracle for the values is the trial's last result as Tune kept
it (``result_to_metrics``), compared with what MLflow holds after ``gradmon-ray replay``.

One Tune run covers what three did (each a trial process and Tune's work: about 8 CPU-seconds).
A server that was never there differs from the killed one only inside the sink, where the run is
never created (``tests/tracking/test_mlflow_sink.py``'s
``test_close_gives_a_server_that_never_took_the_run_a_short_last_chance``; in a real algorithm,
``tests/tracking/test_callback.py::test_dead_tracking_server_neither_slows_nor_breaks_training``);
its replay into a store that never held the run is the killed trial's spill replayed into a fresh
store here.  A trial that never updated is an RLlib result, not a Tune one:
``tests/tracking/test_callback.py::test_an_iteration_that_never_updated_still_ends_its_run``.
"""

from __future__ import annotations

import shutil
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
from tests.e2e.readme_tuner_script import ONE_ENV_RUNNER, RUN_CONFIG, USER_CONFIG, readme_tuner_example
from tests.tracking.test_callback import _same

pytestmark = pytest.mark.e2e


def _run_readme_example(tmp_path: Path, *, iterations: int) -> tuple[Any, str]:
    """The README block, CI-sized, run in ``tmp_path``; its result grid and the trial's stderr.

    Sampled in the trial's own process: an EnvRunner actor is one more process importing torch and
    RLlib, and this test is about the tracking server (the block as written runs in the doc-block
    runner, ``tests/e2e/test_doc_commands_e2e.py``)."""
    code = readme_tuner_example()
    assert code.count(USER_CONFIG) == 1 and code.count(RUN_CONFIG) == 1 and "\ntune.Tuner(" in code
    assert code.count(ONE_ENV_RUNNER) == 1
    code = code.replace(ONE_ENV_RUNNER, "num_env_runners=0")
    small = ".training(train_batch_size=256, minibatch_size=128, num_epochs=1)"
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


def _replayed_where_never_held(spill: Path, store: str, trial: Any, undelivered: list[int]) -> None:
    """``spill`` (a copy) replayed into ``store``, which never held its run, as after a server that was
    never there: one new run, named and tagged after the trial, holding exactly the spilled
    iterations, the last with Tune's values."""
    assert cli_main(["replay", str(spill), "--tracking-uri", store]) == 0
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("gradmon-ray").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags[TAG_TRIAL_DIR] == Path(trial.path).name
    assert run.info.run_name == Path(trial.path).name
    assert sorted(p.step for p in client.get_metric_history(run.info.run_id, mn.LEARNERS_UPDATED)) == undelivered
    for key, value in result_to_metrics(trial.metrics).items():
        points = {p.step: p.value for p in client.get_metric_history(run.info.run_id, key)}
        assert _same(points[undelivered[-1]], mlflow_value(value)), key


def test_a_server_killed_mid_trial_loses_nothing_and_replay_completes_the_run(ray_session, tmp_path, monkeypatch):
    """The server dies after the trial's iteration 2 reached it: what it had not taken is in the spill
    file, which the trial's output (Tune shows it on the driver) names; replaying that file into the
    server's own store leaves every iteration there exactly once, the last one with Tune's values,
    and the run FINISHED; replaying it into a store that never held the run creates the run."""
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
    never_held = shutil.copy(spill, tmp_path / "never-held.jsonl")  # the replay below renames its file

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
    _replayed_where_never_held(Path(never_held), f"sqlite:///{tmp_path / 'later.db'}", grid[0], undelivered)
