"""The gradmon learner settings: ONE frozen, typed object built once from the learner config.

``GradmonSettings.from_learner_config(config.learner_config_dict)`` reads the ``"gradmon"``
entry; every key has one default here and nowhere else.  Nothing is silently ignored: an
unknown key, a key the learner in use does not implement (``with_gradmon`` learners keep their
own optimizer and loss) and a value of the wrong type are each a one-line ``ValueError`` that
names the key and what is allowed (the parsing and the refusals: ``rllib.settings_parsing``).
``build_ppo_config`` writes the entry from a ``GradmonConfig``; a user of ``with_gradmon`` writes
it by hand, usually just ``heads`` (and ``value_heads`` for a critic not called ``vf``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from gradmon_ray.config.module_patterns import is_pattern, matches, unmatched
from gradmon_ray.head_labels import check_name
from gradmon_ray.optim.upgd import UPGD
from gradmon_ray.rllib.settings_parsing import (
    FULL_LEARNER_KEYS,
    LEARNER_CONFIG_KEY,
    WHERE,
    check_keys,
    frozen,
    keywords,
    mapping,
    module_ids,
    parse_bands,
    parse_heads,
    parse_value_heads,
    refuse_full_learner_keys,
    regularizers,
    typed,
    where,
)
from gradmon_ray.telemetry.bands import BandSet
from gradmon_ray.vgs.scaler import VarianceGradientScaler

OPTIMIZERS = ("adam", "upgd")
APPLY_TO = ("update", "gradient")
"""Where the VGS factor acts (``VGSSettings.apply_to``)."""


@dataclass(frozen=True)
class VGSSettings:
    """The Variance Gradient Scaler: off unless ``enabled``; ``kwargs`` go to ``VarianceGradientScaler``."""

    enabled: bool = False
    apply_to: str = "update"
    """``"update"``: the factor scales the optimizer's step; ``"gradient"``: the gradient, before clipping."""
    kwargs: Mapping[str, Any] = field(default_factory=lambda: frozen({}))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, at: str = where("vgs")) -> VGSSettings:
        """Parse the ``vgs`` section (``at``: its place, for error messages)."""
        data = mapping(data, at)
        check_keys(data, {"apply_to", "accept_old_checkpoint"} | keywords(VarianceGradientScaler, "parameters"), at)
        data.pop("accept_old_checkpoint", None)  # checked before training (rllib.preflight)
        apply_to = str(data.pop("apply_to", "update"))
        if apply_to not in APPLY_TO:
            raise ValueError(f"{at}['apply_to'] must be one of {APPLY_TO}, got {apply_to!r}")
        enabled = typed(data.pop("enabled", False), "bool", f"{at}['enabled']")
        return cls(enabled=enabled, apply_to=apply_to, kwargs=frozen(data))


@dataclass(frozen=True)
class ProbeSettings:
    """Rank 0 hands the GradientProbe actor ``actor_name`` the batch every ``every`` iterations (0: off),
    of every monitored module, or of those ``modules`` names (ids or glob patterns; None: all)."""

    actor_name: str | None = None
    every: int = 0
    modules: tuple[str, ...] | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, at: str = where("probe")) -> ProbeSettings:
        """Parse the ``probe`` section (``at``: its place, for error messages)."""
        data = mapping(data, at)
        check_keys(data, {f.name for f in fields(cls)}, at)
        every = typed(data.get("every", 0), "int", f"{at}['every']", minimum=0)
        actor_name = typed(data.get("actor_name"), "str", f"{at}['actor_name']", none_ok=True)
        if every > 0 and not actor_name:
            raise ValueError(f"{at}['actor_name'] is required when {at}['every'] > 0")
        return cls(actor_name=actor_name, every=every, modules=module_ids(data.get("modules"), f"{at}['modules']"))

    def probes(self, module_id: str) -> bool:
        """Whether a monitored module ``module_id`` is probed (``modules`` names it, or is None)."""
        return matches(str(module_id), self.modules)


