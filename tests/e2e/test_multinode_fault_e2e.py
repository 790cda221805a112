"""Node faults on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``: several raylets here).

One sweep trial with two learners on two different nodes and its EnvRunner on a third; the head
node runs only the trial's own process and the gradient probe (a node of its own cost a raylet
and its workers, and no fault here is the probe's).  Nodes are told
apart by custom resources (``resources.custom_resources_per_learner`` and ``_per_env_runner``,
``probe.custom_resources``), and where each actor really runs is asked of Ray's state API.
Mid-run the test first removes the EnvRunner's node (a spot node preempted), then, once that
cost only a restarted EnvRunner, removes one learner's node; each time it adds a replacement
node with the same custom resource, as an autoscaler would.  The learner fault fails the trial
and Tune restarts it from its last checkpoint, in the same MLflow run.
"""

from __future__ import annotations

import json
import pickle
import threading
import time
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.sweep.config import SweepConfig
from gradmon_ray.app.sweep.run import run_sweep
from gradmon_ray.app.sweep.trials import PARENT_RUN_TAG, TRIAL_STATE_FILE
from tests.e2e.processes import free_port

pytestmark = pytest.mark.e2e

ITERATIONS = 20
"""~0.7 s each. Alone on the 2-core box both faults were done by iteration 9 (the EnvRunner's node
removed after iteration 2 or 3, a learner's after 9; 2026-11-26, three runs); the rest is room
for a loaded box, and the resumed attempt's run to the end (30 before: ~7 s more of the module)."""
LEARNER, RUNNER, PROBE = "gradmon_test_learner_node", "gradmon_test_runner_node", "gradmon_test_probe_node"
LEARNER_CLASS, RUNNER_CLASS, PROBE_CLASS, TRIAL_CLASS = (
    "_WrappedExecutable",  # RLlib's learner actors (Ray Train's worker wrapper)
    "SingleAgentEnvRunner",
    "GradientProbe",
    "ImplicitFunc",  # the Tune trial running run_training
)
PHASE_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def cluster(without_shared_ray):
    """A head node (a CPU for the trial's own process, one for the probe) and one node per learner
    and for the EnvRunner, each its own raylet."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {PROBE: 1},
            "include_dashboard": True,  # the state API
            "dashboard_port": free_port(),
        },
    )
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


def _actors() -> dict[str, list[Any]]:
    """Every actor in the cluster by class name, alive or dead, as Ray's state API sees it."""
    from ray.util.state import list_actors

    by_class: dict[str, list[Any]] = {}
    for actor in list_actors(detail=True, limit=10_000, raise_on_missing_output=False):
        # Ray names a class by its qualified name (``wrap_function.<locals>.ImplicitFunc``)
        by_class.setdefault(actor.class_name.rsplit(".", 1)[-1], []).append(actor)
    return by_class


def _alive(actors: dict[str, list[Any]], cls: str) -> list[Any]:
    return [a for a in actors.get(cls, []) if a.state == "ALIVE"]


