"""``probe/actor.py`` and ``probe/client.py``: the GradientProbe as a real Ray actor, writing to a real
MLflow store; the learner's client.  ``probe/duration_s`` is bracketed by a regularizer's known
sleeps and the caller's wall clock; ``probe/skipped`` counts a batch with fewer groups than buckets.

Two actors for the module (an actor is a process importing torch and RLlib: seconds each): one
shared by every test that does not kill it, one killed and restarted by Ray for the restart test."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import time
import uuid

import numpy as np
import pytest
import ray
import tree
from mlflow.tracking import MlflowClient
from ray.rllib.core import ALL_MODULES, DEFAULT_MODULE_ID

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.probe import ProbeClient, ProbeRequest, start_probe_actor
from gradmon_ray.probe.analysis import LossSettings
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update
from tests.probe import designed_batch
from tests.probe.designed_batch import designed_module_and_batch, expected_buckets, module_probe, probe_request

LOSS = LossSettings(
    clip_param=0.2, vf_clip_param=10.0, vf_loss_coeff=0.5, entropy_coeff=0.01, kl_coeff=0.2, use_kl_loss=False
)
BUSY = [{"name": "busy", "fn": "tests.probe.slow_start:busy_logit_l2", "weight": 1.0, "enabled": True}]
SLOW_RESTART = [{"name": "l2", "fn": "tests.probe.slow_start:logit_l2", "weight": 1.0, "enabled": True}]
SHARED_BUCKETS = 5
"""The shared probe's buckets: the template's batch has groups enough for them, the designed one (4
groups, counted in ``expected_buckets``) too few, so one actor serves both kinds of test."""
LOGGED_AFTER = 7
"""The shared probe's ``skip_through``: the template's iteration (7) and the learner's (1) are probed
but not logged, so its run holds the logging test's iteration alone, whatever the test order."""


@pytest.fixture(scope="module")
def local_learner():
    """(cfg, a learner probing every iteration, its first train batch): the hand-off test's learner
    and batch, and the template's batch (one learner build and one sampling for both)."""
    cfg = config_from_dict(
        {
            "seed": 4,
            "ppo": {"train_batch_size": 256, "minibatch_size": 128, "num_epochs": 1},
            "model": {"trunk_hiddens": [16]},
            "probe": {"gradient_analysis_every": 1, "num_buckets": 2},
        }
    )
    learner = build_local_learner(cfg)
    return cfg, learner, train_batch(learner, sample_episodes(cfg, learner, 256))


@pytest.fixture(scope="module")
def request_template(local_learner) -> ProbeRequest:
    """A real postprocessed batch of the built-in env (enough groups for 5 buckets), iteration 7."""
    _, learner, batch = local_learner
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    columns = batch.policy_batches[DEFAULT_MODULE_ID]
    # Copies: the hand-off test updates on the same batch.
    host = {k: tree.map_structure(lambda t: t.numpy().copy(), v) for k, v in columns.items() if k != "weights_seq_no"}
    return ProbeRequest(iteration=7, modules=[module_probe(module, host, loss=LOSS)])


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('probe-actor') / 'mlflow.db'}"


def _new_run(uri: str) -> str:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("probe") or client.get_experiment(client.create_experiment("probe"))
    return client.create_run(experiment.experiment_id).info.run_id


@pytest.fixture(scope="module")
def shared_probe(ray_session, tracking_uri):
    """(name, handle, run id): one probe actor with the busy regularizer, writing into a run of its own."""
    name, run_id = _name(), _new_run(tracking_uri)
    probe = start_probe_actor(
        name,
        tracking_uri=tracking_uri,
        run_id=run_id,
        num_buckets=SHARED_BUCKETS,
        regularizers=BUSY,
        track_grad_norms=True,
        num_cpus=1,
        skip_through=LOGGED_AFTER,
    )
    yield name, probe, run_id
    ray.kill(probe)


@pytest.fixture
def idle_probe(shared_probe) -> str:
    """The shared probe's name, once the actor is idle: its calls run one at a time, so this call
    returns after any probe a previous test left running."""
    name, probe, _ = shared_probe
    ray.get(probe.instance.remote(), timeout=60)
    return name


def _name() -> str:
    return f"gradmon-probe-test-{uuid.uuid4().hex[:8]}"


