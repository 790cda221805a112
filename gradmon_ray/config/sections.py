"""The sections of a run config: pydantic models, one ``Field(description=...)`` per field.

Bounds are ``Field`` constraints; checks across fields are validators that raise
``ConfigError`` (see ``gradmon_ray.config.base`` for how errors are worded).  Band edge
sets and regularizer entries are frozen values; the other sections may be changed
in place, each assignment validated.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal, Union

from pydantic import Field, JsonValue, field_validator, model_validator

from gradmon_ray.config.band_sections import BandsSection
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


class EnvSection(ConfigModel):
    """Which environment to train on."""

    id: Text = Field(
        "gradmon/FactoredOps-v0",
        description="A registered Gymnasium/Ray Tune env name, or 'package.module:ClassName'.",
    )
    config: dict[str, JsonValue] = Field(default_factory=dict, description="Keyword config passed to the env.")


class ModelSection(ConfigModel):
    """Shape of the FactoredActorCritic RLModule."""

    trunk_hiddens: list[Width] = Field(default_factory=lambda: [128, 128], description="Shared trunk widths.")
    head_hiddens: list[Width] = Field(default_factory=list, description="Hidden widths inside each action head.")
    value_hiddens: list[Width] = Field(default_factory=list, description="Hidden widths inside the value head.")
    vf_share_layers: bool = Field(
        False,
        description="The value head reads the policy trunk (true) or its own trunk of the same widths (false: "
        "learned better on the built-in env and CartPole, docs/BENCHMARKS.md).",
    )
    activation: Literal["tanh", "relu", "silu"] = Field("tanh", description="Hidden activation.")
    head_logit_scale: dict[Text, PositiveNumber] = Field(
        default_factory=dict,
        description="Multiply a head's logits, e.g. {op: 100.0} (diagnostics: provokes an exploding head).",
    )
    head_names: Union[list[Text], None] = Field(
        None,
        description="Head names for MultiDiscrete/Discrete spaces; for a Dict space, its keys in the order "
        "watch, the plots and the report show them (the built-in envs: op first).",
    )

    @field_validator("head_names")
    @classmethod
    def _distinct_head_names(cls, names: list[str] | None) -> list[str] | None:
        if names is not None:
            if not names:
                raise ConfigError("", "must be a non-empty list of distinct head names or null, got []")
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise ConfigError("", f"must be distinct head names, got {names!r} ({repeated} repeated)")
        return names


class PPOSection(ConfigModel):
    """PPO hyperparameters (RLlib's names)."""

    lr: float = Field(3e-4, gt=0.0, description="Adam learning rate.")
    gamma: float = Field(0.99, ge=0.0, le=1.0, description="Discount factor.")
    lambda_: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda.")
    clip_param: float = Field(0.2, gt=0.0, description="PPO ratio clip.")
    vf_clip_param: float = Field(10.0, gt=0.0, description="Clip for the squared value error.")
    vf_loss_coeff: float = Field(0.5, ge=0.0, description="Weight of the value loss.")
    entropy_coeff: float = Field(0.01, ge=0.0, description="Weight of the entropy bonus.")
    use_kl_loss: bool = Field(False, description="Add the adaptive KL penalty.")
    kl_coeff: float = Field(0.2, ge=0.0, description="Initial KL coefficient.")
    kl_target: float = Field(0.01, gt=0.0, description="KL target of the adaptive coefficient.")
    train_batch_size: int = Field(1024, ge=1, description="Env steps per training iteration.")
    minibatch_size: int = Field(128, ge=1, description="SGD minibatch size.")
    num_epochs: int = Field(4, ge=1, description="Passes over each train batch.")
    grad_clip: Union[float, None] = Field(0.5, gt=0.0, description="Gradient clip (null: off).")
    grad_clip_by: Literal["global_norm", "norm", "value"] = Field("global_norm", description="Clip mode.")

    @model_validator(mode="after")
    def _minibatch_fits_the_batch(self) -> PPOSection:
        if self.minibatch_size > self.train_batch_size:
            raise ConfigError(
                "minibatch_size",
                f"must be <= ppo.train_batch_size ({self.train_batch_size}), got {self.minibatch_size}",
            )
        return self


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


class TelemetrySection(ConfigModel):
    """Gradient telemetry switches."""

    enabled: bool = Field(True, description="Per-head norms, latches and counts (off: plain PPO).")
    fused_optimizer: bool = Field(
        True, description="Fused Adam, which skips non-finite updates on the device (no host sync)."
    )
    bands: BandsSection = Field(default_factory=BandsSection, description="Health band edges of gradient norms.")


class VgsSection(ConfigModel):
    """Variance Gradient Scaler (seed 002's `vgs:` block, plus `granularity`)."""

    enabled: bool = Field(False, description="Scale gradients by their temporal variance (opt-in).")
    beta: float = Field(0.99, ge=0.0, lt=1.0, description="EMA decay per optimizer step.")
    alpha: float = Field(0.1, ge=0.0, description="Scaling strength: factor = 1 / (1 + alpha * var).")
    eps: float = Field(1e-8, gt=0.0, description="Added to the squared mean in the normalisation.")
    warmup_steps: int = Field(100, ge=0, description="Optimizer steps before scaling starts.")
    accept_old_checkpoint: bool = Field(
        False,
        description="Let restore_from take a checkpoint whose VGS state is the old spatial format (statistics reset).",
    )
    aggregation_method: Literal["p90", "mean", "weighted_mean"] = Field(
        "p90", description="How per-parameter variances become one number."
    )
    granularity: Literal["element", "tensor"] = Field(
        "element", description="Statistics per parameter element (like Adam) or per tensor."
    )
    apply_to: Literal["update", "gradient"] = Field(
        "update",
        description="Where the factor acts: the optimizer's step (update: exact under Adam and clipping) or the "
        "gradient before clipping (gradient: Adam's normalisation and a binding global-norm clip undo it).",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="Compile the per-step pass into one fused loop (auto: from 1M parameters)."
    )


class UpgdSection(ConfigModel):
    """UPGD hyperparameters (used when `optimizer: upgd`; the learning rate is `ppo.lr`)."""

    weight_decay: float = Field(0.001, ge=0.0, description="Decoupled weight decay.")
    beta_utility: float = Field(0.999, ge=0.0, lt=1.0, description="Utility EMA decay.")
    sigma: float = Field(0.001, ge=0.0, description="Perturbation noise std.")


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
    replica_check_every: int = Field(
        10, ge=0, description="Compare parameter checksums across learners every N iterations (0: off)."
    )


class HealthStopSection(ConfigModel):
    """Gradient-health early stopping (each rule off by default)."""

    dead_iterations: int = Field(
        0,
        ge=0,
        description="Stop when a head is dead (action heads: norm < 0.01) this many iterations in a row (0: off).",
    )
    exploding_iterations: int = Field(
        0,
        ge=0,
        description="Stop when a head is exploding (action heads: norm > 5) this many iterations in a row (0: off).",
    )
    nan_latch: bool = Field(False, description="Stop as soon as any head's NaN log-prob latch fires.")
    inf_latch: bool = Field(False, description="Stop as soon as any head's Inf log-prob latch fires.")
    collapse: bool = Field(
        False,
        description="Stop as soon as any head's entropy collapse latch fires (telemetry.bands.collapse).",
    )
    include_value_head: bool = Field(
        False,
        description="Also judge the value head, by its own telemetry.bands.value edges, in the dead/exploding rules "
        "and the progress line's worst head (false: action heads only).",
    )


EMBEDDED_TRACKING_URI = "sqlite:///mlflow.db"
"""Where runs go when neither the config, ``--mlflow-uri`` nor ``MLFLOW_TRACKING_URI`` say otherwise."""


def default_tracking_uri() -> str:
    """MLflow's own convention first (``MLFLOW_TRACKING_URI``; cluster.yaml sets it on every node),
    then the embedded sqlite store in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or EMBEDDED_TRACKING_URI


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
        description="Where iterations MLflow could not take are kept (replay: gradmon-ray replay FILE).",
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