class FaultDriver:
    """Watches the trial in MLflow and Ray, removes the nodes and records what it saw."""

    def __init__(self, cluster: Any, nodes: dict[str, Any], uri: str, experiment: str) -> None:
        self.cluster, self.nodes, self.uri, self.experiment = cluster, nodes, uri, experiment
        self.done = threading.Event()
        self.seen: dict[str, Any] = {}
        self.log: list[str] = []
        self.error: BaseException | None = None
        self._t0 = time.monotonic()

    def note(self, line: str) -> None:
        self.log.append(f"{time.monotonic() - self._t0:7.1f} s  {line}")

    def _run(self) -> dict[str, Any] | None:
        client = MlflowClient(self.uri)
        try:
            experiment = client.get_experiment_by_name(self.experiment)
            runs = client.search_runs([experiment.experiment_id]) if experiment else []
            child = [r for r in runs if PARENT_RUN_TAG in r.data.tags]
            if not child:
                return None
            run_id = child[0].info.run_id
            return {
                "run": client.get_run(run_id),
                "trained": {p.step: p.value for p in client.get_metric_history(run_id, mn.LEARNERS_UPDATED)},
                "restarts": {p.step: p.value for p in client.get_metric_history(run_id, mn.ENV_RUNNER_RESTARTS)},
            }
        except Exception:  # sqlite busy while the trial writes: look again
            return None

    def _wait(self, what: str, condition: Any) -> Any:
        """Poll ``condition`` until it returns something true (a state API call that fails is a "not yet")."""
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        last_error = None
        while not self.done.is_set():
            try:
                value = condition()
            except Exception as exc:  # the dashboard busy on a loaded box: ask again
                value, last_error = None, exc
            if value:
                self.note(f"seen: {what}")
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"not seen within {PHASE_TIMEOUT_S:g} s: {what} (last error: {last_error!r})")
            time.sleep(0.5)  # a look is MLflow queries or a state-API call: not free on a 2-core box
        raise RuntimeError(f"the sweep ended before: {what}")

    def _last_logged(self) -> int:
        return max(self._wait("the run's history", self._run)["trained"])

    def _placement(self) -> dict[str, Any] | None:
        actors = _actors()
        alive = {cls: _alive(actors, cls) for cls in (LEARNER_CLASS, RUNNER_CLASS, PROBE_CLASS, TRIAL_CLASS)}
        if [len(alive[c]) for c in (LEARNER_CLASS, RUNNER_CLASS, PROBE_CLASS, TRIAL_CLASS)] != [2, 1, 1, 1]:
            return None
        return {cls: [(a.actor_id, a.node_id, a.num_restarts) for a in found] for cls, found in alive.items()}

    def run(self) -> None:
        try:
            self._drive()
        except Exception as exc:  # reported by the tests
            self.error = exc
            self.note(f"error: {type(exc).__name__}: {exc}")

    def _drive(self) -> None:
        node_ids = {role: node.node_id for role, node in self.nodes.items()}
        node_ids["head"] = self.cluster.head_node.node_id
        self.seen["node_ids"] = dict(node_ids)

        # Phase 0: two trained iterations, everything placed.
        self._wait("iteration 2 trained", lambda: (s := self._run()) and sum(s["trained"].values()) >= 2)
        self.seen["before"] = self._wait("all actors alive", self._placement)
        # The head has the probe's resource and free CPU for the probe alike: what it asked Ray for says more.
        (probe,) = _alive(_actors(), PROBE_CLASS)
        self.seen["probe_asked_for"] = {  # in the trial's placement group: ``<resource>_group_[<i>_]<pg>``
            name.split("_group_")[0]: amount
            for name, amount in (probe.required_resources or {}).items()
            if not name.startswith("bundle_group_")  # Ray's own marker of a bundle
        }

        # Phase 1: the EnvRunner's node goes; an autoscaler brings another with the same resource.
        ((runner_id, runner_node, _),) = self.seen["before"][RUNNER_CLASS]
        (role,) = [r for r, n in node_ids.items() if n == runner_node]
        self.seen["runner_node_removed"] = role
        self.seen["runner_removed_after"] = self._last_logged()
        self.cluster.remove_node(self.nodes[role])
        self.note(f"removed {role} (EnvRunner {runner_id[:8]}) after iteration {self.seen['runner_removed_after']}")
        node = self.cluster.add_node(num_cpus=1, resources={RUNNER: 1})
        self.seen["node_ids"]["runner_2"] = node.node_id
        self.note("added runner_2")

        def runner_back() -> dict[str, Any] | None:
            state = self._run()
            if not state or max(state["restarts"].values(), default=0) < 1:
                return None
            first = min(step for step, value in state["restarts"].items() if value >= 1)
            trained_after = [s for s, v in state["trained"].items() if s > first and v == 1.0]
            return state if len(trained_after) >= 2 else None

        state = self._wait("EnvRunner restart counted, then 2 trained iterations", runner_back)
        self.seen["after_runner_fault"] = self._wait("all actors alive", self._placement)
        self.seen["tags_after_runner_fault"] = dict(state["run"].data.tags)
        self.seen["restarts_after_runner_fault"] = state["restarts"]
        self.seen["trained_after_runner_fault"] = state["trained"]

        # Phase 2: a learner's node goes (a checkpoint is written every iteration).
        learners = self.seen["after_runner_fault"][LEARNER_CLASS]
        (role,) = [r for r, n in node_ids.items() if n == learners[0][1]]
        self.seen["learner_node_removed"] = role
        self.seen["learner_removed_after"] = self._last_logged()
        self.cluster.remove_node(self.nodes[role])
        self.note(f"removed {role} (learner {learners[0][0][:8]}) after iteration {self.seen['learner_removed_after']}")
        node = self.cluster.add_node(num_cpus=1, resources={LEARNER: 1})
        self.seen["node_ids"]["learner_c"] = node.node_id
        self.note("added learner_c")
        old = {a[0] for a in learners}

        def resumed() -> dict[str, Any] | None:
            placement = self._placement()
            if placement is None or {a[0] for a in placement[LEARNER_CLASS]} & old:
                return None
            return placement

        self.seen["after_learner_fault"] = self._wait("two new learners alive", resumed)
        self.note(f"iteration {self._last_logged()} logged")
        self.seen["all_actors"] = {
            cls: [(a.actor_id, a.node_id, a.state, a.num_restarts) for a in found] for cls, found in _actors().items()
        }


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
        "ppo": {"train_batch_size": 256, "minibatch_size": 128, "num_epochs": 1},
        "model": {"trunk_hiddens": [32]},
        "probe": {"gradient_analysis_every": 2, "num_buckets": 2, "custom_resources": {PROBE: 1}},
        "mlflow": {"tracking_uri": uri, "experiment": "multinode", "plots_every": 0},
    }
    config = SweepConfig(
        name="multinode",
        search_space={"ppo.lr": 3e-4},
        checkpoint_every=1,
        keep_checkpoints=ITERATIONS,  # the one the trial resumed from is read back below
        max_failures=2,
        storage_path=str(tmp / "tune"),
    )
    driver = FaultDriver(cluster_obj, nodes, uri, "multinode")
    outcome: dict[str, Any] = {}

    def sweep() -> None:
        try:
            outcome["sweep"] = run_sweep(config, base, progress=None)
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
    return base, outcome["sweep"], driver, tmp / "tune"


