"""``app/sweep/run.py`` and ``app/sweep/config.py``: sweep files are validated before Ray starts, with one
line and status 2 on bad input; the search space becomes Tune domains."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from gradmon_ray.app.cli import main
from gradmon_ray.app.sweep.config import load_sweep, tune_search_space
from gradmon_ray.config import ConfigError, config_from_dict
from gradmon_ray.tracking.store_uri import absolute_tracking_uri

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def test_every_shipped_sweep_loads_and_tunes_own_draws_are_valid_run_configs():
    """Every sweep file shipped in ``tune_configs/`` (found by its ``search_space``, not by a list
    here) loads, and trials drawn by Tune's own sampling of its domains (``Domain.sample``, each
    ``grid_search`` value) are run configs that hold the drawn values.  Catches a shipped sweep
    that no longer loads, or one whose values inside a range the run config refuses (the loader
    checks the ends of a range only)."""
    import random

    import yaml

    from gradmon_ray.config.yaml_io import apply_overrides

    shipped = [
        p for p in sorted((ROOT / "tune_configs").glob("*.yaml")) if "search_space" in yaml.safe_load(p.read_text())
    ]
    assert len(shipped) >= 2, shipped  # the premise: the sweeps docs/operations.md names are found
    random.seed(0)
    for path in shipped:
        sweep, base = load_sweep(path)
        space = tune_search_space(sweep.search_space)
        for _ in range(20):
            drawn = {}
            for key, domain in space.items():
                if isinstance(domain, dict) and "grid_search" in domain:
                    drawn[key] = random.choice(domain["grid_search"])
                else:
                    drawn[key] = domain.sample() if hasattr(domain, "sample") else domain
            cfg = config_from_dict(apply_overrides(copy.deepcopy(base), drawn)).model_dump()
            for key, value in drawn.items():
                section, _, field = key.rpartition(".")
                held = cfg[section][field] if section else cfg[field]
                assert held == pytest.approx(value), (path.name, key, value, held)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("serch_space: {}", "serch_space: unknown key; allowed keys here: name, base_config"),
        ("search_space: {}", "search_space: is empty"),
        ("search_space: {ppo.lrr: {choice: [1]}}", "search_space.ppo.lrr: ppo.lrr: unknown key"),
        ("search_space: {ppo.lr: {choice: [-1.0]}}", "search_space.ppo.lr: ppo.lr: must be > 0.0, got -1.0"),
        ("search_space: {ppo.lr: {uniform: [1]}}", "search_space.ppo.lr: uniform needs \\[low, high\\] numbers"),
        ("search_space: {ppo.lr: {uniform: [0.1, 0.01]}}", "uniform needs low < high"),
        ("search_space: {ppo.lr: {loguniform: [0.0, 0.01]}}", "loguniform needs 0 < low"),
        ("search_space: {ppo.lr: {normal: [0, 1]}}", "must be a constant or one of \\{choice \\| grid"),
        ("search_space: {ppo.lr: {choice: []}}", "^search_space.ppo.lr: choice needs a non-empty list, got \\[\\]$"),
        ("search_space: {ppo.lr: {uniform: [true, 2]}}", "^search_space.ppo.lr: uniform needs \\[low, high\\] numbers"),
        ("search_space: {model.activation: {grid: [tanh, gelu]}}", "model.activation: must be one of"),
        ("mode: maximum\nsearch_space: {ppo.lr: 0.001}", "mode: must be one of 'max', 'min'"),
        ("base: {ppo: {num_epochs: 0}}\nsearch_space: {ppo.lr: 0.001}", "ppo.num_epochs: must be >= 1"),
        ("base_config: nope.yaml\nsearch_space: {ppo.lr: 0.001}", "base_config: file not found"),
        ("- 1", "must hold a mapping"),
    ],
)
def test_bad_sweep_files_name_the_field(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(_write(tmp_path, text))


def test_cli_tune_bad_file_exits_2_with_one_line(tmp_path, capsys):
    assert main(["tune", str(_write(tmp_path, "search_space: {ppo.lrr: {choice: [1]}}"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gradmon-ray: config error: search_space.ppo.lrr:")
    assert main(["tune", str(tmp_path / "missing.yaml")]) == 2


def test_search_space_becomes_tune_domains():
    from ray import tune

    space = tune_search_space(
        {
            "a": {"choice": [1, 2]},
            "b": {"grid": [3, 4]},
            "c": {"uniform": [0.0, 1.0]},
            "d": {"loguniform": [1e-4, 1e-2]},
            "e": 5,
        }
    )
    assert isinstance(space["a"], tune.search.sample.Categorical) and space["a"].categories == [1, 2]
    assert space["b"] == {"grid_search": [3, 4]}
    assert (space["c"].lower, space["c"].upper) == (0.0, 1.0)
    assert isinstance(space["d"].get_sampler(), tune.search.sample.LogUniform) and space["e"] == 5


def test_relative_tracking_uris_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_tracking_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert absolute_tracking_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert absolute_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert absolute_tracking_uri("mlruns") == os.path.join(str(tmp_path), "mlruns")


def test_sweep_file_with_exponent_floats(tmp_path):
    """Exponent floats without a dot (``1e-4``) in a base config, a grid, a choice and a range."""
    (tmp_path / "base.yaml").write_text("iterations: 2\nppo:\n  lr: 3e-4\n")
    path = _write(
        tmp_path,
        "base_config: base.yaml\n"
        "base: {vgs: {eps: 1e-8}}\n"
        "search_space:\n"
        "  ppo.lr: {grid: [1e-4, 3E-4, 1.0e-3]}\n"
        "  ppo.entropy_coeff: {choice: [0, 1e-3, .5e-2]}\n"
        "  ppo.kl_target: {loguniform: [1e-3, 1e-1]}\n",
    )
    sweep, base = load_sweep(path)
    assert base["ppo"]["lr"] == 3e-4 and base["vgs"]["eps"] == 1e-8
    assert sweep.search_space["ppo.lr"] == {"grid": [1e-4, 3e-4, 1e-3]}
    assert sweep.search_space["ppo.entropy_coeff"] == {"choice": [0, 1e-3, 5e-3]}
    assert tune_search_space(sweep.search_space)["ppo.lr"] == {"grid_search": [1e-4, 3e-4, 1e-3]}


def test_cli_tune_takes_set_and_iterations_into_every_trial_base(monkeypatch, tmp_path, capsys):
    """``gradmon-ray tune FILE --set K=V --iterations N`` shrinks a sweep without a new file: the
    base config every trial starts from carries them; a bad --set key exits 2 before Ray starts."""
    from types import SimpleNamespace

    import gradmon_ray.app.sweep.run

    seen = {}

    def fake_run_sweep(sweep, base, progress=None, cfg=None):
        seen["base"], seen["cfg"] = base, cfg
        return SimpleNamespace(parent_run_id="p", best=None, trials=[SimpleNamespace(status="finished")])

    monkeypatch.setattr(gradmon_ray.app.sweep.run, "run_sweep", fake_run_sweep)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    argv = ["tune", "tune_configs/vgs_sweep.yaml", "--mlflow-uri", uri, "--iterations", "2"]
    argv += ["--set", "ppo.train_batch_size=256", "--set", "ppo.minibatch_size=64"]
    assert main(argv) == 0, capsys.readouterr().err
    cfg = config_from_dict(seen["base"])
    assert cfg.iterations == 2 and cfg.ppo.train_batch_size == 256 and cfg.ppo.minibatch_size == 64
    assert cfg.vgs.enabled  # the sweep file's own base survives
    assert seen["cfg"] == cfg  # the command's one validation of the base is handed down, not redone
    assert main([*argv, "--set", "ppo.lrr=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ppo.lrr: unknown key" in err, err


def test_custom_resources_reach_each_actor_kinds_own_bundles():
    """Learner, EnvRunner and probe bundles each carry their kind's custom resources, so under Tune's
    placement group each actor fits only its own bundle (the multi-node e2e test checks the nodes)."""
    from gradmon_ray.app.resource_wait import requested_resources
    from gradmon_ray.app.sweep.run import _trial_resources
    from gradmon_ray.rllib.config import build_ppo_config

    cfg = config_from_dict(
        {
            "resources": {
                "num_learners": 2,
                "num_env_runners": 3,
                "custom_resources_per_learner": {"learner_node": 1},
                "custom_resources_per_env_runner": {"runner_node": 0.5},
            },
            "probe": {"gradient_analysis_every": 2, "custom_resources": {"probe_node": 1}},
        }
    )
    bundles = _trial_resources(cfg, build_ppo_config).bundles
    assert bundles[0] == {"CPU": 1.0}  # the trial's own process: no custom resource, any node with a CPU
    assert sorted(b.get("learner_node", 0) for b in bundles) == [0] * 5 + [1, 1]
    assert sorted(b.get("runner_node", 0) for b in bundles) == [0] * 4 + [0.5] * 3
    assert [b for b in bundles if "probe_node" in b] == [{"CPU": 1.0, "probe_node": 1.0}]
    assert all(len({"learner_node", "runner_node", "probe_node"} & set(b)) <= 1 for b in bundles)
    request = requested_resources(cfg)
    assert request["learner_node"] == 2.0 and request["runner_node"] == 1.5 and request["CPU"] == 5.0


def test_every_tune_report_carries_the_sweep_metric():
    """Tune fails the whole sweep on a result without its metric: an iteration that trained nothing
    (its EnvRunner's node lost) repeats the last value, NaN before the first, and never ranks."""
    import math

    from gradmon_ray.app.sweep.trials import MetricCarry

    carry = MetricCarry("env/episode_return_mean")
    first = carry.fill({"update/trained": 0.0})
    assert math.isnan(first["env/episode_return_mean"]) and first["update/trained"] == 0.0
    assert carry.fill({"env/episode_return_mean": 2.5, "update/trained": 1.0})["env/episode_return_mean"] == 2.5
    measured = {"update/trained": 0.0}
    assert carry.fill(measured) == {"update/trained": 0.0, "env/episode_return_mean": 2.5}
    assert measured == {"update/trained": 0.0}  # the caller's dict (MLflow's copy) is not changed


def test_a_checkpoint_whose_learner_state_is_missing_is_torn(tmp_path):
    """RLlib writes a learner's subcomponents first and its ``state.pkl`` last: a learner lost mid-save
    leaves the folder without it (seen in the multi-node fault test), and every retry would fail on it."""
    from gradmon_ray.app.sweep.trials import torn_learner_state

    learner = tmp_path / "learner_group" / "learner"
    (learner / "rl_module").mkdir(parents=True)
    assert torn_learner_state(tmp_path)
    (learner / "state.pkl").write_bytes(b"x")
    assert not torn_learner_state(tmp_path)
    assert not torn_learner_state(tmp_path / "no-learner-group")  # remote learners' state saved elsewhere
