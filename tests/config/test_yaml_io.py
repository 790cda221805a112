"""``config/yaml_io.py`` and ``load_config``: YAML 1.2 floats, safe loading only, bad files, empty
sections, and dotted ``--set`` overrides."""

from __future__ import annotations

import pytest

from gradmon_ray.config import ConfigError, load_config


def test_ints_accepted_for_floats_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  lr: 1\n")
    cfg = load_config(path, {"ppo.entropy_coeff": 0, "iterations": 3, "env.config.num_tasks": 4})
    assert cfg.ppo.lr == 1.0 and isinstance(cfg.ppo.lr, float)
    assert cfg.iterations == 3 and cfg.env.config == {"num_tasks": 4}


@pytest.mark.parametrize(("text", "fragment"), [("[1, 2]", "mapping at the top level"), ("a: [", "not valid YAML")])
def test_bad_files(tmp_path, text, fragment):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_config(path)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1e-3", 0.001),
        ("3E+4", 30000.0),
        ("-2.5e-2", -0.025),
        ("+1e3", 1000.0),
        (".5", 0.5),
        ("-.5", -0.5),
        ("1.", 1.0),
        ("1.0e3", 1000.0),  # YAML 1.1 wants a sign in the exponent
        ("1.5E-3", 0.0015),
        ("3.0e-4", 3e-4),
        ("1_000.5", 1000.5),  # YAML 1.1 forms still work
        (".inf", float("inf")),
    ],
)
def test_yaml_reads_yaml_1_2_floats(text, expected):
    from gradmon_ray.config import load_yaml

    value = load_yaml(f"x: {text}")["x"]
    assert isinstance(value, float) and value == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("3", 3), ("-3", -3), ("0x1F", 31), ("e3", "e3"), ("1e", "1e"), ("1.2.3", "1.2.3"), ("'1e-3'", "1e-3")],
)
def test_yaml_ints_and_strings_stay_what_they_were(text, expected):
    from gradmon_ray.config import load_yaml

    value = load_yaml(f"x: {text}")["x"]
    assert value == expected and type(value) is type(expected)


def test_yaml_loader_stays_safe():
    import yaml

    from gradmon_ray.config import YamlLoader, load_yaml

    assert issubclass(YamlLoader, yaml.SafeLoader)
    with pytest.raises(yaml.constructor.ConstructorError):
        load_yaml("x: !!python/object/apply:os.system ['true']")
    assert yaml.SafeLoader.resolve(yaml.SafeLoader, yaml.ScalarNode, "1e-3", (True, False)).endswith(":str")


def test_config_file_with_exponent_floats(tmp_path):
    """``lr: 3e-4`` (no dot) was the string '3e-4' to YAML 1.1, and rejected."""
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  lr: 3e-4\n  entropy_coeff: 1E-2\n  kl_target: .5e-2\nvgs:\n  eps: 1e-8\n")
    cfg = load_config(path)
    assert cfg.ppo.lr == 3e-4 and cfg.ppo.entropy_coeff == 0.01 and cfg.ppo.kl_target == 0.005
    assert cfg.vgs.eps == 1e-8


def test_an_empty_section_means_its_defaults_and_configs_pickle(tmp_path):
    import copy
    import pickle

    path = tmp_path / "c.yaml"
    path.write_text("vgs:\nppo:\n  lr: 1e-3\n")
    cfg = load_config(path, {"vgs.enabled": True})
    assert cfg.vgs.enabled and cfg.vgs.beta == 0.99 and cfg.ppo.lr == 1e-3
    assert pickle.loads(pickle.dumps(cfg)) == cfg == copy.deepcopy(cfg)
