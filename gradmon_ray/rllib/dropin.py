"""``check_gradmon(config)``: a drop-in's settings refused on the driver, in one line, before Ray starts.

RLlib 2.60 gives a learner class no driver-side hook that sees the config: ``AlgorithmConfig.validate()``
never reads ``learner_config_dict``; callback objects are created without the config; and the learner
itself is built inside its Ray actor (``num_learners >= 1``), after the EnvRunners started, where a
``ValueError`` reaches the driver as a ``RayTaskError`` of some 50 lines.  So the check is a call on the
config, which a script makes once: ``config = check_gradmon(config)`` (docs/dropin.md).

What needs the built module (a head regex that matches no parameter, a module id) is checked on modules
built here from the config, as the learner builds them (an EnvRunner made on the driver gives the spaces,
as RLlib's local EnvRunner does; no Ray), and again in the learner.
When such an error (or any other) escapes a script, RLlib's half-built ``LearnerGroup`` stays referenced
by the traceback until the interpreter ends, after Ray's own exit hook shut Ray down; its ``__del__`` then
calls Ray, which starts a new local Ray and the script hangs.  ``check_gradmon`` registers, once, an
exit hook that runs before Ray's (``atexit`` runs last-registered first) and drops that traceback, so the
``LearnerGroup`` is shut down while Ray still runs.
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys
from typing import Any, TypeVar

from gradmon_ray.rllib.heads import latch_heads
from gradmon_ray.rllib.module_telemetry import resolve_module
from gradmon_ray.rllib.monitor import GradmonMonitor
from gradmon_ray.rllib.settings import GradmonSettings

logger = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT")


def check_gradmon(config: ConfigT) -> ConfigT:
    """``config`` itself, after checking its gradmon learner and ``learner_config_dict["gradmon"]``.

    Raises a one-line ``ValueError`` when ``config.learner_class`` is not a gradmon learner (the
    settings would be ignored), when ``GradmonSettings.from_learner_config`` refuses the settings
    (an unknown key, a bad regex, a band that is not numbers, ...), or when the config's modules,
    built here, refuse them (a head regex matching no parameter, a module id metric names cannot
    carry).  Starts no Ray; the config is not changed.
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
        settings = GradmonSettings.from_learner_config(learner_config, full_learner=learner_class.gradmon_full_learner)
        _check_modules_built_here(config, settings)
    except ValueError as exc:
        raise ValueError(str(exc)) from None  # the user's line, not the parser's frames
    _release_failed_build_at_exit()
    return config


def _check_modules_built_here(config: Any, settings: GradmonSettings) -> None:
    """The config's modules, built on the driver as the learner builds them (spaces from an EnvRunner
    made here, no Ray), through the learner's own checks: module ids and every monitored module's heads
    (a regex that matches nothing).  An id the settings name that no module has is one warning line
    (a league adds modules later).  Skipped, silently, where the env cannot be made on the driver."""
    modules = _modules_built_here(config)
    if modules is None:
        return
    settings.check_modules(list(modules))
    if note := settings.unseen_note(list(modules)):
        logger.warning(note)
    for mid, module in modules.items():
        if settings.monitors(mid):
            resolve_module(mid, module, settings, latch_heads(module))


def _modules_built_here(config: Any) -> dict[str, Any] | None:
    """``{module_id: RLModule}`` as the learner will build them, or None where the env cannot be made here."""
    from ray.rllib.env.multi_agent_env_runner import MultiAgentEnvRunner
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    runner_class = config.env_runner_cls or (MultiAgentEnvRunner if config.is_multi_agent else SingleAgentEnvRunner)
    try:
        runner = runner_class(config=config)
        try:
            spaces = runner.get_spaces()
        finally:
            runner.stop()
        multi = config.get_multi_rl_module_spec(spaces=spaces, inference_only=False).build()
    except Exception:  # no env yet, or one only its EnvRunners can make: the learner checks there
        return None
    return {str(mid): multi[mid] for mid in multi.keys()}  # noqa: SIM118 (a MultiRLModule iterates otherwise)


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
