"""The gradient probe in a real training run: bucket metrics in MLflow, and a probe actor killed mid-run."""

from __future__ import annotations

import math
import time

import pytest
import ray
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.train.run import run_training
from gradmon_ray.config import config_from_dict
from gradmon_ray.probe.actor import PROBE_ACTOR_PREFIX

pytestmark = pytest.mark.e2e

COMPONENTS = ("task", "entropy", "value", "logit_l2")


@pytest.fixture(scope="module")
def probed_run(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    cfg = config_from_dict(
        {
            "iterations": 6,
            "seed": 5,
            "ppo": {"train_batch_size": 512, "minibatch_size": 128, "num_epochs": 2},
            "model": {"trunk_hiddens": [64]},
            "resources": {"num_env_runners": 0},  # sampled here: the probe actor is the subject
            "regularizers": [{"name": "logit_l2", "weight": 0.01}],
            "probe": {"gradient_analysis_every": 2, "track_grad_norms": True, "max_restarts": 2},
            "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "probe"},
        }
    )
    killed: list[str] = []
    resends: list[int] = []

    client = MlflowClient(cfg.mlflow.tracking_uri)
    probe_step2 = mn.probe_metric(mn.PROBE_COMPONENT_NORM, "bucket_1", component="task")

    def reporter(iteration, metrics, algo, monitor, stop_reason) -> None:
        if iteration == 3:
            # Once the probe of iteration 2 is in MLflow (so the kill cannot land mid-analysis
            # and make the outcome timing-dependent): kill the probe actor; Ray restarts it.
            run_id = client.search_runs([client.get_experiment_by_name("probe").experiment_id])[0].info.run_id
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not client.get_metric_history(run_id, probe_step2):
                time.sleep(0.25)
            names = [n for n in ray.util.list_named_actors() if n.startswith(PROBE_ACTOR_PREFIX)]
            handle = ray.get_actor(names[0])
            old = ray.get(handle.instance.remote())
            ray.kill(handle, no_restart=False)
            killed.append(names[0])
            # The kill is asynchronous: a call made right after it can still be answered by the
            # dying instance (that is how the old `ready()` wait let iteration 4 run into the
            # restart). Wait until the old instance is gone, not until the new one is up:
            # iteration 4's probe request may reach the restarting actor, and must still arrive.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if ray.get(handle.instance.remote(), timeout=30) != old:
                        break  # already restarted
                except Exception:  # ActorUnavailableError: restarting
                    break
                time.sleep(0.1)
        if iteration == 4:
            # Iteration 4's probe went to the restarting (or just restarted) actor. Let the
            # learner's client finish it (resending while the actor restarts) before iteration 6,
            # so that iteration 6 finds no probe in flight: every count below is deterministic.
            def finish(learner):
                assert learner._probe.finish(120.0)
                return learner._probe.resends

            resends.extend(r.get() for r in algo.learner_group.foreach_learner(finish))

    outcome = run_training(cfg, progress=None, reporter=reporter)
    return cfg, outcome, killed, resends


def test_training_survives_the_killed_probe_and_every_probe_is_counted(probed_run):
    cfg, outcome, killed, resends = probed_run
    assert killed == [outcome.probe_actor]
    assert outcome.iterations_done == 6 and outcome.mlflow_complete
    client = MlflowClient(cfg.mlflow.tracking_uri)
    run = client.get_run(outcome.run_id)
    assert run.info.status == "FINISHED"
    # Iteration 2 probed before the kill, 4 and 6 by the restarted actor: all three handed off
    # and completed (a request the restarting actor could not take is sent again, not failed).
    counters = {k: run.data.metrics[k] for k in mn.PROBE_COUNTERS}
    assert counters == {
        mn.PROBE_REQUESTS_SENT: 3.0,
        mn.PROBE_COMPLETED: 3.0,
        mn.PROBE_REQUESTS_DROPPED: 0.0,
        mn.PROBE_SKIPPED: 0.0,
        mn.PROBE_FAILURES: 0.0,
    }, (counters, resends)
    # The final counters are logged at the last step, after the last probe (iteration 6's,
    # which finishes after iteration 6's metrics were logged) was collected.
    completed = client.get_metric_history(outcome.run_id, mn.PROBE_COMPLETED)
    assert max((m.step, m.timestamp, m.value) for m in completed)[::2] == (6, 3.0)


def test_bucket_metrics_for_each_probed_iteration(probed_run):
    cfg, outcome, _, _ = probed_run
    client = MlflowClient(cfg.mlflow.tracking_uri)
    steps_by_name = {}
    for bucket in ("bucket_1", "bucket_2", "bucket_3", "bucket_4"):
        names = [mn.probe_metric(mn.PROBE_COMPONENT_NORM, bucket, component=c) for c in COMPONENTS]
        names += [mn.probe_metric(mn.PROBE_PER_TOKEN_NORM, bucket, component=c) for c in COMPONENTS]
        names += [mn.probe_metric(mn.PROBE_PER_SAMPLE_NORM, bucket, component="task")]
        names += [mn.probe_metric(mn.PROBE_LOSS, bucket, loss=k) for k in ("policy", "entropy", "value", "total")]
        names += [
            mn.probe_metric(mn.PROBE_REWARD_STD_MEAN, bucket),
            mn.probe_metric(mn.PROBE_REGULARIZER_TOTAL, bucket),
        ]
        names += [mn.probe_metric(mn.PROBE_SHARE, bucket, component="task")]
        names += [mn.probe_metric(mn.PROBE_HEAD_NORM, bucket, head="op", component="task")]
        for name in names:
            history = client.get_metric_history(outcome.run_id, name)
            steps_by_name[name] = sorted(m.step for m in history)
            assert all(math.isfinite(m.value) for m in history), name
    # Iteration 2 was probed before the kill, iterations 4 and 6 by the restarted actor.
    for name, steps in steps_by_name.items():
        assert steps == [2, 4, 6], (name, steps)
    # bucket reward std ascends from bucket_1 to bucket_4 at every probed step
    stds = [
        {
            m.step: m.value
            for m in client.get_metric_history(outcome.run_id, mn.probe_metric(mn.PROBE_REWARD_STD_MEAN, b))
        }
        for b in ("bucket_1", "bucket_2", "bucket_3", "bucket_4")
    ]
    for step in stds[0]:
        values = [s[step] for s in stds]
        assert values == sorted(values), (step, values)
