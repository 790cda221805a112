"""Ctrl-C during training: finish the iteration, checkpoint it, then stop (a second Ctrl-C stops at once).

A ``KeyboardInterrupt`` raised in the middle of ``algo.train()`` leaves the learner half-way
through its minibatches: nothing consistent to save, and a resume would go back to the last
periodic checkpoint.  So while a run with resumable checkpoints trains, the first SIGINT only
asks to stop: ``run_training`` ends the iteration, saves a checkpoint of it and raises
``TrainingInterrupted`` (a ``KeyboardInterrupt``, so the run is ``KILLED`` in MLflow and the CLI
exits 130).  A second SIGINT raises ``KeyboardInterrupt`` where the program is, as before.
Ray's own processes block SIGINT (a terminal's Ctrl-C reaches only this process).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

NOTICE = "\ngradmon-ray: Ctrl-C: stopping after this iteration, once it is checkpointed (Ctrl-C again to stop now)\n"


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C ended a ``run_training`` run; ``outcome`` (a ``TrainingOutcome``) says what it left."""

    def __init__(self, outcome: Any) -> None:
        super().__init__("training interrupted")
        self.outcome = outcome


class GracefulInterrupt:
    """While active (``with``): the first SIGINT sets ``requested`` (and says so on stderr), the
    second raises ``KeyboardInterrupt``.  Does nothing outside the main thread, or when someone
    else's SIGINT handler is installed (an embedding program's own)."""

    def __init__(self, notice: str = NOTICE) -> None:
        self.requested = False
        self._notice = notice.encode()
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        with contextlib.suppress(OSError):  # not print(): the main thread may be inside a print to stderr
            os.write(2, self._notice)

    def __enter__(self) -> GracefulInterrupt:
        if threading.current_thread() is threading.main_thread():
            current = signal.getsignal(signal.SIGINT)
            if current is signal.default_int_handler:
                self._previous = signal.signal(signal.SIGINT, self._handle)
                self._installed = True
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
