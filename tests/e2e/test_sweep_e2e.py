"""A real Ray Tune sweep: 2 trials, nested MLflow runs, and the health stopper ending a broken trial."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.sweep import PARENT_RUN_TAG, SweepConfig, run_sweep
from tests.fixtures.user_envs import CRASH_ONCE_COUNTDOWN

pytestmark = pytest.mark.e2e

ITERATIONS, N = 4, 2


@pytest.fixture(scope="module")
def sweep(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    base = {
        "iterations": ITERATIONS,
        "seed": 0,
        "ppo": {"train_batch_size": 256, "minibatch_size": 128, "num_epochs": 1},
        "model": {"trunk_hiddens": [32]},
        "health_stop": {"exploding_iterations": N},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "sweep"},
    }
    config = SweepConfig(
        name="heads",
        # op's logits x100 make its gradient explode (norm ~17 > 5) from the first iteration on
        search_space={"model.head_logit_scale": {"grid": [{}, {"op": 100.0}]}},
        storage_path=str(tmp / "tune"),
    )
    lines: list[str] = []
    outcome = run_sweep(config, base, progress=lines.append)
    return base, outcome, lines


def test_two_trials_two_nested_mlflow_runs_with_telemetry(sweep):
    base, outcome, _ = sweep
    client = MlflowClient(base["mlflow"]["tracking_uri"])
    parent = client.get_run(outcome.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags[mn.TAG_SWEEP] == "heads"
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`{PARENT_RUN_TAG}` = '{outcome.parent_run_id}'"
    )
    assert len(children) == 2 == len(outcome.trials)
    assert {c.info.run_id for c in children} == {t.run_id for t in outcome.trials}
    for child in children:
        assert child.info.status == "FINISHED"
        assert "trial.model.head_logit_scale" in child.data.params and child.data.params["ppo.num_epochs"] == "1"
        for head in ("op", "slot", "value"):
            history = client.get_metric_history(child.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, head))
            assert len(history) >= 1 and all(m.value > 0 for m in history)


def test_health_stopper_ends_the_exploding_trial_and_spares_the_healthy_one(sweep):
    base, outcome, lines = sweep
    client = MlflowClient(base["mlflow"]["tracking_uri"])
    by_scale = {str(t.config["model.head_logit_scale"]): t for t in outcome.trials}
    healthy, broken = by_scale["{}"], by_scale["{'op': 100.0}"]
    assert healthy.status == "finished" and healthy.iterations == ITERATIONS and healthy.stop_reason is None
    assert broken.status == "stopped" and broken.iterations <= N + 1
    assert "head 'op' exploding" in broken.stop_reason
    run = client.get_run(broken.run_id)
    assert run.data.tags[mn.TAG_STATUS] == "stopped"
    assert "head 'op' exploding for 2 consecutive iterations" in run.data.tags[mn.TAG_STOP_REASON]
    assert run.data.metrics[mn.HEALTH_STOP_REASON] == 2.0  # exploding
    assert mn.HEALTH_STOP_REASON not in client.get_run(healthy.run_id).data.metrics
    assert outcome.best is healthy  # a stopped trial is never the best
    assert any("stopped: iteration" in line for line in lines)


@pytest.fixture(scope="module")
def crashed_sweep(ray_session, tmp_path_factory):
    """One trial whose loss raises once in iteration 2 or 3 (a fault-injecting regularizer)."""
    tmp = tmp_path_factory.mktemp("crash")
    base = {
        "iterations": ITERATIONS,
        "seed": 0,
        "ppo": {"train_batch_size": 256, "minibatch_size": 128, "num_epochs": 1},
        "model": {"trunk_hiddens": [32]},
        "vgs": {"enabled": True, "warmup_steps": 1},
        "regularizers": [{"name": "crash", "fn": "tests.fixtures.user_envs:crash_once", "weight": 1.0}],
        "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "crash"},
    }
    # Two or three minibatches per iteration: call 5 falls in iteration 2 or 3, after a checkpoint.
    CRASH_ONCE_COUNTDOWN.write_text("4")
    try:
        config = SweepConfig(name="crash", search_space={"ppo.lr": 3e-4}, storage_path=str(tmp / "tune"))
        outcome = run_sweep(config, base, progress=None)
        crashed = not CRASH_ONCE_COUNTDOWN.exists()
    finally:
        CRASH_ONCE_COUNTDOWN.unlink(missing_ok=True)
    return base, outcome, crashed


def test_a_failed_trial_resumes_from_its_checkpoint_in_the_same_mlflow_run(crashed_sweep):
    base, outcome, crashed = crashed_sweep
    assert crashed  # the fault fired
    (trial,) = outcome.trials
    assert trial.status == "finished" and trial.iterations == ITERATIONS  # FailureConfig restarted it
    client = MlflowClient(base["mlflow"]["tracking_uri"])
    run = client.get_run(trial.run_id)
    assert run.info.status == "FINISHED"
    resumed_from = int(run.data.tags[mn.TAG_RESUMED_FROM])
    assert 1 <= resumed_from < ITERATIONS

    def history(name: str) -> dict[int, float]:
        points = client.get_metric_history(trial.run_id, name)
        steps = [p.step for p in points]
        assert steps == sorted(set(steps)), f"{name}: duplicated steps {steps}"  # nothing logged twice
        return {p.step: p.value for p in points}

    norms = history(mn.head_metric(mn.HEAD_GRAD_NORM, "op"))
    assert sorted(norms) == list(range(1, ITERATIONS + 1))  # no iteration missing either
    # Telemetry state came back with the checkpoint, not from scratch:
    assert history(mn.TELEMETRY_ITERATION) == {i: float(i) for i in range(1, ITERATIONS + 1)}
    prev = history(mn.head_metric(mn.HEAD_GRAD_NORM_PREV, "op"))
    assert prev[resumed_from + 1] == pytest.approx(norms[resumed_from])  # previous value restored
    vgs_steps = history(mn.VGS_STEP_COUNT)
    assert all(vgs_steps[i + 1] > vgs_steps[i] for i in range(1, ITERATIONS))  # VGS statistics kept counting
    env_steps = history(mn.ENV_STEPS_SAMPLED_LIFETIME)
    assert all(env_steps[i + 1] > env_steps[i] for i in range(1, ITERATIONS))


KILL_ITERATIONS, KILL_EVERY = 8, 3


def _learner_pids() -> list[int]:
    """PIDs of RLlib learner actors (Ray titles their processes ``ray::_WrappedExecutable``)."""
    import psutil

    return [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline"])
        if (p.info["cmdline"] or [""])[0].startswith("ray::_WrappedExecutable")
    ]


@pytest.fixture(scope="module")
def killed_learner_sweep(ray_session, tmp_path_factory):
    """One trial with a remote learner actor that this test SIGKILLs once iteration 4 is in MLflow.

    Checkpoints every 3 iterations, so the kill lands after checkpoint 3 with iteration 4 (at
    least) already logged: the resumed attempt recomputes it and must not log it again.
    """
    import os
    import signal
    import threading
    import time

    tmp = tmp_path_factory.mktemp("kill")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    base = {
        "iterations": KILL_ITERATIONS,
        "seed": 0,
        "resources": {"num_learners": 1},
        "ppo": {"train_batch_size": 512, "minibatch_size": 128, "num_epochs": 2},
        "model": {"trunk_hiddens": [64, 64]},
        "vgs": {"enabled": True, "warmup_steps": 1},
        "mlflow": {"tracking_uri": uri, "experiment": "kill"},
    }
    killed: dict[str, object] = {}
    done = threading.Event()

    def killer() -> None:
        client = MlflowClient(uri)
        while not done.is_set():
            time.sleep(0.05)
            try:
                experiment = client.get_experiment_by_name("kill")
                runs = client.search_runs([experiment.experiment_id]) if experiment else []
                child = [r for r in runs if PARENT_RUN_TAG in r.data.tags]
                steps = (
                    [p.step for p in client.get_metric_history(child[0].info.run_id, mn.LEARNERS_UPDATED)]
                    if child
                    else []
                )
            except Exception:  # sqlite busy while the trial writes: look again
                continue
            if max(steps, default=0) >= 4:
                pids = _learner_pids()
                if len(pids) == 1:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.update(pid=pids[0], seen_step=max(steps))
                    return

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        config = SweepConfig(
            name="kill",
            search_space={"ppo.lr": 3e-4},
            checkpoint_every=KILL_EVERY,
            keep_checkpoints=10,
            storage_path=str(tmp / "tune"),
        )
        outcome = run_sweep(config, base, progress=None)
    finally:
        done.set()
        thread.join(timeout=5)
    return base, outcome, killed, tmp / "tune"


def test_a_killed_learner_actor_resumes_byte_equal_and_mlflow_has_each_iteration_once(killed_learner_sweep):
    import json
    import pickle

    from gradmon_ray.app.sweep import TRIAL_STATE_FILE
    from gradmon_ray.rllib.learner import GRADMON_STATE_KEYS
    from gradmon_ray.telemetry.state_digest import state_digest

    base, outcome, killed, storage = killed_learner_sweep
    assert killed, "the learner actor was never killed"
    (trial,) = outcome.trials
    assert trial.status == "finished" and trial.iterations == KILL_ITERATIONS  # Tune restarted it
    client = MlflowClient(base["mlflow"]["tracking_uri"])
    run = client.get_run(trial.run_id)
    assert run.info.status == "FINISHED"
    resumed_from = int(run.data.tags[mn.TAG_RESUMED_FROM])
    assert resumed_from in (3, 6) and resumed_from < KILL_ITERATIONS

    # The restored state is byte-equal to the checkpoint on disk (read here, independently).
    checkpoints = {}
    for meta in storage.glob(f"**/checkpoint_*/{TRIAL_STATE_FILE}"):
        checkpoints[json.loads(meta.read_text())["iterations_done"]] = meta.parent
    state_file = checkpoints[resumed_from] / "algo" / "learner_group" / "learner" / "state.pkl"
    with state_file.open("rb") as f:  # our own test checkpoint: unpickling it is safe here
        on_disk = pickle.load(f)
    gradmon_state = {k: v for k, v in on_disk.items() if k in GRADMON_STATE_KEYS}
    assert {"gradmon_telemetry", "gradmon_vgs", "gradmon_probe"} <= set(gradmon_state)
    assert run.data.tags[mn.TAG_RESUMED_STATE_DIGEST] == state_digest(gradmon_state)
    telemetry = gradmon_state["gradmon_telemetry"]["default_policy"]  # keyed by module
    assert gradmon_state["gradmon_probe"]["iterations_done"] == resumed_from

    def history(name: str) -> dict[int, float]:
        points = client.get_metric_history(trial.run_id, name)
        steps = [p.step for p in points]
        assert len(steps) == len(set(steps)), f"{name}: duplicated steps {sorted(steps)}"
        return {p.step: p.value for p in points}

    for name in (
        mn.LEARNERS_UPDATED,
        mn.head_metric(mn.HEAD_GRAD_NORM, "op"),
        mn.VGS_STEP_COUNT,
        mn.TELEMETRY_ITERATION,
    ):
        assert sorted(history(name)) == list(range(1, KILL_ITERATIONS + 1)), name  # each once, none missing
    assert history(mn.TELEMETRY_ITERATION) == {i: float(i) for i in range(1, KILL_ITERATIONS + 1)}
    # The checkpointed VGS step count is where the resumed attempt continued from.
    vgs_steps = history(mn.VGS_STEP_COUNT)
    assert all(vgs_steps[i + 1] > vgs_steps[i] for i in range(1, KILL_ITERATIONS))
    assert int(gradmon_state["gradmon_vgs"]["default_policy"]["step_count"]) == vgs_steps[resumed_from]
    assert telemetry["iteration"] == resumed_from
    if resumed_from == 3:  # the usual case: iteration 4 (at least) was logged by the killed attempt
        recomputed = run.data.tags[mn.TAG_RECOMPUTED_ITERATIONS]
        first, last = (int(x) for x in recomputed.split("-"))
        assert first == 4 and last >= killed["seen_step"] >= 4
