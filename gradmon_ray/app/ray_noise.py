"""What Ray and RLlib leave on the terminal and on disk that a gradmon run does not need.

Three things, each measured on Ray 2.60 (``docs/operations.md``, "Files a run writes"):

- **The actor restart notice.** Building the algorithm, RLlib creates its EnvRunner actors with
  ``max_restarts > 0`` and their config as an object-store reference (``EnvRunnerGroup`` does
  ``ray.put(config)``).  Ray's C++ core worker (``core_worker.cc``, Ray PR 53713) then logs, at
  ERROR level and straight to the driver's fd 2, that such an actor's restart could fail if that
  object were lost (Ray issue 53727).  RLlib keeps the reference for the algorithm's lifetime, so
  the notice asks nothing of the user; it stays in Ray's own log
  (``/tmp/ray/session_*/logs/python-core-driver-*.log``).  ``quiet_actor_creation()`` drops exactly
  that line from the terminal (``stderr_filter``), every other line passes; ``--debug`` keeps it.
- **RLlib's per-run logger directory.** An ``Algorithm`` built outside Tune is a Tune
  ``Trainable`` without storage: it creates ``~/ray_results/<timestamp><random>/`` (Ray's
  ``Trainable._setup_logdir``) and, on the new API stack, never writes into it.  RLlib 2.60 has no
  setting for it (``logger_creator``/``logger_config`` are gone); ``discard_rllib_logdir(algo)``
  removes it again when it is still empty.  A sweep trial builds its algorithm the same way,
  inside Tune's trial actor, and discards it too (``sweep.trials.run_trial``).
- **Tune's tables.** Tune's new output engine prints an experiment table at the start and a trial
  status table at the end even at ``verbose=0``; a CLI sweep sets Tune's own
  ``RAY_AIR_NEW_OUTPUT=0`` (unless set), whose legacy reporter at ``verbose=0`` prints nothing: the
  sweep's progress is gradmon's own lines (``sweep.run.TrialProgress``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from gradmon_ray.app.stderr_filter import filtered_stderr

logger = logging.getLogger(__name__)

RAY_ACTOR_RESTART_NOTICE = (
    r"core_worker\.cc:\d+: Actor with class name: '[^']*' and ID: '[0-9a-f]+' has constructor arguments "
    r"in the object store and max_restarts > 0\."
)
"""The one line ``quiet_actor_creation`` drops (as Ray 2.60 prints it; a changed wording passes through)."""

_WANTED = {"quiet": False}


def want_quiet_ray() -> None:
    """The CLI (without ``--debug``) asks for ``quiet_actor_creation`` to filter; library callers and
    tests that never call this see Ray's output unchanged."""
    _WANTED["quiet"] = True


def reset_quiet() -> None:
    """Back to the library default (Ray's output unchanged): for a process that ran the CLI in-process."""
    _WANTED["quiet"] = False


def quiet_wanted() -> bool:
    """Whether the CLI asked for Ray's noise to be filtered (``want_quiet_ray``)."""
    return _WANTED["quiet"]


def quiet_actor_creation() -> contextlib.AbstractContextManager[bool]:
    """Around ``build_algo()``: Ray's actor restart notice is dropped from stderr, if the CLI asked."""
    return filtered_stderr([RAY_ACTOR_RESTART_NOTICE]) if _WANTED["quiet"] else contextlib.nullcontext(False)


def ray_results_root() -> str:
    """Where an ``Algorithm`` outside Tune makes its logger directory (``~/ray_results``)."""
    from ray.train.constants import DEFAULT_STORAGE_PATH

    return os.path.abspath(DEFAULT_STORAGE_PATH)


def discard_rllib_logdir(algo: Any) -> bool:
    """Remove ``algo.logdir`` if it is an empty directory directly under ``ray_results_root()``
    (after ``algo.stop()``); True if it was removed.  Anything in it, or a logdir elsewhere (a Tune
    trial's), is left alone; ``~/ray_results`` itself too (another run may be creating its own)."""
    logdir = getattr(algo, "logdir", None)
    if not logdir:
        return False
    path = os.path.abspath(logdir)
    if os.path.dirname(path) != ray_results_root():
        return False
    try:
        os.rmdir(path)  # only an empty directory
    except OSError as exc:
        logger.debug("RLlib's logger directory %s kept: %s", path, exc)
        return False
    return True
