"""The gradmon learner settings: ONE frozen, typed object built once from the learner config.

``GradmonSettings.from_learner_config(config.learner_config_dict)`` reads the ``"gradmon"``
entry; every key has one default here and nowhere else.  Nothing is silently ignored: an
unknown key, a key the learner in use does not implement (``with_gradmon`` learners keep their
own optimizer and loss) and a value of the wrong type are each a one-line ``ValueError`` that
names the key and what is allowed.  ``build_ppo_config`` writes the entry from a
``GradmonConfig``; a user of ``with_gradmon`` writes it by hand, usually just ``heads``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from gradmon_ray.config import RegularizerEntry
from gradmon_ray.optim.upgd import UPGD
from gradmon_ray.rllib.fault_injection import FaultInjection
from gradmon_ray.telemetry.bands import BandSet, CollapseBand, HealthBands
from gradmon_ray.vgs.scaler import VarianceGradientScaler

LEARNER_CONFIG_KEY = "gradmon"
"""Key in ``AlgorithmConfig.learner_config_dict`` holding the gradmon learner settings."""

OPTIMIZERS = ("adam", "upgd")
APPLY_TO = ("update", "gradient")
"""Where the VGS factor acts (``VGSSettings.apply_to``)."""


WHERE = f"learner_config_dict[{LEARNER_CONFIG_KEY!r}]"


def where(key: str) -> str:
    """The place of a top-level key, as error messages name it."""
    return f"{WHERE}[{key!r}]"


def mapping(value: Any, at: str) -> dict[str, Any]:
    """``value`` as a plain dict (None: empty); anything else is an error naming ``at``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{at} must be a mapping (dict), got {type(value).__name__} {value!r}")
    return dict(value)


def check_keys(data: dict[str, Any], allowed: Collection[str], at: str) -> dict[str, Any]:
    """``data`` unchanged if every key is allowed; else one line listing the unknown and the allowed keys."""
    unknown = sorted(map(str, set(data) - set(allowed)))
    if unknown:
        raise ValueError(f"{at}: unknown keys {unknown}; allowed: {sorted(allowed)}")
    return data


_KINDS: Mapping[str, tuple[type, ...]] = MappingProxyType(
    {"bool": (bool,), "int": (int,), "number": (int, float), "str": (str,)}
)


def typed(value: Any, kind: str, at: str, *, minimum: int | None = None, none_ok: bool = False) -> Any:
    """``value`` if it is a ``kind`` (bool, int, number, str) and >= ``minimum`` (None too with ``none_ok``);
    a bool is never an int or a number here (``"false"`` or 1 for a bool would silently mean something else)."""
    if none_ok and value is None:
        return None
    if (
        not isinstance(value, _KINDS[kind])
        or (kind != "bool" and isinstance(value, bool))
        or (minimum is not None and value < minimum)
    ):
        expected = ("an " if kind == "int" else "a ") + kind + (f" >= {minimum}" if minimum is not None else "")
        raise ValueError(
            f"{at} must be {expected}{' or None' if none_ok else ''}, got {type(value).__name__} {value!r}"
        )
    return value


_OWN_OPTIMIZER = (
    "with_gradmon(...) keeps your learner's optimizer: override configure_optimizers_for_module in your "
    "learner, or use learner_class=gradmon_ray.rllib.GradmonPPOTorchLearner"
)
_OWN_LOSS = "with_gradmon(...) keeps your learner's loss: use learner_class=gradmon_ray.rllib.GradmonPPOTorchLearner"
FULL_LEARNER_KEYS: Mapping[str, str] = MappingProxyType(
    {
        "optimizer": _OWN_OPTIMIZER,
        "fused_optimizer": _OWN_OPTIMIZER,
        "upgd": _OWN_OPTIMIZER,
        "regularizers": _OWN_LOSS,
        "probe": _OWN_LOSS,
    }
)
"""Keys only ``GradmonPPOTorchLearner`` implements, with what a ``with_gradmon`` user does instead."""


def _frozen(data: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(data or {}))


def _keywords(fn: Any, *passed: str) -> frozenset[str]:
    """``fn``'s parameter names less those the learner ``passed`` itself (read from its signature: never a
    second list to keep in step with ``VarianceGradientScaler`` or ``UPGD``)."""
    return frozenset(inspect.signature(fn).parameters) - set(passed)


@dataclass(frozen=True)
class VGSSettings:
    """The Variance Gradient Scaler: off unless ``enabled``; ``kwargs`` go to ``VarianceGradientScaler``."""

    enabled: bool = False
    apply_to: str = "update"
    """``"update"``: the factor scales the optimizer's step; ``"gradient"``: the gradient, before clipping."""
    kwargs: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, at: str = where("vgs")) -> VGSSettings:
        """Parse the ``vgs`` section (``at``: its place, for error messages)."""
        data = mapping(data, at)
        check_keys(data, {"apply_to", "accept_old_checkpoint"} | _keywords(VarianceGradientScaler, "parameters"), at)
        data.pop("accept_old_checkpoint", None)  # checked before training (rllib.preflight)
        apply_to = str(data.pop("apply_to", "update"))
        if apply_to not in APPLY_TO:
            raise ValueError(f"{at}['apply_to'] must be one of {APPLY_TO}, got {apply_to!r}")
        enabled = typed(data.pop("enabled", False), "bool", f"{at}['enabled']")
        return cls(enabled=enabled, apply_to=apply_to, kwargs=_frozen(data))


