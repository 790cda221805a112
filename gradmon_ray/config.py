"""The run configuration: typed dataclasses, loaded from YAML and validated up front.

Every field has a default that runs on a laptop and a docstring.  ``load_config`` rejects
an unknown key, a wrong type or an impossible value with a ``ConfigError`` that names the
field (``ppo.minibatch_size``) and says what is allowed; the CLI prints that one line and
exits with status 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

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


class ConfigError(ValueError):
    """A config value is not allowed; ``str()`` names the field and what is allowed."""

    def __init__(self, field_path: str, message: str) -> None:
        self.field_path = field_path
        super().__init__(f"{field_path}: {message}")


def _meta(doc: str, **checks: Any) -> dict[str, Any]:
    return {"doc": doc, **checks}


@dataclass
class EnvSection:
    """Which environment to train on."""

    id: str = field(
        default="gradmon/FactoredOps-v0",
        metadata=_meta("A registered Gymnasium/Ray Tune env name, or 'package.module:ClassName'."),
    )
    config: dict[str, Any] = field(default_factory=dict, metadata=_meta("Keyword config passed to the env."))


@dataclass
class ModelSection:
    """Shape of the FactoredActorCritic RLModule."""

    trunk_hiddens: list[int] = field(default_factory=lambda: [128, 128], metadata=_meta("Shared trunk widths.", min=1))
    head_hiddens: list[int] = field(
        default_factory=list, metadata=_meta("Hidden widths inside each action head.", min=1)
    )
    value_hiddens: list[int] = field(
        default_factory=list, metadata=_meta("Hidden widths inside the value head.", min=1)
    )
    activation: Literal["tanh", "relu", "silu"] = field(default="tanh", metadata=_meta("Hidden activation."))
    head_logit_scale: dict[str, float] = field(
        default_factory=dict,
        metadata=_meta("Multiply a head's logits, e.g. {op: 100.0} (diagnostics: provokes an exploding head)."),
    )
    head_names: Union[list[str], None] = field(
        default=None, metadata=_meta("Head names for MultiDiscrete/Discrete spaces (Dict spaces use their keys).")
    )


@dataclass
class PPOSection:
    """PPO hyperparameters (RLlib's names)."""

    lr: float = field(default=3e-4, metadata=_meta("Adam learning rate.", exclusive_min=0.0))
    gamma: float = field(default=0.99, metadata=_meta("Discount factor.", min=0.0, max=1.0))
    lambda_: float = field(default=0.95, metadata=_meta("GAE lambda.", min=0.0, max=1.0))
    clip_param: float = field(default=0.2, metadata=_meta("PPO ratio clip.", exclusive_min=0.0))
    vf_clip_param: float = field(default=10.0, metadata=_meta("Clip for the squared value error.", exclusive_min=0.0))
    vf_loss_coeff: float = field(default=0.5, metadata=_meta("Weight of the value loss.", min=0.0))
    entropy_coeff: float = field(default=0.01, metadata=_meta("Weight of the entropy bonus.", min=0.0))
    use_kl_loss: bool = field(default=False, metadata=_meta("Add the adaptive KL penalty."))
    kl_coeff: float = field(default=0.2, metadata=_meta("Initial KL coefficient.", min=0.0))
    kl_target: float = field(default=0.01, metadata=_meta("KL target of the adaptive coefficient.", exclusive_min=0.0))
    train_batch_size: int = field(default=1024, metadata=_meta("Env steps per training iteration.", min=1))
    minibatch_size: int = field(default=128, metadata=_meta("SGD minibatch size.", min=1))
    num_epochs: int = field(default=4, metadata=_meta("Passes over each train batch.", min=1))
    grad_clip: Union[float, None] = field(default=0.5, metadata=_meta("Gradient clip (null: off).", exclusive_min=0.0))
    grad_clip_by: Literal["global_norm", "norm", "value"] = field(default="global_norm", metadata=_meta("Clip mode."))


@dataclass
class ResourcesSection:
    """Where things run."""

    num_env_runners: int = field(default=1, metadata=_meta("Remote EnvRunner actors (0: sample on the driver).", min=0))
    num_envs_per_env_runner: int = field(default=1, metadata=_meta("Vectorised envs per EnvRunner.", min=1))
    num_learners: int = field(default=0, metadata=_meta("Remote learner actors (0: learn on the driver).", min=0))
    num_gpus_per_learner: float = field(default=0.0, metadata=_meta("GPUs per learner (0: CPU).", min=0.0))
    ray_address: Union[str, None] = field(default=None, metadata=_meta("Ray cluster address (null: start local Ray)."))
    num_cpus: Union[int, None] = field(default=None, metadata=_meta("CPUs for a local Ray (null: Ray detects).", min=1))
    env_runner_restart_delay_s: float = field(
        default=5.0,
        metadata=_meta("Wait before restarting a crashed EnvRunner (RLlib's own default: 60 s).", min=0.0),
    )
    max_env_runner_restarts: int = field(
        default=1000, metadata=_meta("EnvRunner restarts allowed over the run before it fails.", min=0)
    )


_EDGE_DOCS = {
    "dead_below": "Below this a head is dead.",
    "weak_below": "Below this (and >= dead_below) a head is weak.",
    "healthy_max": "Up to this (and >= weak_below) a head is healthy.",
    "elevated_max": "Up to this (and > healthy_max) a head is elevated; above it, exploding.",
}


def _edge(default: float, name: str) -> Any:
    return field(default=default, metadata=_meta(_EDGE_DOCS[name], exclusive_min=0.0))


@dataclass
class ActionBandsSection:
    """Health band edges of the action heads' gradient norms (TELE-320: 10 x the 0.5 clip norm explodes)."""

    dead_below: float = _edge(0.01, "dead_below")
    weak_below: float = _edge(0.1, "weak_below")
    healthy_max: float = _edge(2.0, "healthy_max")
    elevated_max: float = _edge(5.0, "elevated_max")


@dataclass
class ValueBandsSection:
    """Health band edges of the value head's gradient norm (a squared-error critic runs larger)."""

    dead_below: float = _edge(0.01, "dead_below")
    weak_below: float = _edge(0.1, "weak_below")
    healthy_max: float = _edge(10.0, "healthy_max")
    elevated_max: float = _edge(50.0, "elevated_max")


@dataclass
class BandsSection:
    """Health band edges: dead < dead_below <= weak < weak_below <= healthy <= healthy_max < elevated
    <= elevated_max < exploding.  Each set must be positive, finite and strictly increasing."""

    action: ActionBandsSection = field(default_factory=ActionBandsSection)
    value: ValueBandsSection = field(default_factory=ValueBandsSection)


@dataclass
class TelemetrySection:
    """Gradient telemetry switches."""

    enabled: bool = field(default=True, metadata=_meta("Per-head norms, latches and counts (off: plain PPO)."))
    fused_optimizer: bool = field(
        default=True, metadata=_meta("Fused Adam, which skips non-finite updates on the device (no host sync).")
    )
    bands: BandsSection = field(default_factory=BandsSection)


@dataclass
class VgsSection:
    """Variance Gradient Scaler (seed 002's `vgs:` block, plus `granularity`)."""

    enabled: bool = field(default=False, metadata=_meta("Scale gradients by their temporal variance (opt-in)."))
    beta: float = field(default=0.99, metadata=_meta("EMA decay per optimizer step.", min=0.0, exclusive_max=1.0))
    alpha: float = field(default=0.1, metadata=_meta("Scaling strength: factor = 1 / (1 + alpha * var).", min=0.0))
    eps: float = field(
        default=1e-8, metadata=_meta("Added to the squared mean in the normalisation.", exclusive_min=0.0)
    )
    warmup_steps: int = field(default=100, metadata=_meta("Optimizer steps before scaling starts.", min=0))
    accept_old_checkpoint: bool = field(
        default=False,
        metadata=_meta(
            "Let restore_from take a checkpoint whose VGS state is the old spatial format (statistics reset)."
        ),
    )
    aggregation_method: Literal["p90", "mean", "weighted_mean"] = field(
        default="p90", metadata=_meta("How per-parameter variances become one number.")
    )
    granularity: Literal["element", "tensor"] = field(
        default="element", metadata=_meta("Statistics per parameter element (like Adam) or per tensor.")
    )


@dataclass
class UpgdSection:
    """UPGD hyperparameters (used when `optimizer: upgd`; the learning rate is `ppo.lr`)."""

    weight_decay: float = field(default=0.001, metadata=_meta("Decoupled weight decay.", min=0.0))
    beta_utility: float = field(default=0.999, metadata=_meta("Utility EMA decay.", min=0.0, exclusive_max=1.0))
    sigma: float = field(default=0.001, metadata=_meta("Perturbation noise std.", min=0.0))


@dataclass
class DistributedSection:
    """How learners agree (only matters with resources.num_learners >= 2)."""

    backend: Literal["auto", "gloo", "nccl"] = field(
        default="auto", metadata=_meta("Ray collective backend: auto = NCCL on GPUs with cupy, else gloo.")
    )
    reduce_telemetry: bool = field(
        default=True, metadata=_meta("One packed collective per iteration (off: each learner reports its own view).")
    )
    noise_scale: bool = field(
        default=True, metadata=_meta("Per-head gradient noise scale via a DDP comm hook (needs reduce_telemetry).")
    )
    replica_check_every: int = field(
        default=10, metadata=_meta("Compare parameter checksums across learners every N iterations (0: off).", min=0)
    )


@dataclass
class RegularizerEntry:
    """One regularizer the probe tracks (ADR-009): ``weight * fn(module, batch, fwd_out)``."""

    name: str = field(default="", metadata=_meta("Metric name of the regularizer (required; letters, digits, _ . -)."))
    fn: Union[str, None] = field(
        default=None,
        metadata=_meta("A built-in (logit_l2, uniform_prior_kl, weight_l2) or 'package.module:function' (null: name)."),
    )
    weight: float = field(default=1.0, metadata=_meta("Coefficient the regularizer enters the loss with."))
    enabled: bool = field(default=True, metadata=_meta("Track this regularizer."))


@dataclass
class ProbeSection:
    """The GradientProbe actor (seeds 004 and 003): bucketed, non-destructive gradient probes."""

    gradient_analysis_every: int = field(
        default=0, metadata=_meta("Probe every N training iterations (0: off).", min=0)
    )
    num_buckets: int = field(default=4, metadata=_meta("Reward-variance buckets (bucket_1 = lowest).", min=1))
    group_key: str = field(
        default="group_id", metadata=_meta("Key in the env's reset info that groups episodes (absent: one per group).")
    )
    num_cpus: float = field(default=1.0, metadata=_meta("CPUs reserved for the probe actor.", min=0.0))
    num_gpus: float = field(default=0.0, metadata=_meta("GPU (fraction) for the probe actor (0: CPU).", min=0.0))
    max_restarts: int = field(default=3, metadata=_meta("Restarts of a crashed probe actor (-1: unlimited).", min=-1))
    track_grad_norms: bool = field(
        default=False,
        metadata=_meta("ADR-009: also take each regularizer's own gradient (one backward pass each)."),
    )


@dataclass
class HealthStopSection:
    """Gradient-health early stopping (each rule off by default)."""

    dead_iterations: int = field(
        default=0,
        metadata=_meta(
            "Stop when a head is dead (action heads: norm < 0.01) this many iterations in a row (0: off).", min=0
        ),
    )
    exploding_iterations: int = field(
        default=0,
        metadata=_meta(
            "Stop when a head is exploding (action heads: norm > 5) this many iterations in a row (0: off).", min=0
        ),
    )
    nan_latch: bool = field(default=False, metadata=_meta("Stop as soon as any head's NaN log-prob latch fires."))
    inf_latch: bool = field(default=False, metadata=_meta("Stop as soon as any head's Inf log-prob latch fires."))
    include_value_head: bool = field(
        default=False,
        metadata=_meta(
            "Also judge the value head, by its own telemetry.bands.value edges, in the dead/exploding rules "
            "and the progress line's worst head (false: action heads only)."
        ),
    )


EMBEDDED_TRACKING_URI = "sqlite:///mlflow.db"
"""Where runs go when neither the config, ``--mlflow-uri`` nor ``MLFLOW_TRACKING_URI`` say otherwise."""


def default_tracking_uri() -> str:
    """MLflow's own convention first (``MLFLOW_TRACKING_URI``; cluster.yaml sets it on every node),
    then the embedded sqlite store in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or EMBEDDED_TRACKING_URI


@dataclass
class MlflowSection:
    """Where metrics go."""

    tracking_uri: str = field(
        default_factory=default_tracking_uri,
        metadata=_meta("MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)."),
    )
    experiment: str = field(default="gradmon-ray", metadata=_meta("MLflow experiment name."))
    run_name: Union[str, None] = field(default=None, metadata=_meta("MLflow run name (null: MLflow picks one)."))
    queue_size: int = field(default=1000, metadata=_meta("Iterations buffered before the oldest are dropped.", min=1))
    spill_dir: str = field(
        default="gradmon-spill",
        metadata=_meta("Where iterations MLflow could not take are kept (replay: gradmon-ray replay FILE)."),
    )
    plots_every: int = field(
        default=10,
        metadata=_meta("Log the gradient-health plots as artifacts every N iterations and at the end (0: off).", min=0),
    )


@dataclass
class GradmonConfig:
    """A whole gradmon-ray training run."""

    iterations: int = field(default=20, metadata=_meta("Training iterations.", min=1))
    seed: Union[int, None] = field(default=0, metadata=_meta("Seed for RLlib and the envs (null: random).", min=0))
    checkpoint_dir: Union[str, None] = field(default=None, metadata=_meta("Save a checkpoint here at the end."))
    restore_from: Union[str, None] = field(
        default=None,
        metadata=_meta(
            "Start from this checkpoint (a checkpoint_dir of an earlier run with the same model): weights, "
            "optimizer, telemetry and VGS state. Checked before anything starts."
        ),
    )
    env: EnvSection = field(default_factory=EnvSection)
    model: ModelSection = field(default_factory=ModelSection)
    ppo: PPOSection = field(default_factory=PPOSection)
    resources: ResourcesSection = field(default_factory=ResourcesSection)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    optimizer: Literal["adam", "upgd"] = field(default="adam", metadata=_meta("Optimizer."))
    upgd: UpgdSection = field(default_factory=UpgdSection)
    vgs: VgsSection = field(default_factory=VgsSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    regularizers: list[RegularizerEntry] = field(
        default_factory=list, metadata=_meta("Extra loss terms, added to the PPO loss with their weights.")
    )
    probe: ProbeSection = field(default_factory=ProbeSection)
    health_stop: HealthStopSection = field(default_factory=HealthStopSection)
    mlflow: MlflowSection = field(default_factory=MlflowSection)

    def to_flat_dict(self) -> dict[str, Any]:
        """``{"ppo.lr": 0.0003, ...}``: what becomes MLflow params."""
        return _flatten(dataclasses.asdict(self))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v) and key != "env.config":
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _coerce(value: Any, tp: Any, path: str, meta: dict[str, Any]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _coerce(value, non_none[0], path, meta) if len(non_none) == 1 else value
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(path, f"must be {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"must be {_type_name(tp)}, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{path}[{i}]", meta) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"must be a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _from_dict(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer{_range_text(meta)}, got {value!r}")
        _check_range(value, path, meta)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"must be a number{_range_text(meta)}, got {value!r}")
        _check_range(float(value), path, meta)
        return float(value)
    if tp is str:
        if not isinstance(value, str) or not value:
            raise ConfigError(path, f"must be a non-empty string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp} at {path}")


def _range_text(meta: dict[str, Any]) -> str:
    parts = []
    if "min" in meta:
        parts.append(f">= {meta['min']}")
    if "exclusive_min" in meta:
        parts.append(f"> {meta['exclusive_min']}")
    if "max" in meta:
        parts.append(f"<= {meta['max']}")
    if "exclusive_max" in meta:
        parts.append(f"< {meta['exclusive_max']}")
    return (" " + " and ".join(parts)) if parts else ""


def _check_range(value: float, path: str, meta: dict[str, Any]) -> None:
    ok = (
        ("min" not in meta or value >= meta["min"])
        and ("exclusive_min" not in meta or value > meta["exclusive_min"])
        and ("max" not in meta or value <= meta["max"])
        and ("exclusive_max" not in meta or value < meta["exclusive_max"])
    )
    if not ok:
        raise ConfigError(path, f"must be{_range_text(meta)}, got {value!r}")


def _from_dict(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            path or "config", f"must be a mapping of {', '.join(f.name for f in dataclasses.fields(cls))}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        where = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise ConfigError(where, f"unknown key; allowed keys here: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        sub = f"{path}.{name}" if path else name
        kwargs[name] = _coerce(value, hints[name], sub, dict(fields[name].metadata))
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any] | None) -> GradmonConfig:
    """Build and validate a ``GradmonConfig`` from plain data (e.g. parsed YAML)."""
    cfg = _from_dict(GradmonConfig, data or {}, "")
    validate_config(cfg)
    return cfg


def validate_config(cfg: GradmonConfig) -> None:
    """Checks that involve more than one field."""
    if cfg.ppo.minibatch_size > cfg.ppo.train_batch_size:
        raise ConfigError(
            "ppo.minibatch_size",
            f"must be <= ppo.train_batch_size ({cfg.ppo.train_batch_size}), got {cfg.ppo.minibatch_size}",
        )
    for kind in ("action", "value"):
        edges = getattr(cfg.telemetry.bands, kind)
        lower = None
        for f in dataclasses.fields(edges):
            value, where = getattr(edges, f.name), f"telemetry.bands.{kind}.{f.name}"
            if not math.isfinite(value):
                raise ConfigError(where, f"must be a finite number > 0, got {value!r}")
            if lower is not None and not value > getattr(edges, lower):
                raise ConfigError(
                    where, f"must be > {lower} ({getattr(edges, lower)!r}; edges strictly increase), got {value!r}"
                )
            lower = f.name
    for head, factor in cfg.model.head_logit_scale.items():
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ConfigError(f"model.head_logit_scale.{head}", f"must be a number > 0, got {factor!r}")
    seen: set[str] = set()
    for i, entry in enumerate(cfg.regularizers):
        where = f"regularizers[{i}]"
        reserved = ("task", "entropy", "kl", "value", "total")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", entry.name) or entry.name in reserved:
            raise ConfigError(
                f"{where}.name",
                f"must be letters, digits, '_', '.' or '-' and not task/entropy/kl/value/total, got {entry.name!r}",
            )
        if entry.name in seen:
            raise ConfigError(f"{where}.name", f"duplicate regularizer name {entry.name!r}")
        seen.add(entry.name)
        try:
            _resolve_regularizer(entry.name, entry.fn, entry.weight, entry.enabled)
        except ValueError as exc:
            raise ConfigError(f"{where}.fn", str(exc)) from None
    if cfg.probe.track_grad_norms and not any(r.enabled for r in cfg.regularizers):
        raise ConfigError("probe.track_grad_norms", "is true but no enabled entry in regularizers")
    if cfg.resources.num_gpus_per_learner > 1 and cfg.resources.num_gpus_per_learner != int(
        cfg.resources.num_gpus_per_learner
    ):
        raise ConfigError("resources.num_gpus_per_learner", "must be a fraction <= 1 or a whole number")


def _resolve_regularizer(name: str, fn: str | None, weight: float, enabled: bool) -> Any:
    # Imported here: the probe package imports torch and RLlib, which the config module avoids.
    from gradmon_ray.probe.regularizers import resolve_regularizer

    return resolve_regularizer(name, fn, weight, enabled)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> GradmonConfig:
    """Load YAML (or defaults when ``path`` is None), apply dotted ``overrides``, validate."""
    data = read_yaml_mapping(path, "--config") if path is not None else {}
    return config_from_dict(apply_overrides(data, overrides or {}))


def read_yaml_mapping(path: str | Path, field_path: str) -> dict[str, Any]:
    """A YAML file's top-level mapping (an empty file is ``{}``); a missing file, bad YAML or
    a non-mapping is a ``ConfigError`` on ``field_path``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(field_path, f"file not found: {p}")
    try:
        loaded = load_yaml(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(field_path, f"{p} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(field_path, f"{p} must hold a mapping at the top level")
    return loaded or {}


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (``{"ppo.lr": 1e-3}``) in plain config data, in place; returns ``data``."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(dotted, "cannot set a key inside a non-mapping value")
        node[leaf] = value
    return data
