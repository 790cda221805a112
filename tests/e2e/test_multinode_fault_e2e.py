"""Node faults on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``: several raylets here).

One sweep trial with two learners on two different nodes and its EnvRunner on a third; the head
node runs only the trial's own process and the gradient probe (a node of its own cost a raylet
and its workers, and no fault here is the probe's).  Nodes are told
apart by custom resources (``resources.custom_resources_per_learner`` and ``_per_env_runner``,
``probe.custom_resources``), and where each actor really runs is asked of GCS's actor table.
Mid-run the test first removes the EnvRunner's node (a spot node preempted) and adds a replacement
with the EnvRunner's and a learner's custom resource, as an autoscaler would; then, once that cost
only a restarted EnvRunner, it removes one learner's node.  The learner fault fails the trial and
Tune restarts it from its last checkpoint, in the same MLflow run, its new learners on the
surviving learner node and the replacement.

This is the one run for both faults: an EnvRunner lost (RLlib restarts it, the iterations without
it train nothing and log no telemetry, no health rule judges them, the restart is counted) and a
learner lost (Tune resumes the trial byte-equal from its checkpoint, VGS and probe state included,
each iteration logged once).  The fault driver: ``node_faults.py``.
"""

from __future__ import annotations

import itertools
import json
import math
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.sweep.config import SweepConfig
from gradmon_ray.app.sweep.run import run_sweep
from gradmon_ray.app.sweep.trials import TRIAL_STATE_FILE
from tests.e2e.node_faults import (
    CHECKPOINT_EVERY,
    LEARNER,
    LEARNER_CLASS,
    PHASE_TIMEOUT_S,
    PROBE,
    PROBE_CLASS,
    RUNNER,
    RUNNER_CLASS,
    TRIAL_CLASS,
    FaultDriver,
    asked_for,
)

pytestmark = pytest.mark.e2e

ITERATIONS = 20
"""~0.7 s each trained, ~2 s each idle. Alone on the 2-core box both faults were done by iteration 9
(the EnvRunner's node removed after iteration 2 or 3, a learner's after 9; 2026-11-26, three runs);
under a load of 15 the EnvRunner's restart cost 6 idle iterations and the learner's node went after
11 (2026-11-29); the rest is room for the learner's node to go after an odd iteration
(``CHECKPOINT_EVERY``) and for the resumed attempt to be seen running."""
BATCH = 256


@pytest.fixture(scope="module")
def cluster(without_shared_ray):
    """A head node (a CPU for the trial's own process, one for the probe) and one node per learner
    and for the EnvRunner, each its own raylet; no dashboard (the driver reads GCS itself)."""
    import ray
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 2, "resources": {PROBE: 1}, "include_dashboard": False}  # None would start it
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        nodes = {
            "learner_a": cluster.add_node(num_cpus=1, resources={LEARNER: 1}),
            "learner_b": cluster.add_node(num_cpus=1, resources={LEARNER: 1}),
            "runner": cluster.add_node(num_cpus=1, resources={RUNNER: 1}),
        }
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def faulted_sweep(cluster, tmp_path_factory):
    """The sweep runs in a thread; this (main) thread drives the faults (Ray starts nodes only from it)."""
    cluster_obj, nodes = cluster
    tmp = tmp_path_factory.mktemp("multinode")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    base = {
        "iterations": ITERATIONS,
        "seed": 0,
        "resources": {
            "num_learners": 2,
            "num_env_runners": 1,
            "env_runner_restart_delay_s": 0.0,
            "custom_resources_per_learner": {LEARNER: 1},
            "custom_resources_per_env_runner": {RUNNER: 1},
        },
        "ppo": {"train_batch_size": BATCH, "minibatch_size": 128, "num_epochs": 1},
        "model": {"trunk_hiddens": [32]},
        "vgs": {"enabled": True, "warmup_steps": 1},  # its step count is checkpointed state too
        "health_stop": {"dead_iterations": 1},  # an idle iteration judged 'dead' would stop the trial
        "probe": {"gradient_analysis_every": 2, "num_buckets": 2, "custom_resources": {PROBE: 1}},
        "mlflow": {"tracking_uri": uri, "experiment": "multinode", "plots_every": 0},
    }
    config = SweepConfig(
        name="multinode",
        search_space={"ppo.lr": 3e-4},
        checkpoint_every=CHECKPOINT_EVERY,
        keep_checkpoints=ITERATIONS,  # the one the trial resumed from is read back below
        max_failures=2,
        storage_path=str(tmp / "tune"),
    )
    driver = FaultDriver(cluster_obj, nodes, uri, "multinode")
    outcome: dict[str, Any] = {}
    lines: list[str] = []  # the sweep's progress lines (appended from Tune's callback thread)

    def sweep() -> None:
        try:
            outcome["sweep"] = run_sweep(config, base, progress=lines.append)
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            driver.done.set()

    started = time.monotonic()
    thread = threading.Thread(target=sweep, daemon=True)
    thread.start()
    driver.run()
    thread.join(timeout=PHASE_TIMEOUT_S)
    driver.note(f"sweep done after {time.monotonic() - started:.1f} s")
    print("\n".join(driver.log))
    assert not thread.is_alive(), "the sweep did not end"
    if "error" in outcome:
        raise outcome["error"]
    return base, outcome["sweep"], driver, tmp / "tune", lines