@dataclass(frozen=True)
class ProbeSettings:
    """Rank 0 hands the GradientProbe actor ``actor_name`` the batch every ``every`` iterations (0: off)."""

    actor_name: str | None = None
    every: int = 0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, at: str = where("probe")) -> ProbeSettings:
        """Parse the ``probe`` section (``at``: its place, for error messages)."""
        data = mapping(data, at)
        check_keys(data, {f.name for f in fields(cls)}, at)
        every = typed(data.get("every", 0), "int", f"{at}['every']", minimum=0)
        actor_name = typed(data.get("actor_name"), "str", f"{at}['actor_name']", none_ok=True)
        if every > 0 and not actor_name:
            raise ValueError(f"{at}['actor_name'] is required when {at}['every'] > 0")
        return cls(actor_name=actor_name, every=every)


def parse_heads(data: Any, at: str) -> Mapping[str, str]:
    """``{head name: regex}``; each regex must compile (``at``: the section's place, for errors)."""
    heads = mapping(data, at)
    for name, rx in heads.items():
        if not isinstance(name, str) or not isinstance(rx, str):
            raise ValueError(f"{at}: expected {{head name (str): regex (str)}}, got {name!r}: {type(rx).__name__}")
        try:
            re.compile(rx)
        except re.error as exc:
            raise ValueError(f"{at}[{name!r}]: invalid regular expression {rx!r} ({exc})") from None
    return _frozen(heads)


def parse_bands(data: Any, at: str) -> BandSet:
    """A ``BandSet`` from ``{"action": {edges}, "value": {edges}, "collapse": {...}}`` (missing: defaults)."""
    bands = mapping(data, at)
    sections = {"action": HealthBands, "value": HealthBands, "collapse": CollapseBand}
    check_keys(bands, set(sections), at)
    for name, section_cls in sections.items():
        check_keys(
            mapping(bands.get(name), f"{at}[{name!r}]"), {f.name for f in fields(section_cls)}, f"{at}[{name!r}]"
        )
    try:
        return BandSet.from_dict(bands)
    except ValueError as exc:
        raise ValueError(f"{at}: {exc}") from None


@dataclass(frozen=True)
class ModuleSettings:
    """One module's heads and bands.  In ``GradmonSettings.per_module`` a field is None where the
    entry does not give it; ``GradmonSettings.for_module`` fills it from the top level."""

    heads: Mapping[str, str] | None = None
    """Head name -> regex over the module's parameter names ({}: the module's own or zero-config heads)."""
    bands: BandSet | None = None
    """The module's health bands (a given entry replaces the top level's whole; missing edges: defaults)."""

    @classmethod
    def from_dict(cls, data: Any, *, at: str) -> ModuleSettings:
        """Parse one ``per_module`` entry, ``{"heads": {...}, "bands": {...}}`` (both optional)."""
        data = mapping(data, at)
        check_keys(data, {f.name for f in fields(cls)}, at)
        heads = parse_heads(data["heads"], f"{at}['heads']") if "heads" in data else None
        bands = parse_bands(data["bands"], f"{at}['bands']") if "bands" in data else None
        return cls(heads=heads, bands=bands)


