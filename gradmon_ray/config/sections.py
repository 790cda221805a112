"""The sections of a run config about where it runs and where its metrics go (resources,
distributed, mlflow), and the field types every section shares.

Pydantic models, one ``Field(description=...)`` per field.  Bounds are ``Field`` constraints;
checks across fields are validators that raise ``ConfigError`` (see ``gradmon_ray.config.base``
for how errors are worded).  Band edge sets and regularizer entries are frozen values; the other
sections may be changed in place, each assignment validated.  What is trained and how (env,
model, PPO, telemetry, VGS, UPGD, health_stop) is in ``training_sections``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, field_validator, model_validator

from gradmon_ray.config.base import ConfigError, ConfigModel

Text = Annotated[str, Field(min_length=1)]
"""A non-empty string."""
Width = Annotated[int, Field(ge=1)]
"""A layer width."""
PositiveNumber = Annotated[float, Field(gt=0.0)]
CustomResources = dict[Text, PositiveNumber]
"""Custom Ray resources an actor asks for, e.g. ``{learner_node: 1}`` (a node advertises them with
``ray start --resources``): Ray places the actor only on a node with that much left."""
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def check_custom_resources(resources: dict[str, float]) -> dict[str, float]:
    """``resources`` unchanged, or ``ConfigError`` when it names CPU, GPU or memory."""
    # Ray refuses CPU/GPU in an actor's `resources` (they have their own fields), and so does RLlib.
    builtin = sorted(set(resources) & set(_RAY_BUILTIN_RESOURCES))
    if builtin:
        raise ConfigError("", f"must name custom resources only, got {builtin}; CPUs and GPUs have their own fields")
    return resources


class ResourcesSection(ConfigModel):
    """Where things run."""

    num_env_runners: int = Field(1, ge=0, description="Remote EnvRunner actors (0: sample on the driver).")
    num_envs_per_env_runner: int = Field(1, ge=1, description="Vectorised envs per EnvRunner.")
    num_learners: int = Field(0, ge=0, description="Remote learner actors (0: learn on the driver).")
    num_gpus_per_learner: float = Field(0.0, ge=0.0, description="GPUs per learner (0: CPU).")
    ray_address: Union[Text, None] = Field(None, description="Ray cluster address (null: start local Ray).")
    num_cpus: Union[int, None] = Field(None, ge=1, description="CPUs for a local Ray (null: Ray detects).")
    env_runner_restart_delay_s: float = Field(
        5.0, ge=0.0, description="Wait before restarting a crashed EnvRunner (RLlib's own default: 60 s)."
    )
    max_env_runner_restarts: int = Field(
        1000, ge=0, description="EnvRunner restarts allowed over the run before it fails."
    )
    wait_for_resources_s: float = Field(
        600.0,
        gt=0.0,
        description="Give up (exit 1) when Ray has not placed the learners and EnvRunners after this long "
        "(what is pending is logged after 30 s).",
    )
    custom_resources_per_learner: CustomResources = Field(
        default_factory=dict,
        description="Custom Ray resources each remote learner asks for, e.g. {learner_node: 1}: learners only go "
        "to nodes advertising them (RLlib's custom_resources_per_learner; needs num_learners >= 1).",
    )
    custom_resources_per_env_runner: CustomResources = Field(
        default_factory=dict,
        description="Custom Ray resources each EnvRunner asks for, e.g. {runner_node: 1} "
        "(RLlib's custom_resources_per_env_runner; needs num_env_runners >= 1).",
    )

    @field_validator("custom_resources_per_learner", "custom_resources_per_env_runner")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        return check_custom_resources(resources)

    @model_validator(mode="after")
    def _custom_resources_have_actors(self) -> ResourcesSection:
        # Without remote learners (EnvRunners) RLlib ignores these; refuse rather than ignore them.
        for field, actors, count in (
            ("custom_resources_per_learner", "num_learners", self.num_learners),
            ("custom_resources_per_env_runner", "num_env_runners", self.num_env_runners),
        ):
            if getattr(self, field) and count == 0:
                raise ConfigError(field, f"needs {actors} >= 1 (there is no remote actor to place), got {actors} 0")
        return self

    @field_validator("num_gpus_per_learner")
    @classmethod
    def _fraction_or_whole(cls, gpus: float) -> float:
        if gpus > 1 and gpus != int(gpus):
            raise ConfigError("", f"must be a fraction <= 1 or a whole number, got {gpus!r}")
        return gpus

    @model_validator(mode="after")
    def _one_gpu_per_learner_rank(self) -> ResourcesSection:
        # Checked on an H100: two learners on one GPU die in DDP setup after ~40 s with NCCL's
        # "Duplicate GPU detected"; refuse before anything starts.
        if self.num_learners >= 2 and 0 < self.num_gpus_per_learner < 1:
            raise ConfigError(
                "num_gpus_per_learner",
                f"with {self.num_learners} learners each needs a whole GPU (NCCL cannot put two learner ranks on "
                f"one GPU), got {self.num_gpus_per_learner:g}; use 1, or 0 for CPU learners",
            )
        return self


class DistributedSection(ConfigModel):
    """How learners agree (only matters with resources.num_learners >= 2)."""

    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Ray collective backend: auto = NCCL on GPUs with cupy, else gloo."
    )
    reduce_telemetry: bool = Field(
        True, description="One packed collective per iteration (off: each learner reports its own view)."
    )
    noise_scale: bool = Field(
        True, description="Per-head gradient noise scale via a DDP comm hook (needs reduce_telemetry)."
    )
    noise_scale_one_learner: bool = Field(
        True,
        description="With one learner, the noise scale from the first epoch's minibatches against their mean "
        "(one op a minibatch of the first epoch; an approximation, docs/metrics.md).",
    )
    replica_check_every: int = Field(
        10, ge=0, description="Compare parameter checksums across learners every N iterations (0: off)."
    )
    collective_timeout_s: float = Field(
        300.0,
        ge=1.0,
        description="How long a learner waits for the others in one collective before the run stops naming "
        "what it waited for (the presence exchange, a CPU minibatch's average, the telemetry reduce, add_module).",
    )


EMBEDDED_TRACKING_URI = "sqlite:///mlflow.db"
"""Where runs go when neither the config, ``--mlflow-uri`` nor ``MLFLOW_TRACKING_URI`` say otherwise."""


def default_tracking_uri() -> str:
    """MLflow's own convention first (``MLFLOW_TRACKING_URI``; cluster.yaml sets it on every node),
    then the embedded sqlite store in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or EMBEDDED_TRACKING_URI