@dataclass(frozen=True)
class ModuleSettings:
    """One module's heads and bands.  In ``GradmonSettings.per_module`` a field is None where the
    entry does not give it; ``GradmonSettings.for_module`` fills it from the top level."""

    heads: Mapping[str, str] | None = None
    """Head name -> regex over the module's parameter names ({}: the module's own or zero-config heads)."""
    bands: BandSet | None = None
    """The module's health bands (a given entry replaces the top level's whole; missing edges: defaults)."""
    value_heads: tuple[str, ...] | None = None
    """Heads judged by the value bands besides ``value`` and ``vf`` (``metric_names.is_value_head``)."""

    @classmethod
    def from_dict(cls, data: Any, *, at: str) -> ModuleSettings:
        """Parse one ``per_module`` entry, ``{"heads": {...}, "bands": {...}, "value_heads": [...]}`` (all optional)."""
        data = mapping(data, at)
        check_keys(data, {f.name for f in fields(cls)}, at)
        heads = parse_heads(data["heads"], f"{at}['heads']") if "heads" in data else None
        bands = parse_bands(data["bands"], f"{at}['bands']") if "bands" in data else None
        return cls(
            heads=heads, bands=bands, value_heads=parse_value_heads(data.get("value_heads"), f"{at}['value_heads']")
        )


