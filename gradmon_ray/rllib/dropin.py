"""``check_gradmon(config)``: a drop-in's settings refused on the driver, in one line, before Ray starts.

RLlib 2.60 gives a learner class no driver-side hook that sees the config: ``AlgorithmConfig.validate()``
never reads ``learner_config_dict``; callback objects are created without the config; and the learner
itself is built inside its Ray actor (``num_learners >= 1``), after the EnvRunners started, where a
``ValueError`` reaches the driver as a ``RayTaskError`` of some 50 lines.  So the check is a call on the
config, which a script makes once: ``config = check_gradmon(config)`` (docs/dropin.md).

What needs the built module (a head regex that matches no parameter) is still checked in the learner.
When such an error (or any other) escapes a script, RLlib's half-built ``LearnerGroup`` stays referenced
by the traceback until the interpreter ends, after Ray's own exit hook shut Ray down; its ``__del__`` then
calls Ray, which starts a new local Ray and the script hangs.  ``check_gradmon`` registers, once, an
exit hook that runs before Ray's (``atexit`` runs last-registered first) and drops that traceback, so the
``LearnerGroup`` is shut down while Ray still runs.
"""

from __future__ import annotations

import atexit
import gc
import sys
from typing import Any, TypeVar

from gradmon_ray.rllib.monitor import GradmonMonitor
from gradmon_ray.rllib.settings import GradmonSettings

ConfigT = TypeVar("ConfigT")


def check_gradmon(config: ConfigT) -> ConfigT:
    """``config`` itself, after checking its gradmon learner and ``learner_config_dict["gradmon"]``.

    Raises a one-line ``ValueError`` when ``config.learner_class`` is not a gradmon learner (the
    settings would be ignored) or when ``GradmonSettings.from_learner_config`` refuses the settings
    (an unknown key, a bad regex, a band that is not numbers, ...).  Starts nothing; the config is
    not changed.
    """
    learner_class = _learner_class(config)
    if not (isinstance(learner_class, type) and issubclass(learner_class, GradmonMonitor)):
        raise ValueError(
            f"config.learner_class is {getattr(learner_class, '__name__', learner_class)!r}, not a gradmon "
            "learner, so learner_config_dict['gradmon'] would be ignored: pass "
            "learner_class=with_gradmon(YourTorchLearner) (gradmon_ray.rllib.with_gradmon)"
        )
    learner_config = getattr(config, "learner_config_dict", None) or {}
    try:
        GradmonSettings.from_learner_config(learner_config, full_learner=learner_class.gradmon_full_learner)
    except ValueError as exc:
        raise ValueError(str(exc)) from None  # the user's line, not the parser's frames
    _release_failed_build_at_exit()
    return config


def _learner_class(config: Any) -> Any:
    """``config.learner_class`` (RLlib's property: the one set, else the algorithm's default)."""
    try:
        return config.learner_class
    except Exception as exc:  # an algorithm without a default learner on the new API stack
        raise ValueError(f"config has no learner class ({type(exc).__name__}: {exc})") from None


_EXIT_HOOK: list[bool] = []


def _release_failed_build_at_exit() -> None:
    """Register ``_drop_uncaught_traceback`` once (after ``import ray``, so it runs before Ray's exit hook)."""
    if not _EXIT_HOOK:
        atexit.register(_drop_uncaught_traceback)
        _EXIT_HOOK.append(True)


def _drop_uncaught_traceback() -> None:
    """Free what the script's uncaught exception keeps alive (RLlib's ``LearnerGroup`` among it) now,
    while Ray runs, rather than at interpreter teardown, where its ``__del__`` would start a new Ray."""
    if getattr(sys, "last_value", None) is None:
        return
    sys.last_type = sys.last_value = sys.last_traceback = None
    if hasattr(sys, "last_exc"):  # Python 3.12+
        sys.last_exc = None
    gc.collect()


__all__ = ["check_gradmon"]