def in_ray_job_package(cwd: Path) -> bool:
    """``cwd`` is Ray's unpacked copy of a job's ``--working-dir``
    (``.../runtime_resources/working_dir_files/_ray_pkg_<hash>/``), which Ray deletes."""
    return "runtime_resources" in cwd.parts and "working_dir_files" in cwd.parts


def durable_job_path(directory: str, cwd: Path | None = None) -> str:
    """A directory a run keeps (``mlflow.spill_dir``, the checkpoint root) as it keeps it: a relative
    one inside a ``ray job submit`` package is taken relative to the home directory of the node running
    the job's driver instead (``~/gradmon-spill``, ``~/gradmon-checkpoints`` by default).  Why home: it
    outlives the job, ``ray stop``, Ray's session and temp directories and a reboot, it is the same
    path on every node, and the docs can name it before the job starts.  ``cwd``: default the working
    directory."""
    path = Path(directory).expanduser()
    if path.is_absolute():
        return directory
    try:
        cwd = Path.cwd() if cwd is None else cwd
    except OSError:  # the working directory was deleted: nothing to tell, leave the setting alone
        return directory
    return str(Path.home() / path) if in_ray_job_package(cwd) else directory


class MlflowSection(ConfigModel):
    """Where metrics go."""

    tracking_uri: Text = Field(
        default_factory=default_tracking_uri,
        description="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db).",
    )
    experiment: Text = Field("gradmon-ray", description="MLflow experiment name.")
    run_name: Union[Text, None] = Field(None, description="MLflow run name (null: <env>-<YYYYmmdd-HHMMSS>-<4 chars>).")
    queue_size: int = Field(1000, ge=1, description="Iterations buffered before the oldest are dropped.")
    spill_dir: Text = Field(
        "gradmon-spill",
        validate_default=True,  # a ray job's default moves out of Ray's throwaway copy too
        description="Where iterations MLflow could not take are kept (replay: gradmon-ray replay FILE); "
        "relative: to the working directory, or, in a ray job submit --working-dir job, to the home directory "
        "of the node that runs the job's driver (Ray deletes its copy of the working directory).",
    )
    plots_every: int = Field(
        10, ge=0, description="Log the gradient-health plots as artifacts every N iterations and at the end (0: off)."
    )
    offline_ok: bool = Field(
        False,
        description="Start training even when the tracking server does not answer at start: the metrics are "
        "buffered, spilled to spill_dir and delivered later (gradmon-ray replay). False: a server that does not "
        "answer within 5 s at start is an error (exit 2) before anything runs. An outage after the start is "
        "always buffered.",
    )

    @field_validator("spill_dir")
    @classmethod
    def _spill_dir_outside_a_job_package(cls, value: str) -> str:
        return durable_job_path(value)
