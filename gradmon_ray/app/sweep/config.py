"""Sweep files: the schema, its validation and the search space as Tune domains.

A sweep file (``tune_configs/*_sweep.yaml``) names a base run config and a search space
over dotted config fields::

    base_config: default.yaml          # relative to the sweep file (or `base:` inline)
    search_space:
      ppo.lr: {loguniform: [1.0e-4, 1.0e-3]}
      vgs.alpha: {choice: [0.05, 0.1, 0.3]}
      model.trunk_hiddens: {grid: [[64, 64], [128, 128]]}
    num_samples: 2

Everything is validated before Ray starts: an unknown key, an unknown config field, a
malformed search space or a value the run config would reject exits with status 2 and
one line.  Running a sweep: ``gradmon_ray.app.sweep.run``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import Field, ValidationError

from gradmon_ray import metric_names as mn
from gradmon_ray.config import (
    ConfigError,
    ConfigModel,
    GradmonConfig,
    Text,
    apply_overrides,
    config_errors,
    config_from_dict,
    read_yaml_mapping,
)

SEARCH_KINDS = ("choice", "grid", "uniform", "loguniform")


class SweepConfig(ConfigModel):
    """A sweep file."""

    name: Union[Text, None] = Field(None, description="Sweep name (Tune experiment and MLflow tag).")
    base_config: Union[Text, None] = Field(
        None, description="Run config YAML the trials start from (relative to the sweep file)."
    )
    base: dict[Text, Any] = Field(default_factory=dict, description="Inline run config, applied after base_config.")
    search_space: dict[Text, Any] = Field(
        default_factory=dict, description="Dotted config field -> {choice|grid|uniform|loguniform: [...]}."
    )
    num_samples: int = Field(1, ge=1, description="Samples of the search space (x grid size).")
    metric: Text = Field(mn.EPISODE_RETURN_MEAN, description="Metric that ranks trials.")
    mode: Literal["max", "min"] = Field("max", description="Whether larger metric is better.")
    max_concurrent_trials: int = Field(1, ge=1, description="Trials running at once.")
    max_failures: int = Field(
        2, ge=-1, description="Retries of a failed trial, from its last checkpoint (-1: forever)."
    )
    checkpoint_every: int = Field(1, ge=1, description="Checkpoint a trial every N iterations.")
    keep_checkpoints: int = Field(2, ge=1, description="Latest checkpoints kept per trial.")
    storage_path: Union[Text, None] = Field(None, description="Where Tune keeps trial state (null: ./tune_results).")


_RUN_CONFIG_ONLY = set(GradmonConfig.model_fields) - set(SweepConfig.model_fields)
"""Top-level keys of a run config that no sweep file has."""


def load_sweep(path: str | Path) -> tuple[SweepConfig, dict[str, Any]]:
    """Parse and validate a sweep file; returns it and the resolved base run config (as data).

    Every problem is reported at once (one ``ConfigError`` listing them all): the sweep's own
    keys, the base config, and each search space entry, so that a file with three mistakes
    needs one edit, not three runs.  Invalid YAML stops at its first error (nothing after it
    can be read).
    """
    p = Path(path)
    data = read_yaml_mapping(p, "sweep")
    if "search_space" not in data and set(data) & _RUN_CONFIG_ONLY:  # the mix-up load_config refuses the other way
        raise ConfigError(
            "sweep",
            f"{path} is a run config (it has no search_space), not a sweep file; train it with: "
            f"gradmon-ray train --config {path}, or name it in a sweep file's base_config",
        )
    problems: list[ConfigError] = []
    try:
        sweep: SweepConfig | None = SweepConfig.model_validate(data)
    except ValidationError as exc:
        problems += config_errors(SweepConfig, exc, "", data)
        sweep = None
    # What of the file can still be checked when its own keys are wrong: the parts of the right type.
    base_config = sweep.base_config if sweep else _typed(data, "base_config", str)
    inline = sweep.base if sweep else _typed(data, "base", dict) or {}
    space = sweep.search_space if sweep else _typed(data, "search_space", dict)
    base: dict[str, Any] = {}
    base_ok = True
    if base_config:
        try:
            base = read_yaml_mapping((p.parent / base_config).resolve(), "base_config")
        except ConfigError as exc:
            problems.append(exc)
            base_ok = False
    base = _merge(base, inline)
    try:
        GradmonConfig.model_validate(copy.deepcopy(base))  # the base itself must be a valid run config
    except ValidationError as exc:
        problems += config_errors(GradmonConfig, exc, "", base)
        base_ok = False
    if space is not None and not space:
        problems.append(
            ConfigError("search_space", "is empty; give at least one field, e.g. {ppo.lr: {choice: [1e-4, 3e-4]}}")
        )
    problems += _search_space_problems(space or {}, base, check_values=base_ok)
    if problems:
        raise _all_of(problems)
    assert sweep is not None  # no problems: it parsed
    if sweep.name is None:
        sweep.name = p.stem
    return sweep, base


def _typed(data: dict[str, Any], key: str, kind: type) -> Any:
    value = data.get(key)
    return value if isinstance(value, kind) else None


def _search_space_problems(space: dict[str, Any], base: dict[str, Any], *, check_values: bool) -> list[ConfigError]:
    """Each entry's problems: its form, and (on a valid base) each value the run config would refuse."""
    problems: list[ConfigError] = []
    for key, spec in space.items():
        try:
            values = _candidate_values(key, spec)
        except ConfigError as exc:
            problems.append(exc)
            continue
        if not check_values:  # an invalid base refuses every value: its own errors say why
            continue
        for value in values:
            try:
                config_from_dict(apply_overrides(copy.deepcopy(base), {key: value}))
            except ConfigError as exc:
                problems.append(ConfigError(f"search_space.{key}", str(exc)))
                break  # one refused value per entry is enough to say what is wrong with it
    return problems


def _all_of(problems: list[ConfigError]) -> ConfigError:
    """One error: the problem itself when there is one, else all of them (the CLI shows the first few)."""
    return ConfigError.of_all("sweep", problems)


def _candidate_values(key: str, spec: Any) -> list[Any]:
    """The values a search space entry can produce that the run config must accept."""
    where = f"search_space.{key}"
    if not isinstance(spec, dict):
        return [spec]  # a constant
    if len(spec) != 1 or next(iter(spec)) not in SEARCH_KINDS:
        raise ConfigError(where, f"must be a constant or one of {{{' | '.join(SEARCH_KINDS)}: [...]}}, got {spec!r}")
    kind, args = next(iter(spec.items()))
    if not isinstance(args, list) or not args:
        raise ConfigError(where, f"{kind} needs a non-empty list, got {args!r}")
    if kind in ("choice", "grid"):
        return list(args)
    if len(args) != 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        raise ConfigError(where, f"{kind} needs [low, high] numbers, got {args!r}")
    low, high = args
    if not low < high:
        raise ConfigError(where, f"{kind} needs low < high, got {args!r}")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(where, f"loguniform needs 0 < low, got {args!r}")
    return [float(low), float(high)]


def tune_search_space(search_space: dict[str, Any]) -> dict[str, Any]:
    """The Tune domains (``tune.choice`` etc.) of a validated search space."""
    from ray import tune

    makers = {
        "choice": tune.choice,
        "grid": tune.grid_search,
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
    }
    out = {}
    for key, spec in search_space.items():
        if isinstance(spec, dict):
            kind, args = next(iter(spec.items()))
            out[key] = makers[kind](args)
        else:
            out[key] = spec
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
