"""The ``GradientProbe`` Ray actor: runs bucketed gradient probes beside training.

The driver starts it (``start_probe_actor``) once the MLflow run exists; rank 0's learner
finds it by name and hands it, without waiting, a ``ProbeRequest``: for each probed module,
its weights as they were *before* the iteration's update (so the probe sees the gradient the
update started from) and its share of the iteration's postprocessed batch.  The actor builds
its own copy of each module, runs ``analyse_batch`` per module and writes the metrics into the
training run through its own ``MlflowSink`` (asynchronous, retried), with the training
iteration as step: plain names in a one-module run, ``module/<id>/<name>`` with several.

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
from gradmon_ray.probe.client import PROBE_ACTOR_PREFIX, ModuleProbe, ProbeOutcome, ProbeRequest, probe_actor_name
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
        skip_through: iterations up to this one are in the run already (a resumed run trains them
            again): probed, not logged a second time.
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
        skip_through: int = 0,
    ) -> None:
        self.num_buckets = int(num_buckets)
        self._skip_through = int(skip_through)
        self._regularizers: list[RegularizerSpec] = (
            [resolve_regularizer(**dict(entry)) for entry in regularizers] if track_grad_norms else []
        )
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._sink = (
            MlflowSink(tracking_uri, "", run_id=run_id) if tracking_uri is not None and run_id is not None else None
        )
        self._modules: dict[str, tuple[Any, torch.nn.Module]] = {}
        """Per module id: the spec it was built from and the actor's copy (rebuilt when the spec changes)."""
        self.last_metrics: dict[str, float] = {}
        self._warned: set[str] = set()
        self._instance = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def analyse(self, request: ProbeRequest) -> ProbeOutcome:
        """Probe each module's batch and log the metrics; never raises (the outcome says what happened).

        Each module is analysed on its own: one that cannot be built, loaded or analysed is an
        ``error`` in the outcome, and the other modules' metrics are still logged.
        """
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        statuses: dict[str, str] = {}
        problems: list[str] = []
        for part in request.modules:
            status, found, message = self._analyse_module(request.iteration, part)
            statuses[part.module_id] = status
            prefix = part.module_id if request.per_module_names else None
            metrics.update({mn.module_metric(prefix, name): value for name, value in found.items()})
            if message:
                problems.append(f"module {part.module_id!r}: {message}" if len(request.modules) > 1 else message)
        # Modules no longer probed (removed mid-run) give their copies back.
        self._modules = {mid: built for mid, built in self._modules.items() if mid in statuses}
        duration = time.perf_counter() - start
        values = set(statuses.values())
        status = "error" if "error" in values else "ok" if "ok" in values else "skipped"
        if "ok" in values:
            metrics[mn.PROBE_DURATION_S] = duration
            self.last_metrics = metrics
            if self._sink is not None and request.iteration > self._skip_through:
                self._sink.log_iteration(request.iteration, metrics)
        return ProbeOutcome(
            request.iteration, status, duration, num_metrics=len(metrics), message="; ".join(problems), modules=statuses
        )

    def _analyse_module(self, iteration: int, part: ModuleProbe) -> tuple[str, dict[str, float], str]:
        """``(status, metrics, message)``: ``("ok", metrics, "")`` or ``("skipped" | "error", {}, why)``;
        never raises."""
        try:
            module = self._module_for(part)
            found = analyse_batch(
                module, part.batch, num_buckets=self.num_buckets, loss=part.loss, regularizers=self._regularizers
            )
        except TooFewGroupsError as exc:
            self._warn_once(
                f"few/{part.module_id}",
                f"gradmon probe: iteration {iteration}, module {part.module_id!r} not bucketed: {exc}",
            )
            return "skipped", {}, str(exc)
        except Exception as exc:  # a probe failure is reported, never raised into the caller
            logger.exception("gradmon probe: iteration %d, module %r failed", iteration, part.module_id)
            return "error", {}, f"{type(exc).__name__}: {exc}"
        return "ok", found, ""

    def _module_for(self, part: ModuleProbe) -> torch.nn.Module:
        """The actor's own copy of ``part``'s module (built once per module and spec), with its weights."""
        spec, module = self._modules.get(part.module_id, (None, None))
        if module is None or part.module_spec != spec:
            module = part.module_spec.build().to(self._device)
            self._modules[part.module_id] = (part.module_spec, module)
        # torch.tensor copies: Ray hands numpy arrays over read-only (zero-copy from the object store).
        module.load_state_dict({k: torch.tensor(v) for k, v in part.weights.items()})
        return module

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
    skip_through: int = 0,
) -> Any:
    """Start the named probe actor (its own CPU, or a GPU fraction) and wait until it is up.

    ``resources``: custom Ray resources it asks for besides (``probe.custom_resources``), which
    pins it, and a restart of it, to nodes advertising them.  ``skip_through``: the last iteration
    the run has in MLflow already (``GradientProbe``).

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
        skip_through=skip_through,
    )
    ray.get(handle.ready.remote())
    return handle
