"""Say what Ray is waiting for while the algorithm's actors cannot be placed, and give up in time.

Building the algorithm blocks while Ray has no room for its learner and EnvRunner actors (a
GPU request sent to a CPU-only cluster waits forever, silently).  ``ResourceWait`` watches
that wait from a timer thread: after ``report_after_s`` it logs one line with what the run
asks for and what the cluster has, and after ``give_up_after_s`` it interrupts the main
thread, which the caller turns into ``ResourceWaitTimeout`` (exit 1 from the CLI).  An
autoscaling cluster may still add the nodes, which is why this waits instead of refusing.
"""

from __future__ import annotations

import _thread
import logging
import threading
from collections.abc import Mapping
from types import TracebackType

from gradmon_ray.config import GradmonConfig

logger = logging.getLogger(__name__)


class ResourceWaitTimeout(RuntimeError):
    """The cluster did not place the run's actors within ``resources.wait_for_resources_s``."""


def requested_resources(cfg: GradmonConfig) -> dict[str, float]:
    """What the run's actors ask Ray for: one CPU per EnvRunner and per remote learner (RLlib's
    defaults), ``num_gpus_per_learner`` per learner (the driver's own learner with 0 remote ones),
    and their custom resources."""
    res = cfg.resources
    learners = max(1, res.num_learners)
    request = {"CPU": float(res.num_env_runners + res.num_learners)}
    if res.num_gpus_per_learner > 0:
        request["GPU"] = learners * res.num_gpus_per_learner
    for count, custom in (
        (res.num_learners, res.custom_resources_per_learner),
        (res.num_env_runners, res.custom_resources_per_env_runner),
    ):
        for name, amount in custom.items():
            request[name] = request.get(name, 0.0) + count * amount
    return request


def _describe(resources: Mapping[str, float], keys: list[str]) -> str:
    return ", ".join(f"{k} {resources.get(k, 0.0):g}" for k in keys)


class ResourceWait:
    """Context manager around the blocking build (see the module docstring)."""

    def __init__(self, cfg: GradmonConfig, *, report_after_s: float = 30.0) -> None:
        self._request = requested_resources(cfg)
        self._give_up_after_s = cfg.resources.wait_for_resources_s
        self._report_after_s = min(report_after_s, self._give_up_after_s / 2)
        self._timers: list[threading.Timer] = []
        self._done = threading.Event()
        self._lock = threading.Lock()  # the give-up decision and the end of the wait exclude each other
        self.gave_up = False
        self.message = ""

    def _status(self) -> str:
        import ray

        keys = sorted(self._request)
        return (
            f"this run asks for {_describe(self._request, keys)}; the cluster has "
            f"{_describe(ray.cluster_resources(), keys)} in total, {_describe(ray.available_resources(), keys)} free"
        )

    def _report(self) -> None:
        if not self._done.is_set():
            logger.warning(
                "still waiting for Ray to place the learners and EnvRunners after %.0f s: %s",
                self._report_after_s,
                self._status(),
            )

    def _give_up(self) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self.gave_up = True
            self.message = (
                f"gave up after {self._give_up_after_s:g} s waiting for Ray to place the run's actors "
                f"(resources.wait_for_resources_s): {self._status()}"
            )
            _thread.interrupt_main()  # the build blocks the main thread; KeyboardInterrupt unblocks it

    def __enter__(self) -> ResourceWait:
        self._timers = [
            threading.Timer(self._report_after_s, self._report),
            threading.Timer(self._give_up_after_s, self._give_up),
        ]
        for timer in self._timers:
            timer.daemon = True
            timer.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with self._lock:
            self._done.set()
        for timer in self._timers:
            timer.cancel()
        if self.gave_up and exc_type is KeyboardInterrupt:
            raise ResourceWaitTimeout(self.message) from None