def _wait_until(predicate, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.e2e  # a probe actor on a local Ray
def test_actor_logs_bucket_metrics_into_the_run_at_the_training_iteration(
    idle_probe, shared_probe, request_template, tracking_uri
):
    _, probe, run_id = shared_probe
    request = dataclasses.replace(request_template, iteration=LOGGED_AFTER + 1)
    outcome = ray.get(probe.analyse.remote(request))
    assert outcome.status == "ok" and outcome.iteration == LOGGED_AFTER + 1 and outcome.num_metrics > 50, outcome
    assert ray.get(probe.flush.remote(30.0))
    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"  # the probe writes into someone else's run and leaves it alone
    for bucket in ("bucket_1", "bucket_2"):
        for component in ("task", "entropy", "value"):
            history = client.get_metric_history(
                run_id, mn.probe_metric(mn.PROBE_COMPONENT_NORM, bucket, component=component)
            )
            assert [(m.step, m.value > 0) for m in history] == [(LOGGED_AFTER + 1, True)], (bucket, component)
    # Buckets ascend by reward std on a real batch, read back from MLflow (worked answers: test_analysis.py).
    stds = [run.data.metrics[mn.probe_metric(mn.PROBE_REWARD_STD_MEAN, f"bucket_{k}")] for k in range(1, 6)]
    assert stds == sorted(stds) and stds[0] < stds[-1], stds
    assert run.data.metrics[mn.PROBE_DURATION_S] > 0


@pytest.mark.e2e  # a probe actor on a local Ray
def test_client_drops_a_request_while_the_probe_is_busy_and_never_queues(idle_probe, request_template):
    client = ProbeClient(idle_probe, every=1)
    assert client.reserve()
    t0 = time.perf_counter()
    client.submit(request_template)
    assert time.perf_counter() - t0 < 0.5  # fire and forget: the busy probe is not waited for
    assert not client.reserve() and not client.reserve()
    assert client.counters[mn.PROBE_REQUESTS_DROPPED] == 2
    assert _wait_until(lambda: not client.busy)
    assert client.reserve()
    assert client.counters == {
        mn.PROBE_REQUESTS_SENT: 1,
        mn.PROBE_REQUESTS_DROPPED: 2,
        mn.PROBE_COMPLETED: 1,
        mn.PROBE_SKIPPED: 0,
        mn.PROBE_FAILURES: 0,
    }
    assert client.last_outcome.status == "ok"


@pytest.mark.e2e  # a probe actor on a local Ray
def test_a_killed_actor_counts_one_failure_and_a_request_its_restart_refused_is_sent_again(
    ray_session, request_template, tracking_uri, caplog
):
    """A probe killed with the actor is a failure, warned about once, and not re-run. The cause of the
    post-restart probes missing in CI: a request that reaches the actor while Ray restarts it fails
    with ActorUnavailableError (it never ran); the client keeps it and sends it again once the actor
    is back, and it is delivered (and logged) once. An actor gone for good: counted, no exception."""
    run_id = _new_run(tracking_uri)
    name = _name()
    probe = start_probe_actor(
        name,
        tracking_uri=tracking_uri,
        run_id=run_id,
        num_buckets=2,
        regularizers=SLOW_RESTART,  # the first incarnation's probe sleeps; a restart takes >= 2 s
        track_grad_norms=True,
        num_cpus=1,
        max_restarts=1,
    )
    client = ProbeClient(name, every=1)
    try:
        old = ray.get(probe.instance.remote())
        with caplog.at_level(logging.WARNING, logger="gradmon_ray.probe.client"):
            client.submit(request_template)  # iteration 7
            time.sleep(0.3)  # the probe is inside its sleeping regularizer now
            ray.kill(probe, no_restart=False)  # dies with our request; Ray restarts it
            assert _wait_until(lambda: not client.busy)
            assert client.counters[mn.PROBE_FAILURES] == 1 and client.resends == 0
            # Seen dead, so Ray is restarting it (>= 2 s): this request is refused, kept and sent again.
            client.submit(dataclasses.replace(request_template, iteration=8))
            assert _wait_until(lambda: not client.busy, timeout_s=120)
        assert client.counters == {
            mn.PROBE_REQUESTS_SENT: 2,
            mn.PROBE_REQUESTS_DROPPED: 0,
            mn.PROBE_COMPLETED: 1,
            mn.PROBE_SKIPPED: 0,
            mn.PROBE_FAILURES: 1,  # the killed probe only: the refused request is not a failure
        }
        assert client.resends >= 1 and client.last_outcome.iteration == 8
        assert ray.get(probe.instance.remote()) != old  # the restarted actor ran it
        assert ray.get(probe.flush.remote(30.0))
        assert len([r for r in caplog.records if "probe request failed" in r.getMessage()]) == 1
    finally:
        ray.kill(probe, no_restart=True)
    assert _wait_until(lambda: not client.busy)  # gone for good: still no exception, just counted
    client.submit(request_template)
    assert _wait_until(lambda: not client.busy)
    assert client.counters[mn.PROBE_FAILURES] == 2
    history = MlflowClient(tracking_uri).get_metric_history(
        run_id, mn.probe_metric(mn.PROBE_COMPONENT_NORM, "bucket_1", component="task")
    )
    # Once: the killed probe (7) was not re-run behind the client's back, the refused one (8) not run twice.
    assert [m.step for m in history] == [8]


@pytest.mark.e2e  # a probe actor on a local Ray
def test_finish_waits_for_the_last_probe_and_counts_it(idle_probe, request_template):
    client = ProbeClient(idle_probe, every=1)
    client.submit(request_template)
    assert client.busy and client.counters[mn.PROBE_COMPLETED] == 0  # the busy probe is still running
    assert client.finish(60.0)
    assert not client.busy and client.counters[mn.PROBE_COMPLETED] == 1
    client.submit(request_template)
    assert client.finish(0.2) is False  # gave up: counted, and the client is free again
    assert client.counters[mn.PROBE_FAILURES] == 1 and not client.busy


@pytest.mark.e2e  # a probe actor on a local Ray
def test_end_of_run_flush_counts_the_probe_that_finishes_after_the_last_iteration(idle_probe, request_template):
    """`probe/completed` ended at 1 when 2 probes ran: the last probe finished after the last
    iteration's metrics were logged. The driver's final flush waits for it and returns the
    counters it logs at the last step."""
    from gradmon_ray.probe.lifecycle import flush_probe

    class Result:  # one entry of foreach_learner's RemoteCallResults
        ok = True

        def __init__(self, value):
            self.value = value

        def get(self):
            return self.value

    class Learners:  # what `flush_probe` uses of an Algorithm: its (local) learner group
        def __init__(self, learner):
            self.learner = learner

        def foreach_learner(self, func, **_):
            return [Result(func(self.learner))]

    learner = type("Learner", (), {})()
    learner.probe_client = ProbeClient(idle_probe, every=1)  # GradmonPPOTorchLearner's property
    algo = type("Algo", (), {"learner_group": Learners(learner)})()
    learner.probe_client.submit(request_template)  # the last iteration's probe: still running (>= 1 s)
    assert learner.probe_client.metrics()[mn.PROBE_COMPLETED] == 0.0
    counters = flush_probe(algo)
    assert counters == {
        mn.PROBE_REQUESTS_SENT: 1.0,
        mn.PROBE_REQUESTS_DROPPED: 0.0,
        mn.PROBE_COMPLETED: 1.0,
        mn.PROBE_SKIPPED: 0.0,
        mn.PROBE_FAILURES: 0.0,
    }
    assert flush_probe(type("Algo", (), {"learner_group": Learners(object())})()) == {}  # no probe client


def test_client_without_an_actor_counts_a_failure():
    client = ProbeClient("gradmon-probe-that-does-not-exist", every=3)
    assert [client.due(i) for i in range(1, 7)] == [False, False, True, False, False, True]
    ray_was_up = ray.is_initialized()
    if not ray_was_up:
        pytest.skip("needs Ray")
    client.submit(object())
    assert client.counters[mn.PROBE_FAILURES] == 1 and client.counters[mn.PROBE_REQUESTS_SENT] == 0
    with pytest.raises(ValueError, match="every must be >= 1"):
        ProbeClient("x", every=0)


def _fingerprint(learner) -> str:
    digest = hashlib.sha256()
    for p in learner.module[DEFAULT_MODULE_ID].unwrapped().parameters():
        digest.update(p.detach().numpy().tobytes())
        digest.update(b"none" if p.grad is None else p.grad.numpy().tobytes())
    for opt in learner._optimizer_parameters:
        for state in opt.state_dict()["state"].values():
            for value in state.values():
                digest.update(np.asarray(value).tobytes())
    return digest.hexdigest()


@pytest.mark.e2e  # a probe actor on a local Ray
def test_learner_hands_off_pre_update_weights_and_the_probe_leaves_the_learner_untouched(
    idle_probe, local_learner, request_template
):
    cfg, learner, batch = local_learner  # not updated before: the template (taken first) copied its batch
    learner._probe.actor_name = idle_probe  # the shared actor (looked up by name at the first submit)
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    before_update = {k: v.detach().clone() for k, v in module.state_dict().items()}
    sent = []
    real_submit = learner._probe.submit
    learner._probe.submit = lambda request: (sent.append(request), real_submit(request))[1]
    results = update(learner, batch, cfg)
    (request,) = sent
    assert request.iteration == 1 and not request.per_module_names
    (part,) = request.modules
    assert part.module_id == DEFAULT_MODULE_ID
    for key, value in before_update.items():  # the weights the update started from
        np.testing.assert_array_equal(part.weights[key], value.numpy())
    assert any(not np.array_equal(part.weights[k], v.detach().numpy()) for k, v in module.state_dict().items())
    assert {"gradmon_group_id", "gradmon_episode", "advantages", "loss_mask"} <= set(part.batch)
    assert results[ALL_MODULES][mn.PROBE_REQUESTS_SENT].peek() == 1.0
    fingerprint = _fingerprint(learner)
    outcome = ray.get(learner._probe._in_flight)
    assert outcome.status == "ok"
    assert _fingerprint(learner) == fingerprint  # parameters, grads, Adam moments: unchanged
    state = copy.deepcopy(learner.get_state()["gradmon_probe"])
    assert state["iterations_done"] == 1 and state["counters"][mn.PROBE_REQUESTS_SENT] == 1


# --- probe/duration_s and probe/skipped, on the designed batch ------------------------------------


@pytest.fixture(scope="module")
def designed():
    return designed_module_and_batch()


def test_duration_is_bracketed_by_the_known_sleep_and_the_callers_wall_clock(designed):
    """The sleeping regularizer's calls (at least one per bucket) x their sleep <= duration <= wall time."""
    from gradmon_ray.probe.actor import GradientProbe

    module, batch = designed
    regs = [{"name": "sleepy", "fn": "tests.probe.designed_batch:sleepy_l2", "weight": 1.0, "enabled": True}]
    probe = GradientProbe(num_buckets=2, regularizers=regs, track_grad_norms=True, device="cpu")
    request = probe_request(module, batch, iteration=3)
    designed_batch.SLEEPS.clear()
    start = time.perf_counter()
    outcome = probe.analyse(request)
    wall = time.perf_counter() - start
    assert outcome.status == "ok", outcome
    assert len(designed_batch.SLEEPS) >= 2  # once per bucket at least
    assert sum(designed_batch.SLEEPS) <= probe.last_metrics[mn.PROBE_DURATION_S] <= wall


@pytest.mark.e2e  # a real probe actor on a local Ray
def test_a_batch_with_fewer_groups_than_buckets_counts_one_skip(idle_probe, designed):
    """4 groups (counted in ``expected_buckets``) for the shared probe's 5 buckets: sent 1, skipped 1,
    nothing else."""
    module, batch = designed
    assert sum(b["groups"] for b in expected_buckets(batch).values()) == 4 < SHARED_BUCKETS
    client = ProbeClient(idle_probe, every=1)
    assert client.reserve()
    client.submit(probe_request(module, batch, iteration=1))
    deadline = time.monotonic() + 60
    while client.busy and time.monotonic() < deadline:
        client.poll()
        time.sleep(0.05)
    assert client.counters == {
        mn.PROBE_REQUESTS_SENT: 1,
        mn.PROBE_REQUESTS_DROPPED: 0,
        mn.PROBE_COMPLETED: 0,
        mn.PROBE_SKIPPED: 1,
        mn.PROBE_FAILURES: 0,
    }
