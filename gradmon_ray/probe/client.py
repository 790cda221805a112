"""The learner's side of the probe: decide when, hand off without waiting, count what happened.

At most one probe is in flight.  A probe iteration that finds the previous probe still
running is dropped and counted (``probe/requests_dropped``), never queued, so a slow probe
cannot build up a backlog or memory.  The actor is found by name (the driver starts it);
a missing or dead actor is counted as a failure and warned about once per outage, and
requests resume as soon as Ray has restarted it.
"""

from __future__ import annotations

import logging
from typing import Any

from gradmon_ray import metric_names as mn

logger = logging.getLogger(__name__)


class ProbeClient:
    """Non-blocking hand-off to the named ``GradientProbe`` actor every ``every`` iterations."""

    def __init__(self, actor_name: str, every: int) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.actor_name = actor_name
        self.every = every
        self.counters: dict[str, int] = dict.fromkeys(mn.PROBE_COUNTERS, 0)
        self.last_outcome: Any = None
        self._handle: Any = None
        self._in_flight: Any = None
        self._outage_warned = False

    def due(self, iteration: int) -> bool:
        """Whether training iteration ``iteration`` (1-based) is a probe iteration."""
        return iteration % self.every == 0

    @property
    def busy(self) -> bool:
        """Whether a probe is in flight (collects a finished one first; never blocks)."""
        self.poll()
        return self._in_flight is not None

    def reserve(self) -> bool:
        """True when a new request may be sent now; otherwise the request is counted as dropped."""
        if self.busy:
            self.counters[mn.PROBE_REQUESTS_DROPPED] += 1
            return False
        return True

    def submit(self, request: Any) -> None:
        """Send ``request`` to the actor and return at once."""
        handle = self._lookup()
        if handle is None:
            self._failed(f"no actor named {self.actor_name!r}")
            return
        try:
            self._in_flight = handle.analyse.remote(request)
        except Exception as exc:  # e.g. the actor is gone for good
            self._handle = None
            self._failed(f"{type(exc).__name__}: {exc}")
            return
        self.counters[mn.PROBE_REQUESTS_SENT] += 1

    def poll(self) -> None:
        """Collect the in-flight probe's outcome if it has finished (never blocks)."""
        import ray

        if self._in_flight is None:
            return
        ready, _ = ray.wait([self._in_flight], timeout=0)
        if not ready:
            return
        ref, self._in_flight = self._in_flight, None
        try:
            outcome = ray.get(ref)
        except Exception as exc:  # RayActorError & co: the actor died with our request
            self._failed(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return
        self.last_outcome = outcome
        if outcome.status == "ok":
            self.counters[mn.PROBE_COMPLETED] += 1
            self._outage_warned = False
        elif outcome.status == "skipped":
            self.counters[mn.PROBE_SKIPPED] += 1
        else:
            self._failed(f"iteration {outcome.iteration}: {outcome.message}")

    def _lookup(self) -> Any:
        import ray

        if self._handle is None:
            try:
                self._handle = ray.get_actor(self.actor_name)
            except ValueError:
                return None
        return self._handle

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
