"""The fault driver of ``test_multinode_fault_e2e.py``: watches one sweep trial in MLflow and Ray's actor
table, removes the EnvRunner's node and later a learner's, adds a replacement for the first (as an
autoscaler would: one node with both custom resources, which the lost learner's successor takes
later), and records what it saw for the tests to read."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.sweep.trials import PARENT_RUN_TAG

LEARNER, RUNNER, PROBE = "gradmon_test_learner_node", "gradmon_test_runner_node", "gradmon_test_probe_node"
LEARNER_CLASS, RUNNER_CLASS, PROBE_CLASS, TRIAL_CLASS = (
    "_WrappedExecutable",  # RLlib's learner actors (Ray Train's worker wrapper)
    "SingleAgentEnvRunner",
    "GradientProbe",
    "ImplicitFunc",  # the Tune trial running run_training
)
PHASE_TIMEOUT_S = 240.0
CHECKPOINT_EVERY = 2
"""The learner's node goes one iteration after a checkpoint, so the resumed attempt usually trains
an iteration the lost one had logged already (``gradmon.recomputed_iterations``); 2, not 3, so the
driver waits at most one iteration for that point."""


@dataclass(frozen=True)
class Actor:
    actor_id: str
    node_id: str
    state: str
    num_restarts: int
    required: dict[str, float]


def actors() -> dict[str, list[Actor]]:
    """Every actor of the cluster by class name, alive or dead, from GCS's actor table.

    Read through ``ray._private.state`` (the public ``ray.util.state`` needs the dashboard, whose nine
    module processes cost more CPU than the rest of the head node): ``required_resources`` is
    what the actor asked Ray for."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    by_class: dict[str, list[Actor]] = {}
    for raw in state._connect_and_get_accessor().get_actor_table(None, None):
        data = gcs_pb2.ActorTableData.FromString(raw)
        by_class.setdefault(data.class_name.rsplit(".", 1)[-1], []).append(  # ``wrap_function.<locals>.X``
            Actor(
                actor_id=data.actor_id.hex(),
                node_id=data.address.node_id.hex(),
                state=gcs_pb2.ActorTableData.ActorState.Name(data.state),
                num_restarts=data.num_restarts,
                required=dict(data.required_resources),
            )
        )
    return by_class


def alive(found: dict[str, list[Actor]], cls: str) -> list[Actor]:
    return [a for a in found.get(cls, []) if a.state == "ALIVE"]


def asked_for(actor: Actor) -> dict[str, float]:
    """What an actor in a placement group asked for: ``<resource>_group_[<i>_]<pg>`` -> ``<resource>``."""
    return {
        name.split("_group_")[0]: amount
        for name, amount in actor.required.items()
        if not name.startswith("bundle_group_")  # Ray's own marker of a bundle
    }


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
        """Poll ``condition`` until it returns something true (a GCS call that fails is a "not yet")."""
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        last_error = None
        while not self.done.is_set():
            try:
                value = condition()
            except Exception as exc:  # GCS busy on a loaded box: ask again
                value, last_error = None, exc
            if value:
                self.note(f"seen: {what}")
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"not seen within {PHASE_TIMEOUT_S:g} s: {what} (last error: {last_error!r})")
            time.sleep(0.5)  # a look is MLflow queries or a GCS call: not free on a 2-core box
        raise RuntimeError(f"the sweep ended before: {what}")

    def _last_logged(self) -> int:
        return max(self._wait("the run's history", self._run)["trained"])

    def _logged_through(self) -> int:
        state = self._run()
        return max(state["trained"], default=0) if state else 0

    def _placement(self) -> dict[str, list[Actor]] | None:
        found = actors()
        placed = {cls: alive(found, cls) for cls in (LEARNER_CLASS, RUNNER_CLASS, PROBE_CLASS, TRIAL_CLASS)}
        return placed if [len(a) for a in placed.values()] == [2, 1, 1, 1] else None

    def run(self) -> None:
        try:
            self._drive()
        except Exception as exc:  # reported by the tests
            self.error = exc
            self.note(f"error: {type(exc).__name__}: {exc}")

    def _remove(self, role: str, after: int) -> None:
        self.cluster.remove_node(self.nodes[role])
        self.note(f"removed {role} after iteration {after}")

    def _drive(self) -> None:
        node_ids = {role: node.node_id for role, node in self.nodes.items()}
        node_ids["head"] = self.cluster.head_node.node_id
        self.seen["node_ids"] = dict(node_ids)

        # Phase 0: two trained iterations, everything placed.
        self._wait("iteration 2 trained", lambda: (s := self._run()) and sum(s["trained"].values()) >= 2)
        self.seen["before"] = self._wait("all actors alive", self._placement)

        # Phase 1: the EnvRunner's node goes; an autoscaler brings another with the same resource.
        (runner,) = self.seen["before"][RUNNER_CLASS]
        (role,) = [r for r, n in node_ids.items() if n == runner.node_id]
        self.seen["runner_node_removed"] = role
        self.seen["runner_removed_after"] = self._last_logged()
        self._remove(role, self.seen["runner_removed_after"])
        # Its replacement can host a learner too: the learner lost later is replaced by it (a node
        # started for the learner fault cost one more raylet, and the resumed trial waited for it).
        node = self.cluster.add_node(num_cpus=2, resources={RUNNER: 1, LEARNER: 1})
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

        # Phase 2: a learner's node goes, one iteration after a checkpoint.
        learners = self.seen["after_runner_fault"][LEARNER_CLASS]
        (role,) = [r for r, n in node_ids.items() if n == learners[0].node_id]
        self.seen["learner_node_removed"] = role
        after = self._wait(
            f"an iteration 1 past a multiple of {CHECKPOINT_EVERY} logged",
            lambda: (last := self._logged_through()) % CHECKPOINT_EVERY == 1 and last,
        )
        self.seen["learner_removed_after"] = after
        self._remove(role, after)
        old = {a.actor_id for a in learners}

        def resumed() -> dict[str, list[Actor]] | None:
            placement = self._placement()
            if placement is None or {a.actor_id for a in placement[LEARNER_CLASS]} & old:
                return None
            return placement

        self.seen["after_learner_fault"] = self._wait("two new learners alive", resumed)
        self.note(f"iteration {self._last_logged()} logged")
        self.seen["all_actors"] = actors()
