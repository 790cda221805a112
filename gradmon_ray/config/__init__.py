"""The run configuration: typed pydantic models, loaded from YAML and validated up front.

Every field has a default that runs on a laptop and a description
(``GradmonConfig.model_json_schema()`` lists them all).  ``load_config`` rejects an unknown
key, a wrong type or an impossible value with a ``ConfigError`` that names the field
(``ppo.minibatch_size``) and says what is allowed; the CLI prints that one line and exits
with status 2.  Nothing here imports torch or Ray: a regularizer's ``fn`` is resolved by
``gradmon_ray.import_paths``.

Modules: ``base`` (the section base class and how pydantic's errors become one line),
``training_sections`` (env, model, PPO, telemetry, VGS, UPGD, health_stop), ``sections`` (resources,
distributed, mlflow, and the field types the sections share), ``band_sections`` (``telemetry.bands``),
``probe_sections`` (probe, regularizers), ``yaml_io`` (YAML reading and dotted overrides).
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import Field, ValidationError, field_validator, model_validator

from gradmon_ray.config.band_sections import (
    ActionBandsSection,
    BandEdges,
    BandsSection,
    CollapseSection,
    ValueBandsSection,
)
from gradmon_ray.config.base import (
    SECTION_PATHS,
    ConfigError,
    ConfigModel,
    config_error,
    config_errors,
    describe,
    parse,
)
from gradmon_ray.config.probe_sections import ProbeSection, RegularizerEntry
from gradmon_ray.config.sections import (
    EMBEDDED_TRACKING_URI,
    DistributedSection,
    MlflowSection,
    ResourcesSection,
    Text,
    default_tracking_uri,
)
from gradmon_ray.config.training_sections import (
    EnvSection,
    HealthStopSection,
    ModelSection,
    PPOSection,
    TelemetrySection,
    UpgdSection,
    VgsSection,
)
from gradmon_ray.config.yaml_io import YamlLoader, apply_overrides, load_yaml, read_yaml_mapping

__all__ = [
    "EMBEDDED_TRACKING_URI",
    "ActionBandsSection",
    "BandEdges",
    "BandsSection",
    "CollapseSection",
    "ConfigError",
    "ConfigModel",
    "DistributedSection",
    "EnvSection",
    "GradmonConfig",
    "HealthStopSection",
    "MlflowSection",
    "ModelSection",
    "PPOSection",
    "ProbeSection",
    "RegularizerEntry",
    "ResourcesSection",
    "TelemetrySection",
    "Text",
    "UpgdSection",
    "ValueBandsSection",
    "VgsSection",
    "YamlLoader",
    "apply_overrides",
    "config_advisories",
    "config_error",
    "config_errors",
    "config_from_dict",
    "default_tracking_uri",
    "describe",
    "load_config",
    "load_yaml",
    "parse",
    "read_yaml_mapping",
    "validate_config",
]


class GradmonConfig(ConfigModel):
    """A whole gradmon-ray training run."""

    iterations: int = Field(20, ge=1, description="Training iterations.")
    seed: Union[int, None] = Field(0, ge=0, description="Seed for RLlib and the envs (null: random).")
    checkpoint_dir: Union[Text, None] = Field(
        None,
        description="Checkpoint root: each run's resumable checkpoints go to <dir>/<run id> (null: "
        "./gradmon-checkpoints); when set, RLlib's checkpoint of the run's end is also saved, to <dir>/<run id>/final "
        "(for restore_from).",
    )
    checkpoint_every: int = Field(
        5,
        ge=0,
        description="Keep a resumable checkpoint, renewed every N iterations (and at Ctrl-C), under the checkpoint "
        "root: `gradmon-ray train --resume RUN_ID` continues the run from it (0: off). Costs about 0.5% of "
        "training time at 5 (docs/checkpoints.md).",
    )
    restore_from: Union[Text, None] = Field(
        None,
        description="Start from this checkpoint (an earlier run's <checkpoint_dir>/<run id>/final, same model): "
        "weights, optimizer, telemetry and VGS state. Checked before anything starts.",
    )
    env: EnvSection = Field(default_factory=EnvSection, description=EnvSection.__doc__)
    model: ModelSection = Field(default_factory=ModelSection, description=ModelSection.__doc__)
    ppo: PPOSection = Field(default_factory=PPOSection, description=PPOSection.__doc__)
    resources: ResourcesSection = Field(default_factory=ResourcesSection, description=ResourcesSection.__doc__)
    telemetry: TelemetrySection = Field(default_factory=TelemetrySection, description=TelemetrySection.__doc__)
    optimizer: Literal["adam", "upgd"] = Field("adam", description="Optimizer.")
    upgd: UpgdSection = Field(default_factory=UpgdSection, description=UpgdSection.__doc__)
    vgs: VgsSection = Field(default_factory=VgsSection, description=VgsSection.__doc__)
    distributed: DistributedSection = Field(default_factory=DistributedSection, description=DistributedSection.__doc__)
    regularizers: list[RegularizerEntry] = Field(
        default_factory=list, description="Extra loss terms, added to the PPO loss with their weights."
    )
    probe: ProbeSection = Field(default_factory=ProbeSection, description=ProbeSection.__doc__)
    health_stop: HealthStopSection = Field(default_factory=HealthStopSection, description=HealthStopSection.__doc__)
    mlflow: MlflowSection = Field(default_factory=MlflowSection, description=MlflowSection.__doc__)

    @field_validator("regularizers")
    @classmethod
    def _distinct_regularizer_names(cls, entries: list[RegularizerEntry]) -> list[RegularizerEntry]:
        seen: set[str] = set()
        for i, entry in enumerate(entries):
            if entry.name in seen:
                raise ConfigError(f"[{i}].name", f"duplicate regularizer name {entry.name!r}")
            seen.add(entry.name)
        return entries

    @model_validator(mode="after")
    def _grad_norms_need_a_regularizer(self) -> GradmonConfig:
        if self.probe.track_grad_norms and not any(r.enabled for r in self.regularizers):
            raise ConfigError("probe.track_grad_norms", "is true but no enabled entry in regularizers")
        return self

    def to_flat_dict(self) -> dict[str, Any]:
        """``{"ppo.lr": 0.0003, ...}``: what becomes MLflow params."""
        return _flatten(self.model_dump())


def _record_section_paths(model: type[ConfigModel], prefix: str) -> None:
    for name, info in model.model_fields.items():
        inner = info.annotation
        if typing.get_origin(inner) is list:
            inner, name = typing.get_args(inner)[0], f"{name}[]"
        if isinstance(inner, type) and issubclass(inner, ConfigModel):
            SECTION_PATHS[inner] = f"{prefix}{name}"
            _record_section_paths(inner, f"{prefix}{name}.")


_record_section_paths(GradmonConfig, "")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v) and key != "env.config":
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_advisories(cfg: GradmonConfig) -> list[str]:
    """One line each for valid settings that are known to cancel out (printed at load, not errors)."""
    lines = []
    if cfg.vgs.enabled and cfg.vgs.apply_to == "gradient":
        if cfg.optimizer == "adam":
            lines.append(
                "vgs.apply_to: gradient with optimizer adam: Adam divides a slowly varying gradient factor back "
                "out, so VGS barely changes the update; vgs.apply_to: update scales the step itself"
            )
        if cfg.ppo.grad_clip is not None and cfg.ppo.grad_clip_by == "global_norm":
            lines.append(
                "vgs.apply_to: gradient with ppo.grad_clip_by: global_norm: whenever the clip binds it rescales the "
                "gradient to ppo.grad_clip and undoes the VGS factor; vgs.apply_to: update acts after clipping"
            )
    return lines


def config_from_dict(data: dict[str, Any] | None) -> GradmonConfig:
    """Build and validate a ``GradmonConfig`` from plain data (e.g. parsed YAML)."""
    return parse(GradmonConfig, data)


def validate_config(cfg: GradmonConfig) -> None:
    """Validate ``cfg`` again as a whole (checks across sections too), e.g. after changing it in place."""
    try:
        GradmonConfig.model_validate(cfg.model_dump())
    except ValidationError as exc:
        raise config_error(GradmonConfig, exc) from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> GradmonConfig:
    """Load YAML (or defaults when ``path`` is None), apply dotted ``overrides``, validate."""
    data = read_yaml_mapping(path, "--config") if path is not None else {}
    if "search_space" in data:  # the most likely mix-up: both kinds of file live in tune_configs/
        raise ConfigError(
            "--config",
            f"{path} is a sweep file (it has search_space), not a run config; run it with: gradmon-ray tune {path}",
        )
    return config_from_dict(apply_overrides(data, overrides or {}))