def test_learners_probe_and_env_runner_sat_on_the_nodes_they_asked_for(faulted_sweep):
    _, _, driver, _ = faulted_sweep
    assert driver.error is None, "\n".join(driver.log)
    ids = driver.seen["node_ids"]
    before = driver.seen["before"]
    learner_nodes = sorted(node for _, node, _ in before[LEARNER_CLASS])
    assert learner_nodes == sorted([ids["learner_a"], ids["learner_b"]])  # two learners, two nodes
    assert [node for _, node, _ in before[PROBE_CLASS]] == [ids["head"]]  # the probe where PROBE is
    assert driver.seen["probe_asked_for"] == {"CPU": 1.0, PROBE: 1.0}  # probe.num_cpus, probe.custom_resources
    assert [node for _, node, _ in before[RUNNER_CLASS]] == [ids["runner"]]
    assert [node for _, node, _ in before[TRIAL_CLASS]] == [ids["head"]]  # so a lost node is never the trial's own


def test_losing_the_env_runners_node_costs_only_a_restarted_env_runner(faulted_sweep):
    _, _, driver, _ = faulted_sweep
    assert driver.error is None, "\n".join(driver.log)
    ids, before, after = driver.seen["node_ids"], driver.seen["before"], driver.seen["after_runner_fault"]
    # The same EnvRunner actor, restarted once by Ray on the replacement node ...
    ((runner_id, _, restarts_before),) = before[RUNNER_CLASS]
    assert restarts_before == 0
    assert after[RUNNER_CLASS] == [(runner_id, ids["runner_2"], 1)]
    # ... while the trial, its learners and the probe went on untouched: same actors, no restart.
    for cls in (LEARNER_CLASS, PROBE_CLASS, TRIAL_CLASS):
        assert sorted(after[cls]) == sorted(before[cls]), cls
    assert mn.TAG_RESUMED_FROM not in driver.seen["tags_after_runner_fault"]  # no checkpoint restore
    # RLlib counted the restart, and training went on after it.
    restarts, trained = driver.seen["restarts_after_runner_fault"], driver.seen["trained_after_runner_fault"]
    removed_after = driver.seen["runner_removed_after"]
    assert all(value == 0.0 for step, value in restarts.items() if step <= removed_after)
    assert max(restarts.values()) == 1.0
    first = min(step for step, value in restarts.items() if value == 1.0)
    assert sorted(trained) == list(range(1, max(trained) + 1))
    assert sum(value for step, value in trained.items() if step > first) >= 2