def _history(client: MlflowClient, run_id: str, name: str) -> dict[int, float]:
    """A metric's history, each step at most once."""
    points = client.get_metric_history(run_id, name)
    steps = [p.step for p in points]
    assert len(steps) == len(set(steps)), f"{name}: duplicated steps {sorted(steps)}"
    return {p.step: p.value for p in points}


def test_learners_probe_and_env_runner_sat_on_the_nodes_they_asked_for(faulted_sweep):
    _, _, driver, _, _ = faulted_sweep
    assert driver.error is None, "\n".join(driver.log)
    ids = driver.seen["node_ids"]
    before = driver.seen["before"]
    assert sorted(a.node_id for a in before[LEARNER_CLASS]) == sorted([ids["learner_a"], ids["learner_b"]])
    assert [a.node_id for a in before[PROBE_CLASS]] == [ids["head"]]  # the probe where PROBE is
    # The head has the probe's resource and free CPU for the probe alike: what it asked Ray for says more.
    assert asked_for(before[PROBE_CLASS][0]) == {"CPU": 1.0, PROBE: 1.0}  # probe.num_cpus, .custom_resources
    assert [a.node_id for a in before[RUNNER_CLASS]] == [ids["runner"]]
    assert [a.node_id for a in before[TRIAL_CLASS]] == [ids["head"]]  # so a lost node is never the trial's own