@dataclass(frozen=True)
class GradmonSettings:
    """Everything a gradmon learner reads from ``learner_config_dict["gradmon"]``."""

    heads: Mapping[str, str] = field(default_factory=lambda: frozen({}))
    """Head name -> regex over the module's ``named_parameters()`` names (when the module has
    no ``head_parameter_groups()``); the rest is the trunk."""
    modules: tuple[str, ...] | None = None
    """Multi-agent: the module ids or glob patterns (``league_*``) of the modules to monitor, those
    added mid-run included (None: every module of the MultiRLModule); see ``monitors``."""
    value_heads: tuple[str, ...] = ()
    """Heads judged by the value bands, never as action heads, besides ``value`` and ``vf`` (e.g. a
    critic head named ``critic``); the module may declare its own too (``rllib.heads.declared_value_heads``)."""
    per_module: Mapping[str, ModuleSettings] = field(default_factory=lambda: frozen({}))
    """Multi-agent: module id -> its own heads, bands and/or value heads (see ``for_module``); a
    module added mid-run gets its entry from its first update."""
    telemetry: bool = True
    """Per-head norms, latches and counts (off: only VGS/probe run)."""
    report_every: int = 0
    """``update`` calls per telemetry step (0: RLlib's metrics cadence, see ``monitor``)."""
    fused_optimizer: bool = True
    """``GradmonPPOTorchLearner``: fused Adam (skips non-finite steps on the device)."""
    optimizer: str = "adam"
    """``GradmonPPOTorchLearner``: ``"adam"`` or ``"upgd"``."""
    upgd: Mapping[str, Any] = field(default_factory=lambda: frozen({}))
    vgs: VGSSettings = field(default_factory=VGSSettings)
    bands: BandSet = field(default_factory=BandSet)
    collective_group: str | None = None
    """Name of the learners' collective group (None: derived from the DDP rendezvous)."""
    collective_backend: str = "auto"
    collective_timeout_s: float = 300.0
    """2+ learners: how long one collective among them (the presence exchange, the gradient average
    on the host, the telemetry reduce) waits for the others before training stops with a line naming
    what it waited for (``distributed.agreement``; torch's own limit in RLlib is 30 minutes)."""
    reduce_telemetry: bool = True
    noise_scale: bool = True
    noise_scale_one_learner: bool = False
    """With ONE learner, B_simple from the first epoch's minibatches (``telemetry.noise_one_learner``):
    one multi-tensor add a minibatch of the first epoch, so off in the drop-in unless asked for."""
    noise_ema_beta: float = 0.9
    shared_gradients_every: int = 10
    """Every N telemetry steps, each module's gradient on parameters modules share (``rllib.shared_gradients``;
    0: never); only with two or more modules in one minibatch."""
    replica_check_every: int = 10
    regularizers: tuple[Mapping[str, Any], ...] = ()
    """``GradmonPPOTorchLearner``: ``{"name", "fn", "weight", "enabled"}`` terms added to the loss."""
    probe: ProbeSettings = field(default_factory=ProbeSettings)

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
            refuse_full_learner_keys(data)
        check_keys(data, cls.allowed_keys(full_learner=full_learner), WHERE)
        optimizer = data.get("optimizer", "adam")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"{where('optimizer')} must be one of {OPTIMIZERS}, got {optimizer!r}")
        per_module = mapping(data.get("per_module"), where("per_module"))
        return cls(
            heads=parse_heads(data.get("heads"), where("heads")),
            value_heads=parse_value_heads(data.get("value_heads"), where("value_heads")) or (),
            modules=module_ids(data.get("modules")),
            per_module=frozen(
                {
                    check_name(mid, f"{where('per_module')}: module id"): ModuleSettings.from_dict(
                        e, at=f"{where('per_module')}[{mid!r}]"
                    )
                    for mid, e in per_module.items()
                }
            ),
            telemetry=typed(data.get("telemetry", True), "bool", where("telemetry")),
            report_every=typed(data.get("report_every", 0), "int", where("report_every"), minimum=0),
            fused_optimizer=typed(data.get("fused_optimizer", True), "bool", where("fused_optimizer")),
            optimizer=optimizer,
            upgd=frozen(
                check_keys(
                    mapping(data.get("upgd"), where("upgd")),
                    keywords(UPGD, "params", "lr", "generator"),
                    where("upgd"),
                )
            ),
            vgs=VGSSettings.from_dict(data.get("vgs")),
            bands=parse_bands(data.get("bands"), where("bands")),
            collective_group=typed(data.get("collective_group"), "str", where("collective_group"), none_ok=True),
            collective_backend=typed(data.get("collective_backend", "auto"), "str", where("collective_backend")),
            collective_timeout_s=float(
                typed(data.get("collective_timeout_s", 300.0), "number", where("collective_timeout_s"), minimum=1)
            ),
            reduce_telemetry=typed(data.get("reduce_telemetry", True), "bool", where("reduce_telemetry")),
            noise_scale=typed(data.get("noise_scale", True), "bool", where("noise_scale")),
            noise_scale_one_learner=typed(
                data.get("noise_scale_one_learner", False), "bool", where("noise_scale_one_learner")
            ),
            noise_ema_beta=float(typed(data.get("noise_ema_beta", 0.9), "number", where("noise_ema_beta"))),
            shared_gradients_every=typed(
                data.get("shared_gradients_every", 10), "int", where("shared_gradients_every")
            ),
            replica_check_every=typed(
                data.get("replica_check_every", 10), "int", where("replica_check_every"), minimum=0
            ),
            regularizers=regularizers(data.get("regularizers")),
            probe=ProbeSettings.from_dict(data.get("probe")),
        )

    def for_module(self, module_id: str) -> ModuleSettings:
        """Module ``module_id``'s heads, bands and value heads: its ``per_module`` entry's, each field
        falling back to the top level's where the entry does not give it (or there is no entry)."""
        own = self.per_module.get(module_id, ModuleSettings())
        return ModuleSettings(
            heads=self.heads if own.heads is None else own.heads,
            bands=self.bands if own.bands is None else own.bands,
            value_heads=self.value_heads if own.value_heads is None else own.value_heads,
        )

    def monitors(self, module_id: str) -> bool:
        """Whether module ``module_id`` is monitored (``modules`` names it by id or pattern, or is None)."""
        return matches(str(module_id), self.modules)

    def check_modules(self, module_ids: Collection[str]) -> None:
        """Raise a one-line ``ValueError`` if ``probe.modules`` names a module id that ``modules``
        does not monitor (it would never be probed), or a module to monitor among ``module_ids`` (the
        MultiRLModule's) has an id that metric names cannot carry (``head_labels.check_name``).  Ids
        the MultiRLModule does not have (yet) are accepted: a league adds its modules later
        (``unseen_note`` says, once, which never turned up)."""
        # (a pattern of probe.modules may match modules that modules names: not refused)
        unmonitored = [mid for mid in self.probe.modules or () if not is_pattern(mid) and not self.monitors(mid)]
        if unmonitored:  # the probe follows the monitored modules only: these would never be probed
            raise ValueError(
                f"{where('probe')}['modules'] names module ids {unmonitored} that {where('modules')} does not monitor"
            )
        for mid in module_ids:
            if self.monitors(mid):
                check_name(mid, "the MultiRLModule's module id")

    def unseen_note(self, seen: Collection[str]) -> str | None:
        """One line naming every id or pattern of ``modules``, ``per_module`` and ``probe.modules``
        that no module in ``seen`` (every module the learner has had) matches, None if all did."""
        named_at = (
            (where("modules"), unmatched(self.modules, seen)),
            (where("per_module"), unmatched(tuple(self.per_module), seen)),
            (f"{where('probe')}['modules']", unmatched(self.probe.modules, seen)),
        )
        parts = [f"{at} names {names}" for at, names in named_at if names]
        if not parts:
            return None
        # sorted: RLlib builds the MultiRLModule's order from a set, so it varies between runs
        return (
            f"gradmon: {'; '.join(parts)}, matching no module this learner has had ({sorted(map(str, seen))}); "
            "a module added later under such an id is monitored from its first update, a typo never is"
        )
