"""The GradientProbe actor's lifecycle around a training run, on the driver.

``run_training`` starts the actor before the algorithm (so the learner's probe client finds it),
collects the last probe counters from rank 0's learner before the algorithm stops, and lets the
actor write its last probe to MLflow before ending it.  The probe is an observer: a failure in any
of these steps is logged and training goes on (or ends) without it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gradmon_ray.config import GradmonConfig
from gradmon_ray.tracking import MlflowSink

logger = logging.getLogger(__name__)

PROBE_RUN_WAIT_S = 15.0
"""How long the driver waits for the MLflow run before starting the probe without one."""
PROBE_FLUSH_S = 30.0


def start_probe(cfg: GradmonConfig, name: str, sink: MlflowSink, skip_through: int = 0) -> Any:
    """Start the GradientProbe actor writing into the sink's run (None, with a warning, if it cannot start).

    ``skip_through``: the last iteration the run has in MLflow (a resumed run's ``logged_through``):
    the iterations it trains again are probed, and not logged twice."""
    from gradmon_ray.probe import start_probe_actor

    run_id = sink.wait_for_run(PROBE_RUN_WAIT_S)
    if run_id is None:
        logger.warning(
            "MLflow run not created within %.0f s (%s): the gradient probe runs but its metrics are not recorded",
            PROBE_RUN_WAIT_S,
            sink.last_error,
        )
    try:
        return start_probe_actor(
            name,
            tracking_uri=cfg.mlflow.tracking_uri,
            run_id=run_id,
            num_buckets=cfg.probe.num_buckets,
            regularizers=[r.model_dump() for r in cfg.regularizers],
            track_grad_norms=cfg.probe.track_grad_norms,
            num_cpus=cfg.probe.num_cpus,
            num_gpus=cfg.probe.num_gpus,
            max_restarts=cfg.probe.max_restarts,
            resources=cfg.probe.custom_resources,
            skip_through=skip_through,
        )
    except Exception as exc:  # the probe is an observer: training goes on without it
        logger.warning("gradient probe actor could not start (%s: %s); training without it", type(exc).__name__, exc)
        return None


def flush_probe(algo: Any, timeout_s: float = PROBE_FLUSH_S) -> dict[str, float]:
    """Wait for the probe still in flight on rank 0's learner; its final probe counters ({}: none).

    Runs inside the learner (local or remote): ``ProbeClient.finish`` collects the last
    outcome, resending the request if the actor was restarting.
    """

    def finish(learner: Any) -> dict[str, float]:
        client = getattr(learner, "probe_client", None)  # GradmonPPOTorchLearner's (rank 0 only)
        if client is None:
            return {}
        client.finish(timeout_s)
        return client.metrics()

    counters: dict[str, float] = {}
    try:
        for result in algo.learner_group.foreach_learner(finish, timeout_seconds=timeout_s + 30):
            if result.ok:
                counters.update(result.get() or {})
    except Exception as exc:  # a broken learner group: the per-iteration counters stay as logged
        logger.warning("gradient probe: final probe counters not collected (%s: %s)", type(exc).__name__, exc)
    return counters


def stop_probe(probe: Any) -> None:
    """Let the probe finish its last request and write it to MLflow, then end the actor."""
    import ray

    deadline = time.monotonic() + PROBE_FLUSH_S
    while True:
        try:
            if not ray.get(probe.flush.remote(PROBE_FLUSH_S), timeout=2 * PROBE_FLUSH_S):
                logger.warning("gradient probe: some probe metrics did not reach MLflow")
            break
        except ray.exceptions.ActorUnavailableError:  # restarting: give it the rest of the deadline
            if time.monotonic() > deadline:
                logger.warning("gradient probe: still restarting at the end of the run; its last probe is lost")
                break
            time.sleep(0.5)
        except Exception as exc:
            logger.warning("gradient probe: final flush failed (%s)", type(exc).__name__)
            break
    ray.kill(probe)
