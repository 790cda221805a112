"""YAML in (YAML 1.2 floats, safe loading only) and dotted overrides of plain config data."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from gradmon_ray.config.base import ConfigError

# YAML 1.2 floats that PyYAML's YAML 1.1 resolver reads as strings: an exponent without a dot
# (1e-3, 3E+4), without a sign (1.0e3), or a signed leading dot (-.5).
_YAML12_FLOAT = re.compile(
    r"""^[-+]?(?:[0-9]+\.[0-9]*(?:[eE][-+]?[0-9]+)?
    |\.[0-9]+(?:[eE][-+]?[0-9]+)?
    |[0-9]+[eE][-+]?[0-9]+)$""",
    re.X,
)


class YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (no object construction) that also reads YAML 1.2 floats such as
    ``1e-3``, ``3E+4``, ``-2.5e-2``, ``.5`` and ``1.`` as numbers; every YAML read of configs,
    sweep files and ``--set`` values goes through ``load_yaml``."""


YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """Parse one YAML document safely with ``YamlLoader`` (what ``yaml.safe_load`` does, plus YAML 1.2 floats)."""
    loader = YamlLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def yaml_error_text(exc: yaml.YAMLError) -> str:
    """PyYAML's error as one line with 1-based line and column: ``line 3, column 7: expected ',' or ']',
    but got '<stream end>' (in the flow sequence started at line 1, column 6)``."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:  # a YAMLError without a position (rare): its own first line
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        where = re.sub(r"^while \w+ an? ", "in the ", context)  # "while parsing a flow sequence"
        text += f" ({where} started at line {context_mark.line + 1}, column {context_mark.column + 1})"
    return text


def read_yaml_mapping(path: str | Path, field_path: str) -> dict[str, Any]:
    """A YAML file's top-level mapping (an empty file is ``{}``); a missing file, bad YAML or
    a non-mapping is a ``ConfigError`` on ``field_path``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(field_path, f"file not found: {p}")
    try:
        loaded = load_yaml(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(field_path, f"{p} is not valid YAML: {yaml_error_text(exc)}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(field_path, f"{p} must hold a mapping at the top level")
    return loaded or {}


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (``{"ppo.lr": 1e-3}``) in plain config data, in place; returns ``data``."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            if node.get(part) is None:  # absent, or an empty YAML section (``vgs:``)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(dotted, "cannot set a key inside a non-mapping value")
        node[leaf] = value
    return data
