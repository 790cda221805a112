"""The sections of a run config about what is trained and how: the env, the model, PPO, the
gradient telemetry, VGS, UPGD and gradient-health early stopping.

Same conventions as ``gradmon_ray.config.sections`` (one ``Field(description=...)`` per field,
bounds as ``Field`` constraints, ``ConfigError`` from validators); where it runs and where its
metrics go (resources, distributed, mlflow) are in ``sections``.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import Field, JsonValue, field_validator, model_validator

from gradmon_ray.config.band_sections import BandsSection
from gradmon_ray.config.base import ConfigError, ConfigModel
from gradmon_ray.config.sections import PositiveNumber, Text, Width


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


class TelemetrySection(ConfigModel):
    """Gradient telemetry switches."""

    enabled: bool = Field(True, description="Per-head norms, latches and counts (off: plain PPO).")
    fused_optimizer: bool = Field(
        True, description="Fused Adam, which skips non-finite updates on the device (no host sync)."
    )
    bands: BandsSection = Field(default_factory=BandsSection, description="Health band edges of gradient norms.")
    shared_gradients_every: int = Field(
        10,
        ge=0,
        description="Every N iterations, each module's gradient on parameters modules share, and their cosines "
        "(several modules; 0: off).",
    )


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
    spiking_iterations: int = Field(
        0,
        ge=0,
        description="Stop when a head is spiking (a calm mean norm, but one minibatch above the exploding edge) "
        "this many iterations in a row (0: off).",
    )
    nan_latch: bool = Field(False, description="Stop as soon as any head's NaN log-prob latch fires.")
    inf_latch: bool = Field(False, description="Stop as soon as any head's Inf log-prob latch fires.")
    collapse: bool = Field(
        False,
        description="Stop as soon as any head's entropy collapse latch fires (telemetry.bands.collapse).",
    )
    reproduced_nonfinite: bool = Field(
        False,
        description="Stop as soon as a NaN/Inf gradient reproduces when gradmon re-runs its minibatch on a copy "
        "(bad data or weights: it will happen again; a one-off fault does not stop).",
    )
    include_value_head: bool = Field(
        False,
        description="Also judge the value head, by its own telemetry.bands.value edges, in the streak rules "
        "and the progress line's worst head (false: action heads only).",
    )
