"""The gradmon learner settings: ONE frozen, typed object built once from the learner config.

``GradmonSettings.from_learner_config(config.learner_config_dict)`` reads the ``"gradmon"``
entry; every key has one default here and nowhere else, unknown keys are an error (a typo
must not silently turn a feature off).  ``build_ppo_config`` writes the entry from a
``GradmonConfig``; a user of ``with_gradmon`` writes it by hand, usually just ``heads``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from gradmon_ray.rllib.fault_injection import FaultInjection
from gradmon_ray.telemetry.bands import BandSet

LEARNER_CONFIG_KEY = "gradmon"
"""Key in ``AlgorithmConfig.learner_config_dict`` holding the gradmon learner settings."""

OPTIMIZERS = ("adam", "upgd")
APPLY_TO = ("update", "gradient")
"""Where the VGS factor acts (``VGSSettings.apply_to``)."""


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class VGSSettings:
    """The Variance Gradient Scaler: off unless ``enabled``; ``kwargs`` go to ``VarianceGradientScaler``."""

    enabled: bool = False
    apply_to: str = "update"
    """``"update"``: the factor scales the optimizer's step; ``"gradient"``: the gradient, before clipping."""
    kwargs: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> VGSSettings:
        data = dict(data or {})
        data.pop("accept_old_checkpoint", None)  # checked before training (rllib.preflight)
        apply_to = str(data.pop("apply_to", "update"))
        if apply_to not in APPLY_TO:
            raise ValueError(f"gradmon.vgs.apply_to must be one of {APPLY_TO}, got {apply_to!r}")
        return cls(enabled=bool(data.pop("enabled", False)), apply_to=apply_to, kwargs=_frozen(data))


@dataclass(frozen=True)
class ProbeSettings:
    """Rank 0 hands the GradientProbe actor ``actor_name`` the batch every ``every`` iterations (0: off)."""

    actor_name: str | None = None
    every: int = 0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ProbeSettings:
        data = dict(data or {})
        every = int(data.get("every", 0))
        if every > 0 and not data.get("actor_name"):
            raise ValueError("gradmon.probe.actor_name is required when gradmon.probe.every > 0")
        return cls(actor_name=data.get("actor_name"), every=every)


@dataclass(frozen=True)
class GradmonSettings:
    """Everything a gradmon learner reads from ``learner_config_dict["gradmon"]``."""

    heads: Mapping[str, str] = field(default_factory=lambda: _frozen({}))
    """Head name -> regex over the module's ``named_parameters()`` names (when the module has
    no ``head_parameter_groups()``); the rest is the trunk."""
    telemetry: bool = True
    """Per-head norms, latches and counts (off: only VGS/probe run)."""
    report_every: int = 0
    """``update`` calls per telemetry step (0: RLlib's metrics cadence, see ``monitor``)."""
    fused_optimizer: bool = True
    """``GradmonPPOTorchLearner``: fused Adam (skips non-finite steps on the device)."""
    optimizer: str = "adam"
    """``GradmonPPOTorchLearner``: ``"adam"`` or ``"upgd"``."""
    upgd: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))
    vgs: VGSSettings = field(default_factory=VGSSettings)
    bands: BandSet = field(default_factory=BandSet)
    collective_group: str | None = None
    """Name of the learners' collective group (None: derived from the DDP rendezvous)."""
    collective_backend: str = "auto"
    reduce_telemetry: bool = True
    noise_scale: bool = True
    noise_ema_beta: float = 0.9
    replica_check_every: int = 10
    regularizers: tuple[Mapping[str, Any], ...] = ()
    """``GradmonPPOTorchLearner``: ``{"name", "fn", "weight", "enabled"}`` terms added to the loss."""
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    fault_injection: FaultInjection = field(default_factory=FaultInjection)
    """Tests only: see ``gradmon_ray.rllib.fault_injection``."""

    @classmethod
    def from_learner_config(cls, learner_config_dict: Mapping[str, Any] | None) -> GradmonSettings:
        """Parse ``learner_config_dict["gradmon"]`` (absent: every default)."""
        return cls.from_dict((learner_config_dict or {}).get(LEARNER_CONFIG_KEY))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> GradmonSettings:
        data = dict(data or {})
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"learner_config_dict['gradmon']: unknown keys {unknown}")
        heads = dict(data.get("heads") or {})
        bad = [name for name, rx in heads.items() if not isinstance(rx, str)]
        if bad:
            raise ValueError(f"learner_config_dict['gradmon']['heads']: regex of {bad} must be a string")
        optimizer = data.get("optimizer", "adam")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be 'adam' or 'upgd', got {optimizer!r}")
        simple = {k: data[k] for k in ("collective_group", "collective_backend") if data.get(k) is not None}
        return cls(
            heads=_frozen(heads),
            telemetry=bool(data.get("telemetry", True)),
            report_every=int(data.get("report_every", 0)),
            fused_optimizer=bool(data.get("fused_optimizer", True)),
            optimizer=optimizer,
            upgd=_frozen(data.get("upgd")),
            vgs=VGSSettings.from_dict(data.get("vgs")),
            bands=BandSet.from_dict(data.get("bands")),
            reduce_telemetry=bool(data.get("reduce_telemetry", True)),
            noise_scale=bool(data.get("noise_scale", True)),
            noise_ema_beta=float(data.get("noise_ema_beta", 0.9)),
            replica_check_every=int(data.get("replica_check_every", 10)),
            regularizers=tuple(_frozen(r) for r in data.get("regularizers") or ()),
            probe=ProbeSettings.from_dict(data.get("probe")),
            fault_injection=FaultInjection.from_dict(data.get("fault_injection")),
            **simple,
        )