@dataclass(frozen=True)
class GradmonSettings:
    """Everything a gradmon learner reads from ``learner_config_dict["gradmon"]``."""

    heads: Mapping[str, str] = field(default_factory=lambda: _frozen({}))
    """Head name -> regex over the module's ``named_parameters()`` names (when the module has
    no ``head_parameter_groups()``); the rest is the trunk."""
    modules: tuple[str, ...] | None = None
    """Multi-agent: the module ids to monitor (None: every module of the MultiRLModule)."""
    per_module: Mapping[str, ModuleSettings] = field(default_factory=lambda: _frozen({}))
    """Multi-agent: module id -> its own heads and/or bands (see ``for_module``)."""
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
    def allowed_keys(cls, *, full_learner: bool) -> list[str]:
        """The keys of ``learner_config_dict["gradmon"]`` a learner of that kind reads, sorted."""
        return sorted(f.name for f in fields(cls) if full_learner or f.name not in FULL_LEARNER_KEYS)

    @classmethod
    def from_learner_config(
        cls, learner_config_dict: Mapping[str, Any] | None, *, full_learner: bool = False
    ) -> GradmonSettings:
        """Parse ``learner_config_dict["gradmon"]`` (absent: every default).

        ``full_learner``: the learner is ``GradmonPPOTorchLearner`` (or implements what it does);
        False for a ``with_gradmon`` learner, which refuses the keys in ``FULL_LEARNER_KEYS``.
        """
        return cls.from_dict((learner_config_dict or {}).get(LEARNER_CONFIG_KEY), full_learner=full_learner)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, full_learner: bool = False) -> GradmonSettings:
        """Parse the ``"gradmon"`` entry itself (see ``from_learner_config``)."""
        data = mapping(data, WHERE)
        if not full_learner:
            refused = sorted(set(data) & set(FULL_LEARNER_KEYS))
            if refused:  # accepted and ignored would run Adam under a config that says otherwise
                key = refused[0]
                raise ValueError(f"{where(key)} is read only by GradmonPPOTorchLearner: {FULL_LEARNER_KEYS[key]}")
        check_keys(data, cls.allowed_keys(full_learner=full_learner), WHERE)
        optimizer = data.get("optimizer", "adam")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"{where('optimizer')} must be one of {OPTIMIZERS}, got {optimizer!r}")
        per_module = mapping(data.get("per_module"), where("per_module"))
        return cls(
            heads=parse_heads(data.get("heads"), where("heads")),
            modules=_module_ids(data.get("modules")),
            per_module=_frozen(
                {
                    mid: ModuleSettings.from_dict(e, at=f"{where('per_module')}[{mid!r}]")
                    for mid, e in per_module.items()
                }
            ),
            telemetry=typed(data.get("telemetry", True), "bool", where("telemetry")),
            report_every=typed(data.get("report_every", 0), "int", where("report_every"), minimum=0),
            fused_optimizer=typed(data.get("fused_optimizer", True), "bool", where("fused_optimizer")),
            optimizer=optimizer,
            upgd=_frozen(
                check_keys(
                    mapping(data.get("upgd"), where("upgd")),
                    _keywords(UPGD, "params", "lr", "generator"),
                    where("upgd"),
                )
            ),
            vgs=VGSSettings.from_dict(data.get("vgs")),
            bands=parse_bands(data.get("bands"), where("bands")),
            collective_group=typed(data.get("collective_group"), "str", where("collective_group"), none_ok=True),
            collective_backend=typed(data.get("collective_backend", "auto"), "str", where("collective_backend")),
            reduce_telemetry=typed(data.get("reduce_telemetry", True), "bool", where("reduce_telemetry")),
            noise_scale=typed(data.get("noise_scale", True), "bool", where("noise_scale")),
            noise_ema_beta=float(typed(data.get("noise_ema_beta", 0.9), "number", where("noise_ema_beta"))),
            replica_check_every=typed(
                data.get("replica_check_every", 10), "int", where("replica_check_every"), minimum=0
            ),
            regularizers=_regularizers(data.get("regularizers")),
            probe=ProbeSettings.from_dict(data.get("probe")),
            fault_injection=FaultInjection.from_dict(mapping(data.get("fault_injection"), where("fault_injection"))),
        )

    def for_module(self, module_id: str) -> ModuleSettings:
        """Module ``module_id``'s heads and bands: its ``per_module`` entry's, each field falling back
        to the top-level ``heads`` / ``bands`` where the entry does not give it (or there is no entry)."""
        own = self.per_module.get(module_id, ModuleSettings())
        return ModuleSettings(
            heads=self.heads if own.heads is None else own.heads,
            bands=self.bands if own.bands is None else own.bands,
        )

    def check_modules(self, module_ids: Collection[str]) -> None:
        """Raise a one-line ``ValueError`` if ``modules`` or ``per_module`` names a module id that is
        not among ``module_ids`` (the MultiRLModule's)."""
        have = list(module_ids)
        for key, named in (("modules", self.modules or ()), ("per_module", tuple(self.per_module))):
            missing = [mid for mid in named if mid not in have]
            if missing:
                raise ValueError(
                    f"{where(key)} names module ids {missing} that the MultiRLModule does not have; it has {have}"
                )


def _module_ids(data: Any) -> tuple[str, ...] | None:
    """``modules``: a non-empty list of module ids, or None (every module)."""
    at = where("modules")
    if data is None:
        return None
    if isinstance(data, (str, bytes)) or not isinstance(data, (list, tuple)):
        raise ValueError(f"{at} must be a list of module ids (str), got {type(data).__name__} {data!r}")
    if not data or not all(isinstance(m, str) for m in data):
        raise ValueError(
            f"{at} must be a non-empty list of module ids (str) (omit it to monitor every module), got {data!r}"
        )
    return tuple(data)


def _regularizers(data: Any) -> tuple[Mapping[str, Any], ...]:
    """``regularizers``: a list of ``{"name", "fn", "weight", "enabled"}`` entries."""
    at = where("regularizers")
    if data is None:
        return ()
    if not isinstance(data, (list, tuple)):
        raise ValueError(
            f"{at} must be a list of {{'name', 'fn', 'weight', 'enabled'}} entries, got {type(data).__name__}"
        )
    allowed = RegularizerEntry.model_fields  # what build_ppo_config writes, one entry each
    return tuple(_frozen(check_keys(mapping(e, f"{at}[{i}]"), allowed, f"{at}[{i}]")) for i, e in enumerate(data))
