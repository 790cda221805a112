"""The probe's sections of a run config: the GradientProbe actor and the regularizers it tracks.

Same conventions as ``gradmon_ray.config.sections`` (one ``Field(description=...)`` per field,
``ConfigError`` from validators); regularizer entries are frozen values.
"""

from __future__ import annotations

import re
from typing import Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from gradmon_ray.config.base import ConfigError, ConfigModel
from gradmon_ray.config.module_patterns import check_module_entry
from gradmon_ray.config.sections import CustomResources, Text, check_custom_resources
from gradmon_ray.import_paths import resolve_regularizer_fn

RESERVED_REGULARIZER_NAMES = ("task", "entropy", "kl", "value", "total")
_NAME_RULE = "letters, digits, '_', '.' or '-' and not task/entropy/kl/value/total"


class RegularizerEntry(ConfigModel):
    """One regularizer the probe tracks (ADR-009): ``weight * fn(module, batch, fwd_out)``."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(
        description="Metric name of the regularizer (required; letters, digits, _ . -).",
        json_schema_extra={"allowed": _NAME_RULE},
    )
    fn: Union[Text, None] = Field(
        None,
        description="A built-in (logit_l2, uniform_prior_kl, weight_l2) or 'package.module:function' (null: name).",
    )
    weight: float = Field(1.0, description="Coefficient the regularizer enters the loss with.")
    enabled: bool = Field(True, description="Track this regularizer.")

    @field_validator("name")
    @classmethod
    def _metric_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in RESERVED_REGULARIZER_NAMES:
            raise ConfigError("", f"must be {_NAME_RULE}, got {name!r}")
        return name

    @model_validator(mode="after")
    def _fn_resolves(self) -> RegularizerEntry:
        try:  # a built-in name, or an import of 'package.module:function' (no torch, no probe here)
            resolve_regularizer_fn(self.name, self.fn)
        except ValueError as exc:
            raise ConfigError("fn", str(exc)) from None
        return self


class ProbeSection(ConfigModel):
    """The GradientProbe actor (seeds 004 and 003): bucketed, non-destructive gradient probes."""

    gradient_analysis_every: int = Field(0, ge=0, description="Probe every N training iterations (0: off).")
    num_buckets: int = Field(4, ge=1, description="Reward-variance buckets (bucket_1 = lowest).")
    group_key: Text = Field(
        "group_id", description="Key in the env's reset info that groups episodes (absent: one per group)."
    )
    num_cpus: float = Field(1.0, ge=0.0, description="CPUs reserved for the probe actor.")
    num_gpus: float = Field(0.0, ge=0.0, description="GPU (fraction) for the probe actor (0: CPU).")
    max_restarts: int = Field(3, ge=-1, description="Restarts of a crashed probe actor (-1: unlimited).")
    custom_resources: CustomResources = Field(
        default_factory=dict,
        description="Custom Ray resources the probe actor asks for, e.g. {probe_node: 1}: it only goes to nodes "
        "advertising them (a restart too).",
    )
    track_grad_norms: bool = Field(
        False, description="ADR-009: also take each regularizer's own gradient (one backward pass each)."
    )
    modules: Union[list[Text], None] = Field(
        None,
        description="Multi-agent: the module ids or glob patterns (league_*) to probe (null: every monitored "
        "module); an id no module of the run matches is reported once in the learner's log, not refused.",
    )

    @field_validator("modules")
    @classmethod
    def _module_ids(cls, modules: list[str] | None) -> list[str] | None:
        if modules is not None and not modules:
            raise ConfigError("", "must be a non-empty list of module ids or null (every module)")
        try:
            return None if modules is None else [check_module_entry(m, "module id") for m in modules]
        except ValueError as exc:
            raise ConfigError("", str(exc)) from None

    @field_validator("custom_resources")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        return check_custom_resources(resources)
