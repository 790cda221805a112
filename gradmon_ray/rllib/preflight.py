"""Checks that need the env and the model but not Ray or MLflow: run before either starts.

A config can be well-formed and still not fit: head names that are not in the env's action
space, an action space the model does not support, an env that cannot be created, or a
``restore_from`` checkpoint of another model.  Found here, each is a ``ConfigError`` (exit 2
from the CLI) before a Ray worker starts or an MLflow run is created, so a bad input never
leaves a half-made run behind.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from gradmon_ray.config import ConfigError, GradmonConfig
from gradmon_ray.rllib.module import ModelConfigError
from gradmon_ray.tracking.redact import short
from gradmon_ray.vgs.scaler import OLD_CHECKPOINT_WARNING

LEARNER_SUBDIR = Path("learner_group") / "learner"
"""Where an RLlib Algorithm checkpoint keeps the learner's state."""


def preflight(cfg: GradmonConfig) -> None:
    """Check what can be checked before Ray or MLflow start: the local MLflow store, the GPUs
    a local Ray would need, the env (built on an RLlib EnvRunner, as training does), the
    model, and ``restore_from``."""
    from gradmon_ray.rllib.local_learner import module_spaces
    from gradmon_ray.tracking.store_check import ephemeral_store_problem, local_store_problem

    uri = cfg.mlflow.tracking_uri
    problem = ephemeral_store_problem(uri, Path.cwd()) or local_store_problem(uri, must_exist=False)
    if problem:
        raise ConfigError("mlflow.tracking_uri", problem)
    check_local_gpus(cfg)

    try:
        module_spaces(cfg)  # creates the env and the RLModule(s) exactly as every EnvRunner will
    except (ConfigError, KeyboardInterrupt):
        raise
    except ModelConfigError as exc:
        message = str(exc)
        field, _, rest = message.partition(" ")
        if field.startswith("model.") and rest:  # the message names the field itself
            raise ConfigError(field.rstrip(":"), rest) from None
        raise ConfigError("model", message) from None
    except Exception as exc:  # the user's env failed to construct
        raise ConfigError("env", f"cannot create env {cfg.env.id!r}: {type(exc).__name__}: {exc}") from None
    if cfg.restore_from:
        check_restore_point(cfg)


def check_local_gpus(cfg: GradmonConfig, visible: int | None = None) -> None:
    """A local Ray (no ``resources.ray_address``) cannot give learners GPUs this machine lacks.

    ``visible``: the GPUs to assume (default: what torch sees).  On a cluster the GPUs are the
    cluster's business; the driver's machine may have none.
    """
    res = cfg.resources
    if res.num_gpus_per_learner <= 0 or res.ray_address or os.environ.get("RAY_ADDRESS"):
        return
    import torch

    have = torch.cuda.device_count() if visible is None else visible
    learners = max(1, res.num_learners)
    need = learners * res.num_gpus_per_learner
    if have < need:
        raise ConfigError(
            "resources.num_gpus_per_learner",
            f"{learners} learner(s) x {res.num_gpus_per_learner:g} GPU need {need:g} GPU(s) on this machine "
            f"(local Ray), it has {have}; use 0 for CPU learners or resources.ray_address for a cluster with GPUs",
        )


def check_restore_point(cfg: GradmonConfig) -> None:
    """Restore ``cfg.restore_from``'s learner state into a throwaway learner built from ``cfg``.

    RLlib's own loader does the reading; a checkpoint of another model (tensor shapes, head
    names, VGS parameter layout) or one that is not an RLlib algorithm checkpoint is refused.
    An old (spatial) VGS state is refused unless ``vgs.accept_old_checkpoint``: it would
    silently restart the VGS statistics of a run the user means to continue.
    """
    from gradmon_ray.rllib.local_learner import build_local_learner

    path = Path(cfg.restore_from or "")
    if not path.is_dir():
        raise ConfigError("restore_from", f"no such checkpoint directory: {path}")
    if not (path / "rllib_checkpoint.json").is_file() or not (path / LEARNER_SUBDIR).is_dir():
        raise ConfigError(
            "restore_from",
            f"{path} is not an RLlib algorithm checkpoint (no rllib_checkpoint.json and {LEARNER_SUBDIR})",
        )
    learner = build_local_learner(cfg)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            learner.restore_from_path(path / LEARNER_SUBDIR)
    except Exception as exc:
        raise ConfigError("restore_from", f"{path} does not fit this config's model: {_first_line(exc)}") from None
    finally:
        learner.shutdown()
    old_vgs = any(OLD_CHECKPOINT_WARNING in str(w.message) for w in caught)
    if old_vgs and cfg.vgs.enabled and not cfg.vgs.accept_old_checkpoint:
        raise ConfigError(
            "restore_from",
            f"{path} holds an old-format (spatial) VGS state; restoring it resets the VGS statistics. "
            "Set vgs.accept_old_checkpoint: true to accept that",
        )


def _first_line(exc: BaseException) -> str:
    """The informative line of an error: torch's state-dict errors start with a generic header."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    line = lines[1] if lines[0].startswith("Error(s) in loading") and len(lines) > 1 else lines[0]
    return short(line, 300)  # masked, then cut
