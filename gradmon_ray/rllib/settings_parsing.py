"""Parsing ``learner_config_dict["gradmon"]``: one-line errors that name the key and what is allowed.

The helpers every section of ``rllib.settings`` parses with (``mapping``, ``check_keys``, ``typed``),
the parsers of the sections that are plain values (``heads``, ``bands``, ``value_heads``,
``modules``, ``regularizers``), and the refusal of the keys only ``GradmonPPOTorchLearner``
implements (``FULL_LEARNER_KEYS``).  The settings dataclasses themselves are ``rllib.settings``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Collection, Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import Any

from gradmon_ray.config import RegularizerEntry
from gradmon_ray.config.module_patterns import check_module_entry
from gradmon_ray.head_labels import check_name
from gradmon_ray.telemetry.bands import BandSet, CollapseBand, HealthBands, UpdateRatioBand

LEARNER_CONFIG_KEY = "gradmon"
"""Key in ``AlgorithmConfig.learner_config_dict`` holding the gradmon learner settings."""


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


def frozen(data: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(data or {}))


def keywords(fn: Any, *passed: str) -> frozenset[str]:
    """``fn``'s parameter names less those the learner ``passed`` itself (read from its signature: never a
    second list to keep in step with ``VarianceGradientScaler`` or ``UPGD``)."""
    return frozenset(inspect.signature(fn).parameters) - set(passed)


def parse_heads(data: Any, at: str) -> Mapping[str, str]:
    """``{head name: regex}``; each name a metric name can carry (``head_labels.check_name``), each
    regex must compile (``at``: the section's place, for errors)."""
    heads = mapping(data, at)
    for name, rx in heads.items():
        if not isinstance(name, str) or not isinstance(rx, str):
            raise ValueError(f"{at}: expected {{head name (str): regex (str)}}, got {name!r}: {type(rx).__name__}")
        check_name(name, f"{at}: head name")
        try:
            re.compile(rx)
        except re.error as exc:
            raise ValueError(f"{at}[{name!r}]: invalid regular expression {rx!r} ({exc})") from None
    return frozen(heads)


def parse_bands(data: Any, at: str) -> BandSet:
    """A ``BandSet`` from ``{"action": {edges}, "value": {edges}, "collapse": {...}, "update_ratio": {...}}``
    (missing: defaults)."""
    bands = mapping(data, at)
    sections = {"action": HealthBands, "value": HealthBands, "collapse": CollapseBand, "update_ratio": UpdateRatioBand}
    check_keys(bands, set(sections), at)
    for name, section_cls in sections.items():
        check_keys(
            mapping(bands.get(name), f"{at}[{name!r}]"), {f.name for f in fields(section_cls)}, f"{at}[{name!r}]"
        )
    try:
        return BandSet.from_dict(bands)
    except ValueError as exc:
        raise ValueError(f"{at}: {exc}") from None


def parse_value_heads(data: Any, at: str) -> tuple[str, ...] | None:
    """``value_heads``: head names judged by the value bands besides ``value`` and ``vf`` (None: not given)."""
    if data is None:
        return None
    if isinstance(data, (str, bytes)) or not isinstance(data, (list, tuple)):
        raise ValueError(f"{at} must be a list of head names (str), got {type(data).__name__} {data!r}")
    for head in data:
        check_name(head, f"{at}: head name")
    return tuple(dict.fromkeys(data))


def refuse_full_learner_keys(data: Mapping[str, Any]) -> None:
    """A ``with_gradmon`` learner refuses the keys only ``GradmonPPOTorchLearner`` implements, even at
    their default: accepted and ignored would run Adam under a config that says otherwise."""
    refused = sorted(set(data) & set(FULL_LEARNER_KEYS))
    if refused:
        key = refused[0]
        raise ValueError(f"{where(key)} is read only by GradmonPPOTorchLearner: {FULL_LEARNER_KEYS[key]}")


def module_ids(data: Any, at: str = where("modules")) -> tuple[str, ...] | None:
    """``modules`` (or the list at ``at``): a non-empty list of module ids or glob patterns of them
    (``config.module_patterns``: a module may join later), or None (every module)."""
    if data is None:
        return None
    if isinstance(data, (str, bytes)) or not isinstance(data, (list, tuple)):
        raise ValueError(f"{at} must be a list of module ids (str), got {type(data).__name__} {data!r}")
    if not data or not all(isinstance(m, str) for m in data):
        raise ValueError(f"{at} must be a non-empty list of module ids (str) (omit it for every module), got {data!r}")
    return tuple(check_module_entry(m, f"{at}: module id") for m in data)


def regularizers(data: Any) -> tuple[Mapping[str, Any], ...]:
    """``regularizers``: a list of ``{"name", "fn", "weight", "enabled"}`` entries."""
    at = where("regularizers")
    if data is None:
        return ()
    if not isinstance(data, (list, tuple)):
        raise ValueError(
            f"{at} must be a list of {{'name', 'fn', 'weight', 'enabled'}} entries, got {type(data).__name__}"
        )
    allowed = RegularizerEntry.model_fields  # what build_ppo_config writes, one entry each
    return tuple(frozen(check_keys(mapping(e, f"{at}[{i}]"), allowed, f"{at}[{i}]")) for i, e in enumerate(data))


DROP_IN_OPT_INS = ("noise_scale_one_learner",)
"""Settings the run config turns on that cost the drop-in ops a minibatch: left at the drop-in's default."""


def drop_in_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A full learner's ``learner_config_dict["gradmon"]`` as the drop-in takes it by default: without
    the keys only ``GradmonPPOTorchLearner`` reads and without ``DROP_IN_OPT_INS`` (the benchmarks'
    and tests' drop-in arm: a user who copies gradmon-ray train's settings into ``with_gradmon``)."""
    return {k: v for k, v in settings.items() if k not in FULL_LEARNER_KEYS and k not in DROP_IN_OPT_INS}