def test_losing_a_learners_node_resumes_the_trial_from_its_checkpoint(faulted_sweep):
    from gradmon_ray.rllib.learner import GRADMON_STATE_KEYS
    from gradmon_ray.telemetry.state_digest import state_digest

    base, outcome, driver, storage = faulted_sweep
    assert driver.error is None, "\n".join(driver.log)
    ids = driver.seen["node_ids"]
    (trial,) = outcome.trials
    assert trial.status == "finished" and trial.iterations == ITERATIONS  # Tune restarted it, it finished

    # After the restart: two new learners, on the surviving and the replacement learner node.
    removed = ids[driver.seen["learner_node_removed"]]
    survivor = ({ids["learner_a"], ids["learner_b"]} - {removed}).pop()
    after = driver.seen["after_learner_fault"]
    assert sorted(node for _, node, _ in after[LEARNER_CLASS]) == sorted([survivor, ids["learner_c"]])
    assert [node for _, node, _ in after[PROBE_CLASS]] == [ids["head"]]
    assert [node for _, node, _ in after[RUNNER_CLASS]] == [ids["runner_2"]]
    assert [node for _, node, _ in after[TRIAL_CLASS]] == [ids["head"]]
    # Exactly one trial restart: two learner actors per attempt, two attempts.
    assert len(driver.seen["all_actors"][LEARNER_CLASS]) == 4

    client = MlflowClient(base["mlflow"]["tracking_uri"])
    run = client.get_run(trial.run_id)
    assert run.info.status == "FINISHED"
    resumed_from = int(run.data.tags[mn.TAG_RESUMED_FROM])
    # The restart resumed from a checkpoint written after the EnvRunner fault had been absorbed.
    assert driver.seen["learner_removed_after"] - 1 <= resumed_from < ITERATIONS
    assert max(driver.seen["trained_after_runner_fault"]) <= resumed_from + 1

    # The restored telemetry state is the one saved with that checkpoint: the digest the trial wrote
    # with it, and the learner state on disk hashed here independently.
    checkpoints = {}
    for meta in storage.glob(f"**/checkpoint_*/{TRIAL_STATE_FILE}"):
        checkpoints[json.loads(meta.read_text())["iterations_done"]] = meta.parent
    saved = json.loads((checkpoints[resumed_from] / TRIAL_STATE_FILE).read_text())
    state_file = checkpoints[resumed_from] / "algo" / "learner_group" / "learner" / "state.pkl"
    with state_file.open("rb") as f:  # our own test checkpoint: unpickling it is safe here
        on_disk = pickle.load(f)
    gradmon_state = {k: v for k, v in on_disk.items() if k in GRADMON_STATE_KEYS}
    assert {"gradmon_telemetry", "gradmon_probe"} <= set(gradmon_state)
    assert run.data.tags[mn.TAG_RESUMED_STATE_DIGEST] == saved["state_digest"] == state_digest(gradmon_state)

    # Each iteration logged exactly once, none missing, across both attempts and both faults.
    def history(name: str) -> dict[int, float]:
        points = client.get_metric_history(trial.run_id, name)
        steps = [p.step for p in points]
        assert len(steps) == len(set(steps)), f"{name}: duplicated steps {sorted(steps)}"
        return {p.step: p.value for p in points}

    trained = history(mn.LEARNERS_UPDATED)
    assert sorted(trained) == list(range(1, ITERATIONS + 1))
    busy = sorted(step for step, value in trained.items() if value == 1.0)
    # Telemetry at every trained iteration, its own clock counting updates straight through the restart.
    assert history(mn.TELEMETRY_ITERATION) == {step: float(i) for i, step in enumerate(busy, 1)}
    telemetry = gradmon_state["gradmon_telemetry"]["default_policy"]  # keyed by module
    assert telemetry["iteration"] == sum(1 for s in busy if s <= resumed_from)
    for head in ("op", "value"):
        assert sorted(history(mn.head_metric(mn.HEAD_GRAD_NORM, head))) == busy, head
