"""What Ray can give this run: is the cluster there, can it ever hold the run, and the wait while it cannot yet.

Three checks, in the order a run meets them:

- ``ray_address_problem``: an address nothing answers at is refused at once (``ray.init`` would
  retry silently until Ctrl-C).
- ``over_total_problem``: a Ray that *this run started* (a local one) never grows, so a request
  larger than its total resources can never be placed: refused (exit 2) before an MLflow run or
  store exists.  A cluster we only connect to may autoscale (Ray has no public API for the
  autoscaler's maximum), so there a request over today's total is logged and waited for.
- ``ResourceWait``: building the algorithm blocks while Ray has no room for its learner and
  EnvRunner actors.  It watches that wait from a timer thread: after ``report_after_s`` it logs
  one line with what the run asks for and what the cluster has, and after ``give_up_after_s``
  it interrupts the main thread, which the caller turns into ``ResourceWaitTimeout`` (exit 1
  from the CLI).
"""

from __future__ import annotations

import _thread
import logging
import socket
import threading
import time
from collections.abc import Mapping
from types import TracebackType

from gradmon_ray.config import GradmonConfig

logger = logging.getLogger(__name__)


class ResourceWaitTimeout(RuntimeError):
    """The cluster did not place the run's actors within ``resources.wait_for_resources_s``."""


def requested_resources(cfg: GradmonConfig) -> dict[str, float]:
    """What the run's actors ask Ray for: one CPU per EnvRunner and per remote CPU learner (RLlib's
    defaults; a GPU learner takes no CPU), ``num_gpus_per_learner`` per learner (the driver's own
    learner with 0 remote ones), and their custom resources."""
    res = cfg.resources
    learners = max(1, res.num_learners)
    # RLlib's num_cpus_per_learner="auto": 1 CPU per CPU learner, none for a GPU learner.
    cpu_learners = res.num_learners if res.num_gpus_per_learner == 0 else 0
    request = {"CPU": float(res.num_env_runners + cpu_learners)}
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


GCS_PORT, CLIENT_PORT = 6379, 10001  # Ray's defaults: ``ray start --head`` and the Ray Client server


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` that a Ray address connects to; None for ``auto``/``local`` (Ray resolves those)."""
    if address in ("auto", "local") or ("://" in address and not address.startswith("ray://")):
        return None
    default = CLIENT_PORT if address.startswith("ray://") else GCS_PORT
    hostport = address.removeprefix("ray://").split("/", 1)[0]
    if hostport.startswith("["):  # [::1]:6379
        host, _, rest = hostport[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = hostport.rpartition(":") if hostport.count(":") == 1 else (hostport, "", "")
    if not port.isdigit():
        return host or hostport, default
    return host, int(port)


def ray_address_problem(address: str | None, timeout_s: float = 15.0) -> str | None:
    """Why nothing can be reached at Ray ``address`` (None: a TCP connection opened, or no address).

    Only the TCP port is tried: a refused connection or an unknown host is final at once (no
    Ray listens there now); a silent one is retried until ``timeout_s``.  ``ray.init`` itself
    would retry for minutes without a word.
    """
    target = _host_port(address) if address else None
    if target is None:
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection(target, timeout=max(0.1, min(remaining, 3.0))):
                return None
        except socket.gaierror as exc:
            reason = f"unknown host {target[0]!r} ({exc.strerror})"
        except ConnectionRefusedError:
            reason = f"nothing listens on {target[0]}:{target[1]}"
        except OSError as exc:  # a timeout, or a network that is not there yet: retried until the deadline
            if time.monotonic() + 0.5 < deadline:
                time.sleep(0.5)
                continue
            reason = f"no answer from {target[0]}:{target[1]} within {timeout_s:g} s ({exc.strerror or exc})"
        return f"cannot reach Ray at {address}: {reason}; start the cluster or fix the address (unset: a local Ray)"


def over_total_problem(request: Mapping[str, float], total: Mapping[str, float]) -> str | None:
    """Why ``request`` can never be placed on a Ray whose total resources are ``total``, in one line
    (None: it fits the total, even if not what is free now)."""
    short = sorted(k for k, v in request.items() if v > total.get(k, 0.0) + 1e-9)
    if not short:
        return None
    hint = (
        " (resources.num_cpus sets a local Ray's logical CPUs; Ray may be given more than the machine has)"
        if "CPU" in short
        else ""
    )
    return (
        f"this run asks for {_describe(request, sorted(request))} but this Ray has {_describe(total, sorted(request))} "
        f"in total, so it can never start; lower resources.num_env_runners / num_learners / num_gpus_per_learner "
        f"or the custom resources{hint}"
    )


def check_fits(request: Mapping[str, float], *, ray_started_here: bool, wait_s: float) -> None:
    """Refuse (``ConfigError`` on ``resources``) a ``request`` that a Ray started here can never place;
    on a cluster we connected to, only log it: an autoscaler may still add the nodes, and
    ``ResourceWait`` gives up after ``wait_s``."""
    import ray

    from gradmon_ray.config import ConfigError

    problem = over_total_problem(request, ray.cluster_resources())
    if problem is None:
        return
    if ray_started_here:
        raise ConfigError("resources", problem)
    logger.warning("%s; waiting up to %g s for the cluster to grow", problem, wait_s)


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
