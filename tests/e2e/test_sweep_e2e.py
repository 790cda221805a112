"""A real Ray Tune sweep: 2 trials, nested MLflow runs, and the health stopper ending a broken trial."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.sweep import PARENT_RUN_TAG, SweepConfig, run_sweep
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