def test_losing_the_env_runners_node_costs_only_a_restarted_env_runner(faulted_sweep):
    base, outcome, driver, _, lines = faulted_sweep
    assert driver.error is None, "\n".join(driver.log)
    ids, before, after = driver.seen["node_ids"], driver.seen["before"], driver.seen["after_runner_fault"]
    # The same EnvRunner actor, restarted once by Ray on the replacement node ...
    ((runner_before,), (runner_after,)) = before[RUNNER_CLASS], after[RUNNER_CLASS]
    assert runner_before.num_restarts == 0
    assert (runner_after.actor_id, runner_after.node_id, runner_after.num_restarts) == (
        runner_before.actor_id,
        ids["runner_2"],
        1,
    )
    # ... while the trial, its learners and the probe went on untouched: same actors, no restart.
    for cls in (LEARNER_CLASS, PROBE_CLASS, TRIAL_CLASS):
        assert sorted((a.actor_id, a.num_restarts) for a in after[cls]) == sorted(
            (a.actor_id, a.num_restarts) for a in before[cls]
        ), cls
    assert mn.TAG_RESUMED_FROM not in driver.seen["tags_after_runner_fault"]  # no checkpoint restore
    # RLlib counted the restart (one, 0 before it), and training went on after it.
    restarts, trained = driver.seen["restarts_after_runner_fault"], driver.seen["trained_after_runner_fault"]
    removed_after = driver.seen["runner_removed_after"]
    assert all(value == 0.0 for step, value in restarts.items() if step <= removed_after)
    assert max(restarts.values()) == 1.0
    first = min(step for step, value in restarts.items() if value == 1.0)
    assert sorted(trained) == list(range(1, max(trained) + 1))
    assert sum(value for step, value in trained.items() if step > first) >= 2
    # Until it was back the learners had nothing to train on: those iterations say so (update/trained 0,
    # no healthy EnvRunner, the progress line), and only those.
    idle = sorted(step for step, value in trained.items() if value == 0.0)
    assert idle and removed_after < idle[0] and idle[-1] <= first, (trained, restarts)
    (trial,) = outcome.trials
    client = MlflowClient(base["mlflow"]["tracking_uri"])
    healthy = _history(client, trial.run_id, mn.ENV_RUNNERS_HEALTHY)
    assert healthy[idle[0]] == 0.0 and healthy[ITERATIONS] == 1.0
    assert all(healthy[step] == 1.0 for step in range(1, removed_after + 1))
    said_idle = {
        int(line.split(" | ")[1].split()[1].split("/")[0]) for line in lines if "no update: nothing to train on" in line
    }
    assert said_idle == set(idle), lines
    # No health rule judged them (dead_iterations 1 would have stopped the trial at the first).
    run = client.get_run(trial.run_id)
    assert run.data.tags[mn.TAG_STATUS] == "finished" and mn.HEALTH_STOP_REASON not in run.data.metrics


