"""The learner's side of the probe: decide when, hand off without waiting, count what happened.

At most one probe is in flight.  A probe iteration that finds the previous probe still
running is dropped and counted (``probe/requests_dropped``), never queued, so a slow probe
cannot build up a backlog or memory.  The actor is found by name (the driver starts it);
a missing or dead actor is counted as a failure and warned about once per outage.

A request that reaches the actor while Ray restarts it (``ActorUnavailableError``, "the
actor is restarting": the request never ran) is not a failure: the client keeps the
request (in the object store) and sends it again, without ever blocking, until the
restarted actor takes it, so the probe of that iteration still arrives.  A request that
was running (or queued) when the actor died, an actor gone for good, or a restart that
takes longer than ``restart_wait_s`` count as failures.

One request carries every probed module of the iteration (``ProbeRequest.modules``), so the
counters count iterations, whatever the number of modules.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradmon_ray import compat
from gradmon_ray import metric_names as mn

logger = logging.getLogger(__name__)

RESEND_AFTER_S = 0.5
"""Pause before a request the restarting actor could not take is sent again."""
RESTART_WAIT_S = 300.0
"""How long one request waits for a restarting actor before it counts as failed."""


@dataclass(frozen=True)
class LossSettings:
    """The PPO coefficients of the probed iteration (the KL coefficient adapts, so it travels)."""

    clip_param: float
    vf_clip_param: float
    vf_loss_coeff: float
    entropy_coeff: float
    kl_coeff: float
    use_kl_loss: bool


PROBE_ACTOR_PREFIX = "gradmon-probe-"
"""The actor's name is this prefix plus a run-unique suffix (see ``probe_actor_name``)."""


@dataclass
class ModuleProbe:
    """One module's share of a probe request: everything its analysis needs, as plain numpy."""

    module_id: str
    module_spec: Any
    """An ``RLModuleSpec`` that builds the learner's module (class, spaces, model config)."""
    weights: dict[str, np.ndarray]
    batch: dict[str, Any]
    loss: LossSettings


@dataclass
class ProbeRequest:
    """What the learner sends once per probed iteration: one ``ModuleProbe`` per probed module.

    One request for all modules (not one per module): one Ray call and one MLflow write per
    iteration, and the client's one-in-flight rule keeps holding for the whole iteration.
    """

    iteration: int
    modules: list[ModuleProbe]
    per_module_names: bool = False
    """True when the learner monitors several modules: each module's metrics are named
    ``module/<id>/<name>`` (``metric_names.module_metric``), as every other per-module metric;
    False (one module): the plain names."""
    sent_at: float = field(default_factory=time.time)


@dataclass
class ProbeOutcome:
    """What a probe call returns to the learner (small: the metrics go to MLflow directly)."""

    iteration: int
    status: str
    """``ok`` (every module analysed, or some and the rest skipped), ``skipped`` (no module had
    enough groups to bucket) or ``error`` (some module failed; the others' metrics were still logged)."""
    duration_s: float
    num_metrics: int = 0
    message: str = ""
    modules: dict[str, str] = field(default_factory=dict)
    """Each module's own status (``ok``, ``skipped`` or ``error``)."""


def probe_actor_name(suffix: str) -> str:
    """The probe actor's name for one run (the suffix makes concurrent runs independent)."""
    return PROBE_ACTOR_PREFIX + suffix


