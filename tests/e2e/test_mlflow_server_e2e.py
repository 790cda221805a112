"""Training against a real `mlflow server` on 127.0.0.1 that is killed and restarted mid-run.

The server runs in its own process group and is torn down even when a test fails.  `gradmon-ray
train` into a real server that stays up, its run and the run line it prints:
``tests/e2e/test_no_secret_e2e.py::test_train_uses_the_password_and_leaves_it_nowhere`` (the same
CLI and server, with a login).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import main
from gradmon_ray.app.train.run import run_training
from gradmon_ray.config import config_from_dict
from gradmon_ray.tracking import MlflowSink
from gradmon_ray.tracking.spill import read_spill
from tests.e2e.processes import MlflowServer, free_port

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """The module's server (each start costs ~10 s of a loaded box); the outage test kills it and
    starts it again on the same port and store, and leaves it running."""
    server = MlflowServer(free_port(), tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    try:
        server.wait(90)
        yield server
    finally:
        server.kill()


def _warm_up(uri: str) -> None:
    """One real write, so that the server's lazy start-up work is not billed to the no-fault iterations."""
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("warm-up")  # the module's server: there from a rerun, maybe
    run_id = client.create_run(
        experiment.experiment_id if experiment else client.create_experiment("warm-up")
    ).info.run_id
    client.log_batch(run_id, metrics=[Metric(f"m/{i}", 1.0, 0, 1) for i in range(200)])
    client.set_terminated(run_id)


def test_tracking_server_killed_and_restarted_mid_run(mlflow_server, ray_session, tmp_path, monkeypatch):
    """Training never waits for MLflow; what the server missed is delivered later or spilled and replayed.

    Issue #8's bar: iteration time during the outage within 1.2x of the no-fault median, timed as
    the training thread's CPU time (``time.thread_time``): the suite's other xdist worker loads the
    same two cores unevenly, which stretches wall time by itself. Waiting, which costs no CPU, is
    the sink check below. Seven
    iterations on each side, timed without the test's own kill and restart (which run in the
    progress callback, on the training thread), keep the medians steady on a loaded 2-core box.
    The time the training thread spends inside the sink is measured too: that is the direct
    form of "never blocks", and it does not depend on how noisy the machine is.
    """
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # what `gradmon-ray train` sets
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    # Iteration 17 only waits for the restarted server: the timed windows end at iteration 15.
    iterations, kill_after, restart_after = 17, 8, 16
    uri = mlflow_server.uri
    _warm_up(uri)
    cfg = config_from_dict(
        {
            "iterations": iterations,
            "seed": 0,
            "checkpoint_dir": str(tmp_path / "ckpt"),  # checkpoints are on by default: not into the repository
            "ppo": {"train_batch_size": 256, "minibatch_size": 128, "num_epochs": 1},
            "model": {"trunk_hiddens": [32]},
            "resources": {"num_env_runners": 0},  # sampled in the training thread: both windows alike
            # a 2-iteration buffer overflows during a 7-iteration outage: those go to the spill file
            "mlflow": {"tracking_uri": uri, "experiment": "outage", "queue_size": 2, "plots_every": 0},
        }
    )
    cfg.mlflow.spill_dir = str(tmp_path / "spill")
    in_sink: list[float] = []  # seconds the training thread spent in each log_iteration call
    log_iteration = MlflowSink.log_iteration

    def timed_log_iteration(self: MlflowSink, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        log_iteration(self, *args, **kwargs)
        in_sink.append(time.perf_counter() - t0)

    monkeypatch.setattr(MlflowSink, "log_iteration", timed_log_iteration)
    ends: list[float] = []  # the training thread's CPU time when each iteration's progress line arrived
    resumes: list[float] = []  # ... and when the callback handed the thread back to training

    def progress(line: str) -> None:
        ends.append(time.thread_time())
        if line.startswith(f"iter {kill_after}/"):
            mlflow_server.kill(grace_s=0)
        elif line.startswith(f"iter {restart_after}/"):
            mlflow_server.start()  # not waited for: training goes on
        elif line.startswith(f"iter {iterations}/"):
            # After the timed iterations: let the server finish starting (slow on a loaded 2-core
            # box), so that what is still buffered is delivered by close() rather than spilled.
            mlflow_server.wait()
        resumes.append(time.thread_time())

    start = time.thread_time()
    try:
        outcome = run_training(cfg, progress=progress)  # must not raise
    finally:
        if not mlflow_server.processes:  # failed between the kill and the restart: the next test needs one
            mlflow_server.start()
    assert outcome.iterations_done == iterations
    times = [end - begin for begin, end in zip([start, *resumes[:-1]], ends, strict=True)]
    no_fault = times[1:kill_after]  # iteration 1 builds and warms up
    outage = times[kill_after : restart_after - 1]  # after the kill, before the restart
    assert len(no_fault) == len(outage) == 7
    assert statistics.median(outage) <= 1.2 * statistics.median(no_fault), (no_fault, outage)
    # Per iteration the sink costs the training thread a put (and, in the outage, a spill append).
    assert len(in_sink) >= iterations and max(in_sink) < 0.05, in_sink

    # Everything the server missed is either delivered after its return or in the spill file.
    mlflow_server.wait()
    client = MlflowClient(uri)
    name = mn.head_metric(mn.HEAD_GRAD_NORM, "op")
    delivered = {m.step for m in client.get_metric_history(outcome.run_id, name)}
    assert outcome.spill_path is not None, "an outage longer than the 2-iteration buffer must spill"
    _, spilled_lines, trailer = read_spill(outcome.spill_path)
    spilled = {r["step"] for r in spilled_lines if name in r["metrics"]}
    assert spilled and delivered | spilled == set(range(1, iterations + 1)), (delivered, spilled)
    # Before the outage, and after the server came back. (Iterations just before the kill
    # may still have been in flight then: those are spilled, not lost, which the union checks.)
    assert {1, iterations} <= delivered
    assert trailer is not None
    # ... and the replay completes the history: each iteration exactly once.
    assert main(["replay", outcome.spill_path]) == 0
    history = client.get_metric_history(outcome.run_id, name)
    assert sorted(m.step for m in history) == list(range(1, iterations + 1))
    assert client.get_run(outcome.run_id).info.status == "FINISHED"
