"""Ctrl-C or SIGTERM during training: finish the iteration, checkpoint it, then stop (a second one stops at once).

A ``KeyboardInterrupt`` raised in the middle of ``algo.train()`` leaves the learner half-way
through its minibatches: nothing consistent to save, and a resume would go back to the last
periodic checkpoint.  So while a run with resumable checkpoints trains, the first SIGINT or
SIGTERM (what ``timeout``, Kubernetes and ``ray job stop`` send) only asks to stop:
``run_training`` ends the iteration, saves a checkpoint of it and raises ``TrainingInterrupted``
(a ``KeyboardInterrupt``, so the run is ``KILLED`` in MLflow, the resume command is printed and
the CLI exits 130).  A second signal raises ``KeyboardInterrupt`` where the program is.  Without
checkpoints there is nothing to wait for: SIGTERM raises ``KeyboardInterrupt`` at once, as Ctrl-C
does, so the run still ends ``KILLED`` instead of staying ``RUNNING`` in MLflow.  Ray's own
processes block SIGINT (a terminal's Ctrl-C reaches only this process).

**While the run ends** (the probe flushed, the algorithm stopped, the sink closed: ``EndingGuard``), a
signal never stops the process half-way, which left the run ``RUNNING`` with its status lost: it
cuts the slow step under way short and skips the others up to the sink's close, and a run that
would have ended ``FINISHED`` ends ``KILLED``.  The close itself is not cut (its own timeout bounds
it, and it keeps on disk what MLflow has not taken); a signal during it or after it lets the run
keep the status it is ending with.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, TypeVar

from gradmon_ray.compat import is_rays_driver_sigterm_handler

T = TypeVar("T")

NOTICE = "\ngradmon-ray: {signal}: stopping after this iteration, once it is checkpointed ({again} to stop now)\n"
AGAIN = {signal.SIGINT: "Ctrl-C again", signal.SIGTERM: "send SIGTERM again"}
DEFAULT_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
"""The handler each signal must still have for us to take it over (not an embedding program's own);
for SIGTERM also the one ``ray.init`` installs in a driver (``sys.exit(15)``: the run would end FAILED)."""


def _default(sig: signal.Signals) -> bool:
    handler = signal.getsignal(sig)
    return handler is DEFAULT_HANDLERS[sig] or (sig == signal.SIGTERM and is_rays_driver_sigterm_handler(handler))


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM ended a ``run_training`` run; ``outcome`` (a ``TrainingOutcome``) says what it left."""

    def __init__(self, outcome: Any) -> None:
        super().__init__("training interrupted")
        self.outcome = outcome


class GracefulInterrupt:
    """While active (``with``), SIGINT and SIGTERM.  ``graceful``: the first sets ``requested`` (and
    says so on stderr), the second raises ``KeyboardInterrupt``; otherwise SIGTERM raises it at once
    (SIGINT already does).  Does nothing outside the main thread, and leaves alone a signal whose
    handler is someone else's (an embedding program's own)."""

    def __init__(self, *, graceful: bool = True) -> None:
        self.graceful = graceful
        self.requested = False
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested or not self.graceful:
            raise KeyboardInterrupt
        self.requested = True
        sig = signal.Signals(signum)
        notice = NOTICE.format(signal="Ctrl-C" if sig == signal.SIGINT else sig.name, again=AGAIN[sig])
        with contextlib.suppress(OSError):  # not print(): the main thread may be inside a print to stderr
            os.write(2, notice.encode())

    def __enter__(self) -> GracefulInterrupt:
        _install(self._previous, self._handle, [s for s in DEFAULT_HANDLERS if self.graceful or s == signal.SIGTERM])
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        _restore(self._previous)


class EndingGuard:
    """While active (``with``, main thread only), SIGINT and SIGTERM (with their default handlers, or
    Ray's) are recorded in ``signalled`` instead of stopping the process; inside ``cut_short`` the
    first one also ends the step under way (a ``KeyboardInterrupt`` there, caught)."""

    def __init__(self) -> None:
        self.signalled: signal.Signals | None = None
        self._cuttable = False
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = signal.Signals(signum)
        if self._cuttable:
            self._cuttable = False  # one step cut per signal; none once the step is over
            raise KeyboardInterrupt

    def cut_short(self, step: Callable[[], T], default: T) -> T:
        """``step()``, or ``default`` when a signal came before it (skipped) or during it (cut short)."""
        if self.signalled is not None:
            return default
        try:
            try:
                self._cuttable = True
                return step()
            finally:
                self._cuttable = False
        except KeyboardInterrupt:
            if self.signalled is None:  # not ours: a KeyboardInterrupt the step raised itself
                raise
            return default

    def __enter__(self) -> EndingGuard:
        _install(self._previous, self._handle, list(DEFAULT_HANDLERS))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        _restore(self._previous)


def _install(previous: dict[signal.Signals, Any], handler: Callable[..., None], sigs: list[signal.Signals]) -> None:
    """``handler`` for each of ``sigs`` that still has its default handler (or Ray's), the old ones kept
    in ``previous``; only in the main thread (Python's rule for ``signal.signal``)."""
    if threading.current_thread() is threading.main_thread():
        for sig in sigs:
            if _default(sig):
                previous[sig] = signal.signal(sig, handler)


def _restore(previous: dict[signal.Signals, Any]) -> None:
    """Put back the handlers ``_install`` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    previous.clear()