def _checkpoint_state(storage: Path, iterations_done: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trial's own record of a checkpoint, and the learner state on disk, read here independently."""
    checkpoints = {}
    for meta in storage.glob(f"**/checkpoint_*/{TRIAL_STATE_FILE}"):
        checkpoints[json.loads(meta.read_text())["iterations_done"]] = meta.parent
    saved = json.loads((checkpoints[iterations_done] / TRIAL_STATE_FILE).read_text())
    state_file = checkpoints[iterations_done] / "algo" / "learner_group" / "learner" / "state.pkl"
    with state_file.open("rb") as f:  # our own test checkpoint: unpickling it is safe here
        return saved, pickle.load(f)


def test_losing_a_learners_node_resumes_the_trial_byte_equal_from_its_checkpoint(faulted_sweep):
    from gradmon_ray.rllib.learner import GRADMON_STATE_KEYS
    from gradmon_ray.telemetry.state_digest import state_digest

    base, outcome, driver, storage, _ = faulted_sweep
    assert driver.error is None, "\n".join(driver.log)
    ids = driver.seen["node_ids"]
    (trial,) = outcome.trials
    assert trial.status == "finished" and trial.iterations == ITERATIONS  # Tune restarted it, it finished

    # After the restart: two new learners, on the surviving learner node and the replacement.
    removed = ids[driver.seen["learner_node_removed"]]
    survivor = ({ids["learner_a"], ids["learner_b"]} - {removed}).pop()
    after = driver.seen["after_learner_fault"]
    assert sorted(a.node_id for a in after[LEARNER_CLASS]) == sorted([survivor, ids["runner_2"]])
    assert [a.node_id for a in after[PROBE_CLASS]] == [ids["head"]]
    assert [a.node_id for a in after[RUNNER_CLASS]] == [ids["runner_2"]]
    assert [a.node_id for a in after[TRIAL_CLASS]] == [ids["head"]]
    # Exactly one trial restart: two learner actors per attempt, two attempts.
    assert len(driver.seen["all_actors"][LEARNER_CLASS]) == 4

    client = MlflowClient(base["mlflow"]["tracking_uri"])
    run = client.get_run(trial.run_id)
    assert run.info.status == "FINISHED"
    resumed_from = int(run.data.tags[mn.TAG_RESUMED_FROM])
    removed_after = driver.seen["learner_removed_after"]
    # From the newest checkpoint: the one before the node went, or one written while it went.
    assert removed_after - 1 <= resumed_from < ITERATIONS and resumed_from % CHECKPOINT_EVERY == 0
    first_restart = min(s for s, v in driver.seen["restarts_after_runner_fault"].items() if v == 1.0)
    assert first_restart <= resumed_from  # written after the EnvRunner fault had been absorbed

    # The restored gradmon state is byte-equal to the checkpoint's: the digest the trial wrote with
    # it, and the learner state on disk hashed here; VGS and probe state are in it.
    saved, on_disk = _checkpoint_state(storage, resumed_from)
    gradmon_state = {k: v for k, v in on_disk.items() if k in GRADMON_STATE_KEYS}
    assert {"gradmon_telemetry", "gradmon_vgs", "gradmon_probe"} <= set(gradmon_state)
    assert run.data.tags[mn.TAG_RESUMED_STATE_DIGEST] == saved["state_digest"] == state_digest(gradmon_state)
    if resumed_from < removed_after:  # the usual case: the lost attempt had logged past the checkpoint
        first, last = (int(x) for x in run.data.tags[mn.TAG_RECOMPUTED_ITERATIONS].split("-"))
        assert first == resumed_from + 1 and last >= removed_after


def test_across_both_faults_mlflow_has_each_iteration_once_and_telemetry_only_where_trained(faulted_sweep):
    from gradmon_ray.rllib.learner import GRADMON_STATE_KEYS

    base, outcome, _, storage, _ = faulted_sweep
    (trial,) = outcome.trials
    client = MlflowClient(base["mlflow"]["tracking_uri"])
    run = client.get_run(trial.run_id)
    resumed_from = int(run.data.tags[mn.TAG_RESUMED_FROM])
    trained = _history(client, trial.run_id, mn.LEARNERS_UPDATED)
    assert sorted(trained) == list(range(1, ITERATIONS + 1))  # once each, none missing, both attempts
    busy = sorted(step for step, value in trained.items() if value == 1.0)
    done_by_resume = sum(1 for s in busy if s <= resumed_from)
    # Telemetry at every trained iteration, its own clock counting updates straight through the restart.
    assert _history(client, trial.run_id, mn.TELEMETRY_ITERATION) == {step: float(i) for i, step in enumerate(busy, 1)}
    for head in ("op", "slot", "value"):
        norms = _history(client, trial.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, head))
        assert sorted(norms) == busy and all(math.isfinite(v) and v > 0 for v in norms.values()), head
    # RLlib's own counter came back with the checkpoint: every trained batch sampled, counted once.
    env_steps = _history(client, trial.run_id, mn.ENV_STEPS_SAMPLED_LIFETIME)
    assert env_steps == {s: float(BATCH * sum(1 for b in busy if b <= s)) for s in env_steps}
    assert set(busy) <= set(env_steps)

    # The state the resumed attempt started from: each counter where MLflow had it at that iteration.
    _, on_disk = _checkpoint_state(storage, resumed_from)
    gradmon_state = {k: v for k, v in on_disk.items() if k in GRADMON_STATE_KEYS}
    telemetry = gradmon_state["gradmon_telemetry"]["default_policy"]  # keyed by module
    assert telemetry["iteration"] == done_by_resume
    op_norms = _history(client, trial.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, "op"))
    assert telemetry["prev_norms"]["op"] == pytest.approx(op_norms[max(s for s in busy if s <= resumed_from)])
    assert gradmon_state["gradmon_probe"]["iterations_done"] == done_by_resume
    vgs_steps = _history(client, trial.run_id, mn.VGS_STEP_COUNT)
    assert sorted(vgs_steps) == busy and all(vgs_steps[a] < vgs_steps[b] for a, b in itertools.pairwise(busy))
    last_busy = max(s for s in busy if s <= resumed_from)
    assert int(gradmon_state["gradmon_vgs"]["default_policy"]["step_count"]) == vgs_steps[last_busy]
