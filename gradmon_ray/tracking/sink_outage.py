"""What the MLflow sink tells the user about an outage: one line when it starts, at most one every
``REMINDER_S`` while it lasts, one when it ends, and none from the retries themselves.

Before, every failed retry logged MLflow's whole exception (urllib3's text, ~420 characters) and a
"retrying in 30.0s" that the shutdown wait, which retries every second, repeated seven times; and
MLflow's HTTP client logged urllib3's own ``Retrying (Retry(total=6, ...)) after connection broken
by ...`` for every retry of every request.  Now the cause is named in a few words
(``outage_cause``: "connection refused"), and what urllib3 and MLflow's SQL store log on the sink's
thread (a retry notice, an error and its traceback per failed try) is lowered to DEBUG
(``quiet_mlflow_retries``): shown where the user turned DEBUG on for that logger, nowhere else.
Nothing else changes: the sink retries and spills exactly as before.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable

from gradmon_ray.tracking.redact import redact_uri, short

REMINDER_S = 60.0
"""At most one "still unavailable" line this often (seconds) while an outage lasts."""
CAUSE_CHARS = 120
"""The longest cause shown (masked, then cut: ``redact.short``)."""

_CAUSES: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], str], ...] = (
    (ConnectionRefusedError, "connection refused"),
    (socket.gaierror, "host not found"),
    (TimeoutError, "timed out"),  # socket.timeout too
    ((ConnectionResetError, ConnectionAbortedError, BrokenPipeError), "connection reset"),  # RemoteDisconnected too
)
"""The operating system's errors at the bottom of MLflow's (requests', urllib3's) chain, in words."""


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes, outermost first (MLflow wraps requests' error, which wraps urllib3's...)."""
    seen: list[BaseException] = []
    node: BaseException | None = exc
    while node is not None and node not in seen and len(seen) < 20:
        seen.append(node)
        node = node.__cause__ or node.__context__
    return seen


def outage_cause(exc: BaseException, secrets: Iterable[str] = ()) -> str:
    """Why a write to MLflow failed, in a few words: "connection refused", "host not found", "timed
    out", "connection reset" (by the OS error in the chain, not by any library's wording), else the
    innermost error's first line, masked and cut (an HTTP error: MLflow's text names the status)."""
    chain = _chain(exc)
    for kinds, words in _CAUSES:
        if any(isinstance(error, kinds) for error in chain):
            return words
    inner = chain[-1]
    return short(f"{type(inner).__name__}: {inner}", CAUSE_CHARS, secrets, one_line=True)


class OutageLog:
    """The sink writer's account of one outage after another (its thread only; ``cause`` may be read
    by others).  ``failed`` after each failed try, ``delivered`` after each success."""

    def __init__(self, tracking_uri: str, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._shown = redact_uri(tracking_uri)
        self._logger = logger
        self._clock = clock
        self.started_at: float | None = None  # None: no outage now
        self.tries = 0
        self.cause: str | None = None  # the last failure's cause, kept after the outage ends
        self._last_line_at = 0.0

    @property
    def active(self) -> bool:
        return self.started_at is not None

    def failed(self, cause: str, *, closing: bool, waiting: int, kept_in: str | None) -> None:
        """A try failed: the outage's first line, or a reminder once ``REMINDER_S`` has passed since the
        last line; none while closing (``close`` says once what it waits for)."""
        now = self._clock()
        self.cause = cause
        self.tries += 1
        if self.started_at is None:
            self.started_at, self.tries = now, 1
            if not closing:
                self._last_line_at = now
                where = f"memory and in {kept_in}" if kept_in else "memory"
                self._logger.warning(
                    "gradmon MLflow sink: MLflow at %s unavailable (%s); training goes on, the iterations wait "
                    "in %s until it is back",
                    self._shown,
                    cause,
                    where,
                )
            return
        if closing or now - self._last_line_at < REMINDER_S:
            return
        self._last_line_at = now
        self._logger.warning(
            "gradmon MLflow sink: MLflow at %s still unavailable after %.0f s (%d tries, last: %s); "
            "%d iterations waiting",
            self._shown,
            now - self.started_at,
            self.tries,
            cause,
            waiting,
        )

    def delivered(self, iterations: int, *, only_in_spill: int = 0, spill: str | None = None) -> None:
        """A try succeeded: after an outage, its one closing line (how long, and what MLflow then took)."""
        if self.started_at is None:
            return
        took = self._clock() - self.started_at
        self.started_at, self.tries = None, 0
        rest = f"; {only_in_spill} iterations only in {spill}: gradmon-ray replay {spill}" if only_in_spill else ""
        self._logger.warning(
            "gradmon MLflow sink: MLflow at %s back after %.0f s; %d iterations delivered%s",
            self._shown,
            took,
            iterations,
            rest,
        )


SINK_THREAD_NAME = "gradmon-mlflow-sink"
"""The sink writer's thread: what MLflow and urllib3 log on it is about the sink's own tries."""
_NOISY_LOGGERS = ("urllib3.connectionpool", "mlflow.store.db.utils")


class _RetryNoise(logging.Filter):
    """A warning or error that urllib3 or MLflow's SQL store logs on the sink's own thread, lowered to
    DEBUG: kept where DEBUG is on for its logger, dropped elsewhere.  Each says that one try of the
    sink failed (urllib3's ``Retrying (...) after connection broken by ...`` per retry inside MLflow's
    client, the SQL store's error and traceback per failed statement); the sink retries, and its
    outage lines say it once.  Other threads' records (the user's own MLflow calls) are left alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.threadName != SINK_THREAD_NAME:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_mlflow_retries() -> None:
    """Lower what MLflow and urllib3 log on the sink's thread to DEBUG, in this process (idempotent)."""
    for name in _NOISY_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, _RetryNoise) for f in target.filters):
            target.addFilter(_RetryNoise())
