"""The ``GradientProbe`` Ray actor: runs bucketed gradient probes beside training.

The driver starts it (``start_probe_actor``) once the MLflow run exists; rank 0's learner
finds it by name and hands it, without waiting, a ``ProbeRequest``: the module's weights
as they were *before* the iteration's update (so the probe sees the gradient the update
started from) and the iteration's postprocessed batch.  The actor builds its own copy of
the module, runs ``analyse_batch`` and writes the metrics into the training run through
its own ``MlflowSink`` (asynchronous, retried), with the training iteration as step.

Nothing here can hurt training: the actor only ever owns copies, a failed analysis is
reported in the call's return value, and the learner never waits for a call to finish.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradmon_ray import metric_names as mn
from gradmon_ray.losses.regularizers import RegularizerSpec, resolve_regularizer
from gradmon_ray.probe.analysis import TooFewGroupsError, analyse_batch
from gradmon_ray.probe.client import PROBE_ACTOR_PREFIX, ProbeOutcome, ProbeRequest, probe_actor_name
from gradmon_ray.tracking.mlflow_sink import MlflowSink

logger = logging.getLogger(__name__)

__all__ = [
    "PROBE_ACTOR_PREFIX",
    "GradientProbe",
    "ProbeOutcome",
    "ProbeRequest",
    "probe_actor_name",
    "start_probe_actor",
]


class GradientProbe:
    """Runs probes on copies; usable as a plain object (tests) or as a Ray actor.

    Args:
        tracking_uri, run_id: the MLflow run to write into (None: compute and return only).
        num_buckets: K reward-variance buckets.
        regularizers: ``{"name", "fn", "weight", "enabled"}`` entries (resolved here, so a
            user function is imported in the actor's process).
        track_grad_norms: take each regularizer's gradient (ADR-009); off by default.
        device: where the module copy lives (``"cuda"`` when the actor got a GPU).
    """

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        run_id: str | None = None,
        num_buckets: int = 4,
        regularizers: Sequence[Mapping[str, Any]] = (),
        track_grad_norms: bool = False,
        device: str | None = None,
    ) -> None:
        self.num_buckets = int(num_buckets)
        self._regularizers: list[RegularizerSpec] = (
            [resolve_regularizer(**dict(entry)) for entry in regularizers] if track_grad_norms else []
        )
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._sink = (
            MlflowSink(tracking_uri, "", run_id=run_id) if tracking_uri is not None and run_id is not None else None
        )
        self._module: torch.nn.Module | None = None
        self._module_spec: Any = None
        self.last_metrics: dict[str, float] = {}
        self._warned: set[str] = set()
        self._instance = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def analyse(self, request: ProbeRequest) -> ProbeOutcome:
        """Probe one batch and log the metrics; never raises (the outcome says what happened)."""
        start = time.perf_counter()
        try:
            module = self._module_for(request)
            metrics = analyse_batch(
                module,
                request.batch,
                num_buckets=self.num_buckets,
                loss=request.loss,
                regularizers=self._regularizers,
            )
        except TooFewGroupsError as exc:
            self._warn_once("few", f"gradmon probe: iteration {request.iteration} not bucketed: {exc}")
            return ProbeOutcome(request.iteration, "skipped", time.perf_counter() - start, message=str(exc))
        except Exception as exc:  # a probe failure is reported, never raised into the caller
            message = f"{type(exc).__name__}: {exc}"
            logger.exception("gradmon probe: iteration %d failed", request.iteration)
            return ProbeOutcome(request.iteration, "error", time.perf_counter() - start, message=message)
        duration = time.perf_counter() - start
        metrics[mn.PROBE_DURATION_S] = duration
        self.last_metrics = metrics
        if self._sink is not None:
            self._sink.log_iteration(request.iteration, metrics)
        return ProbeOutcome(request.iteration, "ok", duration, num_metrics=len(metrics))

    def _module_for(self, request: ProbeRequest) -> torch.nn.Module:
        if self._module is None or request.module_spec != self._module_spec:
            self._module = request.module_spec.build().to(self._device)
            self._module_spec = request.module_spec
        # torch.tensor copies: Ray hands numpy arrays over read-only (zero-copy from the object store).
        self._module.load_state_dict({k: torch.tensor(v) for k, v in request.weights.items()})
        return self._module

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Write everything logged so far; True when all of it reached MLflow."""
        return True if self._sink is None else self._sink.flush(timeout_s)

    def ready(self) -> bool:
        """For ``ray.get(actor.ready.remote())``: the actor is up."""
        return True

    def instance(self) -> str:
        """Which incarnation answers: a new value after every (re)start.

        ``ray.kill(actor, no_restart=False)`` is asynchronous, so a call made right after it
        may still be answered by the dying instance; waiting for a *new* value is how to
        wait for the restart.
        """
        return self._instance

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


def start_probe_actor(
    name: str,
    *,
    tracking_uri: str | None,
    run_id: str | None,
    num_buckets: int,
    regularizers: Sequence[Mapping[str, Any]] = (),
    track_grad_norms: bool = False,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    max_restarts: int = 3,
    resources: Mapping[str, float] | None = None,
) -> Any:
    """Start the named probe actor (its own CPU, or a GPU fraction) and wait until it is up.

    ``resources``: custom Ray resources it asks for besides (``probe.custom_resources``), which
    pins it, and a restart of it, to nodes advertising them.

    A restarted actor is rebuilt from these same arguments, so it writes into the same run.
    ``max_task_retries=0``: a probe that died with the actor is counted as failed by the
    learner, not re-run behind its back; one sent while the actor was restarting never ran,
    and the learner's ``ProbeClient`` sends it again once the actor is back.
    """
    import ray

    actor_cls = ray.remote(GradientProbe)
    handle = actor_cls.options(
        name=name,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        resources=dict(resources or {}),
        max_restarts=max_restarts,
        max_task_retries=0,
        max_concurrency=1,
    ).remote(
        tracking_uri=tracking_uri,
        run_id=run_id,
        num_buckets=num_buckets,
        regularizers=[dict(r) for r in regularizers],
        track_grad_norms=track_grad_norms,
        device="cuda" if num_gpus > 0 else "cpu",
    )
    ray.get(handle.ready.remote())
    return handle
