"""``config/training_sections.py`` and ``config/sections.py`` (with ``base.py``, ``band_sections.py``,
``probe_sections.py``): defaults, one clear error per kind of mistake, range edges inclusive or
exclusive as documented, checks across sections, and in-place changes.  YAML reading and ``--set``
overrides: ``test_yaml_io.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradmon_ray.config import ConfigError, GradmonConfig, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_example_yaml_spells_every_default():
    assert config_from_dict({}) == GradmonConfig()
    assert load_config(ROOT / "tune_configs" / "default.yaml") == GradmonConfig()


def test_tracking_uri_precedence_explicit_then_mlflow_env_then_embedded_store(monkeypatch, tmp_path):
    assert GradmonConfig().mlflow.tracking_uri == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # empty counts as unset
    assert config_from_dict({}).mlflow.tracking_uri == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://10.0.0.5:5000")
    assert config_from_dict({}).mlflow.tracking_uri == "http://10.0.0.5:5000"
    assert load_config(ROOT / "tune_configs" / "default.yaml").mlflow.tracking_uri == "http://10.0.0.5:5000"
    explicit = {"mlflow": {"tracking_uri": "sqlite:///x.db"}}
    assert config_from_dict(explicit).mlflow.tracking_uri == "sqlite:///x.db"
    assert load_config(None, {"mlflow.tracking_uri": "http://127.0.0.1:1"}).mlflow.tracking_uri == "http://127.0.0.1:1"


@pytest.mark.parametrize(
    ("data", "field", "fragment"),
    [
        ({"ppo": {"lrr": 1}}, "ppo.lrr", "unknown key; allowed keys here: lr, gamma"),
        ({"bogus": 1}, "bogus", "unknown key"),
        ({"ppo": {"lr": "fast"}}, "ppo.lr", "must be a number > 0.0"),
        ({"ppo": {"lr": 0}}, "ppo.lr", "> 0.0"),
        ({"ppo": {"minibatch_size": -3}}, "ppo.minibatch_size", "must be >= 1, got -3"),
        ({"ppo": {"minibatch_size": 2.5}}, "ppo.minibatch_size", "must be an integer"),
        ({"ppo": {"num_epochs": True}}, "ppo.num_epochs", "must be an integer"),
        ({"ppo": {"gamma": 1.5}}, "ppo.gamma", "<= 1.0"),
        ({"ppo": {"grad_clip_by": "l1"}}, "ppo.grad_clip_by", "one of 'global_norm', 'norm', 'value'"),
        ({"model": {"activation": "gelu"}}, "model.activation", "one of 'tanh', 'relu', 'silu'"),
        ({"model": {"trunk_hiddens": [64, 0]}}, "model.trunk_hiddens[1]", ">= 1"),
        ({"model": {"trunk_hiddens": 64}}, "model.trunk_hiddens", "must be a list of integers >= 1, got 64"),
        ({"telemetry": {"enabled": "yes"}}, "telemetry.enabled", "true or false"),
        ({"mlflow": {"tracking_uri": ""}}, "mlflow.tracking_uri", "non-empty string"),
        ({"ppo": 3}, "ppo", "must be a mapping"),
        ({"ppo": {"minibatch_size": 2048}}, "ppo.minibatch_size", "<= ppo.train_batch_size (1024)"),
        ({"vgs": {"beta": 1.0}}, "vgs.beta", "must be >= 0.0 and < 1.0, got 1.0"),
        ({"probe": {"gradient_analysis_every": -1}}, "probe.gradient_analysis_every", ">= 0"),
        ({"probe": {"num_buckets": 0}}, "probe.num_buckets", ">= 1"),
        ({"probe": {"max_restarts": -2}}, "probe.max_restarts", ">= -1"),
        ({"probe": {"custom_resources": {"GPU": 1}}}, "probe.custom_resources", "custom resources only, got ['GPU']"),
        ({"probe": {"custom_resources": {"probe_node": 0}}}, "probe.custom_resources.probe_node", "> 0.0, got 0"),
        (
            {"resources": {"num_learners": 2, "custom_resources_per_learner": {"CPU": 1}}},
            "resources.custom_resources_per_learner",
            "custom resources only, got ['CPU']; CPUs and GPUs have their own fields",
        ),
        (
            {"resources": {"custom_resources_per_learner": {"learner_node": 1}}},
            "resources.custom_resources_per_learner",
            "needs num_learners >= 1 (there is no remote actor to place), got num_learners 0",
        ),
        (
            {"resources": {"num_env_runners": 0, "custom_resources_per_env_runner": {"runner_node": 1}}},
            "resources.custom_resources_per_env_runner",
            "needs num_env_runners >= 1",
        ),
        ({"probe": {"track_grad_norms": True}}, "probe.track_grad_norms", "no enabled entry in regularizers"),
        ({"regularizers": [{"fn": "logit_l2"}]}, "regularizers[0].name", "must be letters, digits"),
        ({"regularizers": [{"name": "task"}]}, "regularizers[0].name", "not task/entropy/kl/value/total"),
        ({"regularizers": [{"name": "a b"}]}, "regularizers[0].name", "got 'a b'"),
        ({"regularizers": [{"name": "x", "fn": "nope"}]}, "regularizers[0].fn", "unknown function 'nope'; use one of"),
        ({"regularizers": [{"name": "x", "fn": "no.such:fn"}]}, "regularizers[0].fn", "cannot import 'no.such:fn'"),
        (
            {"regularizers": [{"name": "logit_l2"}, {"name": "logit_l2", "fn": "weight_l2"}]},
            "regularizers[1].name",
            "duplicate regularizer name",
        ),
        ({"regularizers": [{"name": "x", "wieght": 1}]}, "regularizers[0].wieght", "unknown key"),
        ({"regularizers": {"name": "x"}}, "regularizers", "a list of"),
        ({"vgs": {"aggregation_method": "p95"}}, "vgs.aggregation_method", "one of 'p90', 'mean', 'weighted_mean'"),
        ({"vgs": {"granularity": "layer"}}, "vgs.granularity", "one of 'element', 'tensor'"),
        ({"vgs": {"warmup": 3}}, "vgs.warmup", "allowed keys here: enabled, beta, alpha, eps, warmup_steps"),
        ({"optimizer": "sgd"}, "optimizer", "one of 'adam', 'upgd'"),
        ({"upgd": {"sigma": -1}}, "upgd.sigma", ">= 0.0"),
        (
            {"telemetry": {"bands": {"action": {"healthy_max": 6.0}}}},
            "telemetry.bands.action.elevated_max",
            "must be > healthy_max (6.0; edges strictly increase), got 5.0",
        ),
        (
            {"telemetry": {"bands": {"value": {"weak_below": 0.01}}}},
            "telemetry.bands.value.weak_below",
            "must be > dead_below (0.01; edges strictly increase), got 0.01",
        ),
        ({"telemetry": {"bands": {"value": {"dead_below": 0}}}}, "telemetry.bands.value.dead_below", "> 0.0, got 0"),
        (
            {"telemetry": {"bands": {"action": {"elevated_max": float("inf")}}}},
            "telemetry.bands.action.elevated_max",
            "must be a finite number > 0.0, got inf",
        ),
        ({"telemetry": {"bands": {"action": {"explode": 9}}}}, "telemetry.bands.action.explode", "dead_below, weak"),
        ({"telemetry": {"bands": {"critic": {}}}}, "telemetry.bands.critic", "allowed keys here: action, value"),
        ({"health_stop": {"include_value_head": "no"}}, "health_stop.include_value_head", "true or false"),
    ],
)
def test_errors_name_the_field_and_what_is_allowed(data, field, fragment):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert info.value.field_path == field
    assert str(info.value).startswith(f"{field}: ")
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_null_allowed_where_documented():
    cfg = config_from_dict({"seed": None, "ppo": {"grad_clip": None}, "mlflow": {"run_name": None}})
    assert cfg.seed is None and cfg.ppo.grad_clip is None


def test_every_field_has_a_doc():
    """Every field of every section, from the JSON schema (what docs and editors read)."""
    from gradmon_ray.app.sweep.config import SweepConfig

    for model in (GradmonConfig, SweepConfig):
        schema = model.model_json_schema()
        sections = {model.__name__: schema, **schema.get("$defs", {})}
        checked = 0
        for name, section in sections.items():
            if "properties" not in section:
                continue
            assert section.get("description"), f"{name} has no docstring"
            for field, prop in section["properties"].items():
                ref = prop.get("$ref", "").rpartition("/")[2]  # a section: its docstring
                assert prop.get("description") or sections[ref].get("description"), f"{name}.{field} has no doc"
                checked += 1
        assert checked > (80 if model is GradmonConfig else 10)


def test_flat_params():
    flat = GradmonConfig().to_flat_dict()
    assert flat["ppo.lr"] == 3e-4 and flat["model.trunk_hiddens"] == [128, 128] and flat["env.config"] == {}


def test_band_edges_default_to_the_telemetry_bands_and_reach_the_learner():
    from gradmon_ray.rllib import build_ppo_config
    from gradmon_ray.rllib.learner import LEARNER_CONFIG_KEY
    from gradmon_ray.telemetry import ACTION_BANDS, VALUE_BANDS, BandSet, HealthBands

    cfg = GradmonConfig()
    assert tuple(cfg.telemetry.bands.action.model_dump().values()) == ACTION_BANDS.edges
    assert tuple(cfg.telemetry.bands.value.model_dump().values()) == VALUE_BANDS.edges
    assert cfg.health_stop.include_value_head is False
    custom = config_from_dict({"telemetry": {"bands": {"value": {"healthy_max": 20, "elevated_max": 80}}}})
    assert custom.telemetry.bands.value.healthy_max == 20.0 and custom.telemetry.bands.action.elevated_max == 5.0
    settings = build_ppo_config(custom).learner_config_dict[LEARNER_CONFIG_KEY]
    assert BandSet.from_dict(settings["bands"]) == BandSet(ACTION_BANDS, HealthBands(0.01, 0.1, 20.0, 80.0))


@pytest.mark.e2e  # a subprocess: a fresh interpreter
def test_config_validation_imports_neither_the_probe_nor_torch_nor_ray():
    import subprocess
    import sys

    code = (
        "import sys; from gradmon_ray.config import config_from_dict; "
        "config_from_dict({'regularizers': [{'name': 'logit_l2'}, {'name': 'u', 'fn': 'json:dumps'}]}); "
        "print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'ray') or m.startswith('gradmon_ray.probe')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_builtin_regularizer_names_match_the_probe_table():
    from gradmon_ray.import_paths import BUILTIN_REGULARIZER_NAMES
    from gradmon_ray.losses.regularizers import BUILTIN_REGULARIZERS

    assert tuple(BUILTIN_REGULARIZERS) == BUILTIN_REGULARIZER_NAMES


def _leaf_paths(model, prefix=""):
    from pydantic import BaseModel

    for name, info in model.model_fields.items():
        tp = info.annotation
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            yield from _leaf_paths(tp, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_every_field_refuses_a_wrong_type_with_one_line_naming_it():
    """Every leaf field of every section, one after the other: a set (no field takes one) is
    refused with one line that names the field.  All failing fields are listed at once."""
    from gradmon_ray.config import apply_overrides

    paths = sorted(_leaf_paths(GradmonConfig))
    assert len(paths) > 80, paths  # the walk reaches every section
    failures = []
    for path in paths:
        try:
            config_from_dict(apply_overrides({}, {path: {1, 2}}))
        except ConfigError as error:
            text = str(error)
            if error.field_path != path:
                failures.append(f"{path}: the error names {error.field_path!r}: {text!r}")
            elif not (text.startswith(f"{path}: must be ") and text.endswith(", got {1, 2}")) or "\n" in text:
                failures.append(f"{path}: {text!r}")
        else:
            failures.append(f"{path}: a set was accepted")
    assert not failures, f"{len(failures)} of {len(paths)} fields:\n" + "\n".join(failures)


def test_sections_are_changed_in_place_with_validation():
    cfg = config_from_dict({})
    cfg.telemetry.fused_optimizer = False
    cfg.vgs.alpha = 5  # an integer is a number
    assert cfg.telemetry.fused_optimizer is False and cfg.vgs.alpha == 5.0 and isinstance(cfg.vgs.alpha, float)
    with pytest.raises(
        ConfigError, match=r"^ppo\.minibatch_size: must be <= ppo\.train_batch_size \(1024\), got 4096$"
    ):
        cfg.ppo.minibatch_size = 4096
    with pytest.raises(ConfigError, match=r"^vgs\.alpha: must be >= 0\.0, got -1$"):
        cfg.vgs.alpha = -1
    with pytest.raises(ConfigError, match=r"^telemetry\.bands\.value\.healthy_max: cannot be changed in place"):
        cfg.telemetry.bands.value.healthy_max = 20.0  # an edge set is one value: replace it whole
    cfg.telemetry.bands = {"value": {"healthy_max": 20, "elevated_max": 80}}
    assert cfg.telemetry.bands.value.healthy_max == 20.0 and cfg.telemetry.bands.action.elevated_max == 5.0
    assert cfg.ppo.minibatch_size == 128 and cfg.vgs.alpha == 5.0  # a refused assignment changes nothing


def test_validate_config_checks_across_sections_after_a_change():
    from gradmon_ray.config import validate_config

    cfg = config_from_dict({"regularizers": [{"name": "logit_l2"}], "probe": {"track_grad_norms": True}})
    validate_config(cfg)
    with pytest.raises(ConfigError, match=r"^probe\.track_grad_norms: is true but no enabled entry"):
        cfg.regularizers = []  # an assignment on the whole config is checked across sections at once
    assert len(cfg.regularizers) == 1
    plain = config_from_dict({})
    plain.probe.track_grad_norms = True  # a section alone cannot see the regularizers
    with pytest.raises(ConfigError, match=r"^probe\.track_grad_norms: is true but no enabled entry"):
        validate_config(plain)


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"model": {"head_logit_scale": {"op": 0}}}, "model.head_logit_scale.op", "must be > 0.0, got 0"),
        ({"model": {"head_logit_scale": {7: 2.0}}}, "model.head_logit_scale", "keys must be strings, got 7"),
        ({"model": {"head_logit_scale": [1.0]}}, "model.head_logit_scale", "must be a mapping of strings to numbers"),
        ({"model": {"head_names": []}}, "model.head_names", "must be a non-empty list of distinct head names or null"),
        ({"model": {"head_names": ["", "b"]}}, "model.head_names[0]", "must be a non-empty string, got ''"),
        ({"env": {"config": {"a": [1, {2: 3}]}}}, "env.config.a", "must be plain data"),
        ({"env": {"config": {"a": float("inf")}}}, "env.config.a", "must be a finite number, got inf"),
        ({"env": {"id": 3}}, "env.id", "must be a non-empty string, got 3"),
        (
            {"regularizers": [{"name": "x", "fn": "json:decoder"}]},
            "regularizers[0].fn",
            "'json:decoder' is not callable",
        ),
        ({"regularizers": [7]}, "regularizers[0]", "must be a mapping of name, fn, weight, enabled, got 7"),
        ({"resources": {"num_gpus_per_learner": 1.5}}, "resources.num_gpus_per_learner", "whole number, got 1.5"),
        ({"ppo": {"kl_target": float("nan")}}, "ppo.kl_target", "must be a finite number > 0.0, got nan"),
        ({"iterations": "3"}, "iterations", "must be an integer >= 1, got '3'"),
    ],
)
def test_dicts_lists_and_nullable_fields_are_checked(data, field, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert info.value.field_path == field and message in info.value.message, str(info.value)


def test_a_user_regularizer_resolves_without_the_probe():
    cfg = config_from_dict({"regularizers": [{"name": "mine", "fn": "tests.fixtures.user_envs:head_bias_l1"}]})
    assert cfg.regularizers[0].model_dump() == {
        "name": "mine",
        "fn": "tests.fixtures.user_envs:head_bias_l1",
        "weight": 1.0,
        "enabled": True,
    }


def test_vgs_combinations_known_to_cancel_get_one_line_each():
    from gradmon_ray.config import config_advisories

    quiet = config_from_dict({"vgs": {"enabled": True}})  # update mode: nothing cancels
    assert quiet.vgs.apply_to == "update" and config_advisories(quiet) == []
    assert config_advisories(config_from_dict({"vgs": {"enabled": False, "apply_to": "gradient"}})) == []
    both = config_advisories(config_from_dict({"vgs": {"enabled": True, "apply_to": "gradient"}}))
    assert len(both) == 2 and all("\n" not in line for line in both)
    assert "optimizer adam" in both[0] and "global_norm" in both[1]
    upgd_unclipped = {"vgs": {"enabled": True, "apply_to": "gradient"}, "optimizer": "upgd", "ppo": {"grad_clip": None}}
    assert config_advisories(config_from_dict(upgd_unclipped)) == []  # meaningful there
    with pytest.raises(ConfigError, match=r"vgs\.apply_to"):
        config_from_dict({"vgs": {"apply_to": "optimizer"}})


def test_a_minibatch_as_large_as_the_train_batch_is_allowed():
    cfg = config_from_dict({"ppo": {"train_batch_size": 256, "minibatch_size": 256}})
    assert cfg.ppo.minibatch_size == cfg.ppo.train_batch_size == 256
    with pytest.raises(ConfigError, match=r"ppo\.minibatch_size"):
        config_from_dict({"ppo": {"train_batch_size": 256, "minibatch_size": 257}})


@pytest.mark.parametrize(
    ("data", "ok"),
    [
        ({"vgs": {"beta": 0.0}}, True),  # min=0 is inclusive
        ({"vgs": {"beta": 0.999999}}, True),
        ({"vgs": {"beta": 1.0}}, False),  # exclusive max
        ({"ppo": {"gamma": 1.0}}, True),  # max=1 inclusive
        ({"ppo": {"gamma": 1.0000001}}, False),
        ({"ppo": {"clip_param": 0.0}}, False),  # exclusive min
        ({"ppo": {"entropy_coeff": 0.0}}, True),
        ({"ppo": {"minibatch_size": 1}}, True),
        ({"ppo": {"minibatch_size": 0}}, False),
    ],
)
def test_range_edges_are_inclusive_or_exclusive_as_documented(data, ok):
    if ok:
        config_from_dict(data)
    else:
        with pytest.raises(ConfigError):
            config_from_dict(data)


def test_the_update_ratio_band_needs_low_below_high_and_reaches_the_learner_settings():
    with pytest.raises(ConfigError, match="update_ratio"):
        config_from_dict({"telemetry": {"bands": {"update_ratio": {"low": 0.1, "high": 0.01}}}})
    cfg = config_from_dict({"telemetry": {"bands": {"update_ratio": {"low": 1e-5, "high": 0.5}}}})
    from gradmon_ray.rllib.config import build_ppo_config
    from gradmon_ray.rllib.settings import GradmonSettings

    settings = GradmonSettings.from_learner_config(build_ppo_config(cfg).learner_config_dict, full_learner=True)
    assert (settings.bands.update_ratio.low, settings.bands.update_ratio.high) == (1e-5, 0.5)


def test_a_long_bad_value_is_described_not_cut_so_no_part_of_a_secret_shows():
    """A value too long to show is not cut (a cut before the CLI masks could end inside a password):
    the error names what it is instead."""
    from gradmon_ray.config import ConfigError, config_from_dict

    secret = "s3cr3t-" + "x" * 60
    uri = "http://user:" + secret + "@mlflow.example:5000/" + "a" * 200
    with pytest.raises(ConfigError) as info:
        config_from_dict({"iterations": uri})
    message = str(info.value)
    assert message == f"iterations: must be an integer >= 1, got a str of {len(uri)} characters, too long to show"
    assert "s3cr" not in message and "user" not in message