class ProbeClient:
    """Non-blocking hand-off to the named ``GradientProbe`` actor every ``every`` iterations."""

    def __init__(self, actor_name: str, every: int, *, restart_wait_s: float = RESTART_WAIT_S) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.actor_name = actor_name
        self.every = every
        self.restart_wait_s = restart_wait_s
        self.counters: dict[str, int] = dict.fromkeys(mn.PROBE_COUNTERS, 0)
        self.resends = 0
        """Requests sent again because the actor was restarting (not a counter in MLflow)."""
        self.last_outcome: Any = None
        self._handle: Any = None
        self._in_flight: Any = None
        self._request_ref: Any = None  # the request until its outcome is in (resent while the actor restarts)
        self._resend_at: float | None = None
        self._give_up_at = 0.0
        self._outage_warned = False

    def due(self, iteration: int) -> bool:
        """Whether training iteration ``iteration`` (1-based) is a probe iteration."""
        return iteration % self.every == 0

    @property
    def busy(self) -> bool:
        """Whether a probe is in flight or waiting for a restarting actor (never blocks)."""
        self.poll()
        return self._in_flight is not None or self._request_ref is not None

    def reserve(self) -> bool:
        """True when a new request may be sent now; otherwise the request is counted as dropped."""
        if self.busy:
            self.counters[mn.PROBE_REQUESTS_DROPPED] += 1
            return False
        return True

    def submit(self, request: Any) -> None:
        """Send ``request`` to the actor and return at once."""
        import ray

        handle = self._lookup()
        if handle is None:
            self._failed(f"no actor named {self.actor_name!r}")
            return
        try:
            self._request_ref = ray.put(request)
            self._give_up_at = time.monotonic() + self.restart_wait_s
            self._in_flight = handle.analyse.remote(self._request_ref)
        except Exception as exc:  # e.g. the actor is gone for good
            self._handle = None
            self._clear()
            self._failed(f"{type(exc).__name__}: {exc}")
            return
        self.counters[mn.PROBE_REQUESTS_SENT] += 1

    def poll(self) -> None:
        """Collect the in-flight probe's outcome if it has finished, resend a due retry (never blocks)."""
        import ray

        if self._in_flight is None:
            if self._request_ref is not None and self._resend_at is not None and time.monotonic() >= self._resend_at:
                self._resend()
            return
        ready, _ = ray.wait([self._in_flight], timeout=0)
        if not ready:
            return
        ref, self._in_flight = self._in_flight, None
        try:
            outcome = ray.get(ref)
        except ray.exceptions.ActorUnavailableError as exc:
            if not _refused_while_restarting(exc):  # "was restarted": it may have died with our request
                self._clear()
                self._failed(f"{type(exc).__name__}: {_first_line(exc)}")
            elif time.monotonic() < self._give_up_at:  # the request never ran: send it again soon
                self._resend_at = time.monotonic() + RESEND_AFTER_S
            else:
                self._clear()
                self._failed(f"actor still restarting after {self.restart_wait_s:.0f} s: {_first_line(exc)}")
            return
        except Exception as exc:  # RayActorError & co: the actor died with our request
            self._clear()
            self._failed(f"{type(exc).__name__}: {_first_line(exc)}")
            return
        self._clear()
        self.last_outcome = outcome
        if outcome.status == "ok":
            self.counters[mn.PROBE_COMPLETED] += 1
            self._outage_warned = False
        elif outcome.status == "skipped":
            self.counters[mn.PROBE_SKIPPED] += 1
        else:
            self._failed(f"iteration {outcome.iteration}: {outcome.message}")

    def finish(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for the probe in flight, resending it to a restarting actor.

        For the end of a run: afterwards the counters say what happened to every request. A
        request still unfinished at the deadline is counted as failed. True when none was.
        """
        import ray

        deadline = time.monotonic() + timeout_s
        while self.busy:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._in_flight = None
                self._clear()
                self._failed(f"the last probe did not finish within {timeout_s:.0f} s")
                return False
            if self._in_flight is not None:
                ray.wait([self._in_flight], timeout=min(remaining, 1.0))
            else:
                time.sleep(min(remaining, RESEND_AFTER_S))
        return True

    def _resend(self) -> None:
        handle = self._lookup()
        self._resend_at = None
        try:
            if handle is None:
                raise ValueError(f"no actor named {self.actor_name!r}")
            self._in_flight = handle.analyse.remote(self._request_ref)
        except Exception as exc:
            self._handle = None
            self._clear()
            self._failed(f"{type(exc).__name__}: {exc}")
            return
        self.resends += 1

    def _clear(self) -> None:
        self._request_ref = None
        self._resend_at = None

    def _lookup(self) -> Any:
        import ray

        if self._handle is None:
            try:
                self._handle = ray.get_actor(self.actor_name)
            except Exception:  # not there (ValueError), or Ray itself unreachable: a counted failure either way
                return None
        return self._handle

    def record_failure(self, reason: str) -> None:
        """Count a probe that failed before it reached the actor (its request could not be built)."""
        self._failed(reason)

    def _failed(self, reason: str) -> None:
        self.counters[mn.PROBE_FAILURES] += 1
        if not self._outage_warned:
            self._outage_warned = True
            logger.warning(
                "gradmon probe request failed (%s); training continues, probes resume when the actor is back", reason
            )

    def metrics(self) -> dict[str, float]:
        """The cumulative counters as metrics."""
        return {name: float(value) for name, value in self.counters.items()}

    def state_dict(self) -> dict[str, int]:
        """Counters, for learner checkpoints."""
        return dict(self.counters)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore counters written by ``state_dict`` (unknown keys are ignored)."""
        for name in self.counters:
            self.counters[name] = int(state.get(name, 0))


def _refused_while_restarting(exc: BaseException) -> bool:
    """Whether Ray refused the request because the actor was restarting (so it never ran).

    Ray raises ``ActorUnavailableError`` both for a request sent while the actor restarts
    ("The actor is restarting") and for one the actor was running or about to run when it
    died ("The actor was restarted"; it may have run). Only the first is safe to send again:
    a probe that crashed the actor must not be re-run behind the user's back and crash it
    again. Any other wording counts as a failure, as before.
    """
    return compat.refused_while_restarting(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""
