"""What Ray can give this run: is the cluster there, can it ever hold the run, and the wait while it cannot yet.

Three checks, in the order a run meets them:

- ``ray_address_problem``: an address nothing answers at is refused at once (``ray.init`` would
  retry silently until Ctrl-C).
- ``over_total_problem``: a Ray that *this run started* (a local one) never grows, so a request
  larger than its total resources can never be placed: refused (exit 2) before an MLflow run or
  store exists.  A cluster we only connect to may autoscale (Ray has no public API for the
  autoscaler's maximum), so there a request over today's total is logged and waited for.
- ``ResourceWait``: building the algorithm blocks while Ray has no room for its learner and
  EnvRunner actors.  A watcher thread polls what is free: when part of the request is neither
  placed yet (free at the start minus free now) nor free now (``unplaced``), Ray really is short
  of room; after ``report_after_s`` of that it logs one line with what the run asks for and what
  the cluster has, and after ``give_up_after_s`` it interrupts the main thread, which the caller
  turns into ``ResourceWaitTimeout`` (exit 1 from the CLI).  A build that is only slow (a loaded
  machine, its actors placed or placeable) is never reported or given up on.
"""

from __future__ import annotations

import _thread
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
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


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(9)
"""HTTP/2's client preface and an empty SETTINGS frame: every gRPC server (Ray's GCS and its Ray Client
server are) answers with a SETTINGS frame of its own before anything else (RFC 9113, 3.4)."""
_SETTINGS_FRAME_TYPE = 0x04


def ray_address_problem(address: str | None, timeout_s: float = 15.0) -> str | None:
    """Why no Ray cluster can be reached at Ray ``address`` (None: a gRPC server answered, or no address).

    The TCP port is tried, then HTTP/2's handshake, which Ray's GCS (and Ray Client) server answers
    at once: a refused connection, an unknown host or a server that answers something else (a web
    server, a dashboard port) is final at once; silence is retried until ``timeout_s``.  ``ray.init``
    itself would retry for minutes, with a warning every few seconds.
    """
    target = _host_port(address) if address else None
    if target is None:
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            answer = _http2_answer(target, timeout=max(0.1, min(remaining, 3.0)))
            if len(answer) >= 9 and answer[3] == _SETTINGS_FRAME_TYPE:
                return None
            reason = (
                f"{target[0]}:{target[1]} answers, but not as a Ray cluster does (no gRPC); give the head's GCS "
                f"address (host:{GCS_PORT} by default) or ray://host:{CLIENT_PORT}"
            )
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


def _http2_answer(target: tuple[str, int], timeout: float) -> bytes:
    """The first bytes the server at ``target`` sends after HTTP/2's preface (b"": it closed at once)."""
    with socket.create_connection(target, timeout=timeout) as conn:
        conn.sendall(HTTP2_PREFACE)
        return conn.recv(64)


def over_total_problem(request: Mapping[str, float], total: Mapping[str, float]) -> str | None:
    """Why ``request`` can never be placed on a Ray whose total resources are ``total``, in one line
    (None: it fits the total, even if not what is free now)."""
    short = sorted(k for k, v in request.items() if v > total.get(k, 0.0) + 1e-9)
    if not short:
        return None
    hint = ", or raise resources.num_cpus (a local Ray's CPUs; may exceed the machine's)" if "CPU" in short else ""
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


def unplaced(
    request: Mapping[str, float], free_at_start: Mapping[str, float], free_now: Mapping[str, float]
) -> dict[str, float]:
    """What of ``request`` Ray cannot place now: per resource, the part not yet taken since the start
    (``free_at_start`` minus ``free_now``, at most the request) where it is more than ``free_now``.
    Empty: the run's actors are placed, or there is room for the rest (Ray is still starting them).
    ``ray.available_resources()`` leaves out a resource with nothing free: it counts as 0."""
    short = {}
    for key, want in request.items():
        now = free_now.get(key, 0.0)
        placed = min(want, max(0.0, free_at_start.get(key, 0.0) - now))
        if want - placed > now + 1e-9:
            short[key] = want - placed
    return short


def _ray_free() -> Mapping[str, float]:
    import ray

    return ray.available_resources()


def _ray_total() -> Mapping[str, float]:
    import ray

    return ray.cluster_resources()


class ResourceWait:
    """Context manager around the blocking build (see the module docstring).  ``free`` and ``total``:
    the cluster's free and total resources (default: Ray's); ``poll_s``: how often ``free`` is read."""

    def __init__(
        self,
        cfg: GradmonConfig,
        *,
        report_after_s: float = 30.0,
        poll_s: float = 2.0,
        free: Callable[[], Mapping[str, float]] = _ray_free,
        total: Callable[[], Mapping[str, float]] = _ray_total,
    ) -> None:
        self._request = requested_resources(cfg)
        self._give_up_after_s = cfg.resources.wait_for_resources_s
        self._report_after_s = min(report_after_s, self._give_up_after_s / 2)
        self._poll_s = poll_s
        self._free, self._total = free, total
        self._watcher: threading.Thread | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()  # the give-up decision and the end of the wait exclude each other
        self.gave_up = False
        self.reported = False
        self.message = ""

    def _status(self, free: Mapping[str, float], short: Mapping[str, float]) -> str:
        keys = sorted(self._request)
        return (
            f"this run asks for {_describe(self._request, keys)}, of which {_describe(short, sorted(short))} is not "
            f"placed yet; the cluster has {_describe(self._total(), keys)} in total, {_describe(free, keys)} free"
        )

    def _watch(self, free_at_start: Mapping[str, float]) -> None:
        """Poll until the build ends: report, then give up, after that long *short* of room."""
        fine_at = time.monotonic()  # the last time the rest of the request had room (the start: nothing asked yet)
        while not self._done.wait(self._poll_s):
            try:
                free = self._free()
            except Exception:  # Ray going away under a build that failed: nothing left to watch
                return
            short = unplaced(self._request, free_at_start, free)
            if not short:
                fine_at = time.monotonic()
                continue
            waited = time.monotonic() - fine_at
            if waited >= self._give_up_after_s:
                self._give_up(self._status(free, short))
                return
            if waited >= self._report_after_s and not self.reported and not self._done.is_set():
                self.reported = True
                logger.warning(
                    "still waiting for Ray to place the learners and EnvRunners after %.0f s: %s",
                    waited,
                    self._status(free, short),
                )

    def _give_up(self, status: str) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self.gave_up = True
            self.message = (
                f"gave up after {self._give_up_after_s:g} s waiting for Ray to place the run's actors "
                f"(resources.wait_for_resources_s): {status}"
            )
            _thread.interrupt_main()  # the build blocks the main thread; KeyboardInterrupt unblocks it

    def __enter__(self) -> ResourceWait:
        # The give-up raises KeyboardInterrupt in the main thread through Python's SIGINT handler: not
        # one that only asks to stop after the iteration (run_training's), nor SIGINT ignored (a
        # backgrounded process, an xdist worker), where interrupt_main does nothing and the wait never ends.
        self._sigint = None
        if threading.current_thread() is threading.main_thread():
            self._sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
        # Read before the build creates any actor: what the run takes from here on is its own placement.
        self._watcher = threading.Thread(target=self._watch, args=(dict(self._free()),), daemon=True)
        self._watcher.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with self._lock:
            self._done.set()
        if self._sigint is not None:
            signal.signal(signal.SIGINT, self._sigint)
        if self.gave_up and exc_type is KeyboardInterrupt:
            raise ResourceWaitTimeout(self.message) from None
