"""Issue #8 fault 7: bad inputs, table-driven, through the real CLI entry point (``app/cli.py``).

Every case must exit 2 with ONE line on stderr that names the problem, print no traceback,
and leave no MLflow store behind (no half-made run): the checks run before Ray or MLflow
start.  The restore cases that read a checkpoint use a real one written by real RLlib training
on a local Ray: only they (marked ``e2e``) ask for it, so the rest of the table runs in the fast
lane (an empty directory given as ``restore_from`` included: refused before anything is loaded).
"""

from __future__ import annotations

import datetime
import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from gradmon_ray.app.cli import main
from gradmon_ray.config import ConfigError, config_from_dict
from gradmon_ray.rllib import build_ppo_config
from gradmon_ray.rllib.preflight import LEARNER_SUBDIR, check_restore_point

SMALL = {
    "iterations": 1,
    "ppo": {"train_batch_size": 128, "minibatch_size": 64, "num_epochs": 1},
    "model": {"trunk_hiddens": [16]},
    "vgs": {"enabled": True, "warmup_steps": 1},
    "resources": {"num_env_runners": 0},
}


def _merge(base: dict, extra: dict) -> dict:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in extra.items():
        out[key] = (
            _merge(out.get(key, {}), value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


@pytest.fixture(scope="module")
def checkpoints(ray_session, tmp_path_factory):
    """A real algorithm checkpoint of SMALL after one iteration, and a copy whose VGS state is
    rewritten into the seed's old spatial format (no per-parameter statistics)."""
    root = tmp_path_factory.mktemp("ckpt")
    algo = build_ppo_config(config_from_dict(_merge(SMALL, {}))).build_algo()
    try:
        algo.train()
        good = Path(algo.save_to_path(str(root / "good")))
    finally:
        algo.stop()
    old = root / "old_vgs"
    shutil.copytree(good, old)
    state_file = old / LEARNER_SUBDIR / "state.pkl"
    with state_file.open("rb") as f:  # our own checkpoint, written a moment ago
        state = pickle.load(f)
    vgs = state["gradmon_vgs"]
    vgs = vgs.get("default_policy", vgs)  # the learner keys its gradmon state by module now
    # Written back unkeyed, as the seed wrote it: a single-module state is read as that module's.
    state["gradmon_vgs"] = {k: vgs[k] for k in ("enabled", "beta", "alpha", "eps", "warmup_steps", "step_count")}
    state["gradmon_vgs"].update(grad_mean_ema=0.0, grad_var_ema=1e-4, grad_norm_ema=0.5, grad_max_ema=0.1)
    with state_file.open("wb") as f:
        pickle.dump(state, f)
    return {"good": good, "old_vgs": old}


EMPTY_DIR = "@empty"
"""``restore_from`` of a row: an empty directory, made for the row (no Ray: the fast lane)."""


# (case id, config overrides, extra CLI args, expected stderr fragment)
CASES = [
    ("unknown-top-key", {"iterationz": 3}, [], "iterationz: unknown key"),
    ("unknown-nested-key", {"ppo": {"lrr": 1e-3}}, [], "ppo.lrr: unknown key"),
    ("wrong-type-int", {"iterations": "ten"}, [], "iterations:"),
    ("wrong-type-list", {"model": {"trunk_hiddens": 64}}, [], "model.trunk_hiddens:"),
    ("negative-size", {"ppo": {"minibatch_size": -1}}, [], "ppo.minibatch_size: must be >= 1"),
    ("zero-size", {"ppo": {"train_batch_size": 0}}, [], "ppo.train_batch_size: must be >= 1"),
    ("zero-width", {"model": {"trunk_hiddens": [0]}}, [], "model.trunk_hiddens"),
    ("nan-lr", {"ppo": {"lr": float("nan")}}, [], "ppo.lr:"),
    ("inf-gamma", {"ppo": {"gamma": float("inf")}}, [], "ppo.gamma:"),
    (
        "minibatch-over-batch",
        {"ppo": {"minibatch_size": 256}},
        [],
        "ppo.minibatch_size: must be <= ppo.train_batch_size",
    ),
    ("bad-activation", {"model": {"activation": "gelu"}}, [], "model.activation"),
    ("bad-optimizer", {"optimizer": "sgd"}, [], "optimizer"),
    ("vgs-beta-one", {"vgs": {"beta": 1.0}}, [], "vgs.beta"),
    ("bad-backend", {"distributed": {"backend": "mpi"}}, [], "distributed.backend"),
    ("zero-buckets", {"probe": {"num_buckets": 0}}, [], "probe.num_buckets"),
    ("zero-queue", {"mlflow": {"queue_size": 0}}, [], "mlflow.queue_size"),
    ("negative-gpus", {"resources": {"num_gpus_per_learner": -1}}, [], "resources.num_gpus_per_learner"),
    ("negative-logit-scale", {"model": {"head_logit_scale": {"op": -1.0}}}, [], "model.head_logit_scale.op"),
    ("regularizer-reserved-name", {"regularizers": [{"name": "value", "fn": "l2"}]}, [], "regularizers[0].name"),
    ("regularizer-missing-fn", {"regularizers": [{"name": "r", "fn": "nope.mod:fn"}]}, [], "regularizers[0].fn"),
    (
        "head-names-not-in-action-space",
        {"model": {"head_names": ["a", "b"]}},
        [],
        "model.head_names: ['a', 'b'] do not match the Dict action keys",
    ),
    (
        "logit-scale-unknown-head",
        {"model": {"head_logit_scale": {"nohead": 2.0}}},
        [],
        "model.head_logit_scale: unknown heads ['nohead']",
    ),
    (
        "unsupported-action-space",
        {"env": {"id": "tests.fixtures.user_envs:ContinuousActionEnv"}},
        [],
        "supports Dict-of-Discrete, MultiDiscrete and Discrete action spaces",
    ),
    ("env-not-importable", {"env": {"id": "nope.module:Env"}}, [], "env.id: cannot import 'nope.module:Env'"),
    (
        "env-constructor-fails",
        {"env": {"id": "tests.fixtures.user_envs:BrokenEnv"}},
        [],
        "env: cannot create env 'tests.fixtures.user_envs:BrokenEnv': FileNotFoundError: simulator binary",
    ),
    (
        "bands-not-increasing",
        {"telemetry": {"bands": {"value": {"healthy_max": 60.0}}}},
        [],
        "telemetry.bands.value.elevated_max: must be > healthy_max (60.0; edges strictly increase), got 50.0",
    ),
    (
        "bands-equal-edges",
        {"telemetry": {"bands": {"action": {"dead_below": 0.1}}}},
        [],
        "telemetry.bands.action.weak_below: must be > dead_below (0.1; edges strictly increase), got 0.1",
    ),
    (
        "cli-set-bands-not-increasing",
        {},
        ["--set", "telemetry.bands.action.weak_below=3e0"],
        "telemetry.bands.action.healthy_max: must be > weak_below (3.0; edges strictly increase), got 2.0",
    ),
    ("cli-iterations-zero", {}, ["--iterations", "0"], "iterations: must be >= 1"),
    ("cli-set-without-value", {}, ["--set", "ppo.lr"], "--set: expected KEY=VALUE"),
    ("cli-set-bad-yaml", {}, ["--set", "ppo.lr=[1,"], "ppo.lr: value '[1,' is not valid YAML"),
    ("restore-missing-dir", {"restore_from": "/nonexistent/ckpt"}, [], "restore_from: no such checkpoint directory"),
    ("restore-not-a-checkpoint", {"restore_from": EMPTY_DIR}, [], "is not an RLlib algorithm checkpoint"),
    (
        "restore-different-model",
        {"restore_from": "@good", "model": {"trunk_hiddens": [32]}},
        [],
        "does not fit this config's model: size mismatch for trunk.0.weight",
    ),
    ("restore-old-vgs-format", {"restore_from": "@old_vgs"}, [], "old-format (spatial) VGS state"),
    # Dict keys and values, lists of strings and nullable fields: checked by type, not passed through.
    (
        "logit-scale-not-a-number",
        {"model": {"head_logit_scale": {"op": "big"}}},
        [],
        "model.head_logit_scale.op: must be a number > 0.0, got 'big'",
    ),
    (
        "logit-scale-int-key",
        {"model": {"head_logit_scale": {0: 2.0}}},
        [],
        "model.head_logit_scale: keys must be strings, got 0",
    ),
    ("env-config-int-key", {"env": {"config": {1: 2}}}, [], "env.config: keys must be strings, got 1"),
    (
        "env-config-not-a-mapping",
        {"env": {"config": [1, 2]}},
        [],
        "env.config: must be a mapping of strings to plain data",
    ),
    (
        "env-config-nested-int-key",
        {"env": {"config": {"op_probs": {0: 0.5}}}},
        [],
        "env.config.op_probs: must be plain data (strings, finite numbers, true/false, null, lists, and mappings "
        "with string keys), got {0: 0.5}",
    ),
    (
        "env-config-date-value",
        {"env": {"config": {"start": datetime.date(2024, 1, 1)}}},
        [],
        "env.config.start: must be plain data",
    ),
    (
        "head-names-not-a-list",
        {"model": {"head_names": "op"}},
        [],
        "model.head_names: must be a list of non-empty strings or null, got 'op'",
    ),
    (
        "head-names-item-not-a-string",
        {"model": {"head_names": ["a", 3]}},
        [],
        "model.head_names[1]: must be a non-empty string, got 3",
    ),
    (
        "head-names-duplicate",
        {"model": {"head_names": ["a", "a"]}},
        [],
        "model.head_names: must be distinct head names",
    ),
    (
        "run-name-not-a-string",
        {"mlflow": {"run_name": 7}},
        [],
        "mlflow.run_name: must be a non-empty string or null, got 7",
    ),
    ("seed-not-an-integer", {"seed": 1.5}, [], "seed: must be an integer >= 0 or null, got 1.5"),
    ("grad-clip-string", {"ppo": {"grad_clip": "off"}}, [], "ppo.grad_clip: must be a number > 0.0 or null, got 'off'"),
    ("inf-lr", {"ppo": {"lr": float("inf")}}, [], "ppo.lr: must be a finite number > 0.0, got inf"),
    (
        "nan-regularizer-weight",
        {"regularizers": [{"name": "logit_l2", "weight": float("nan")}]},
        [],
        "regularizers[0].weight: must be a finite number, got nan",
    ),
    ("regularizer-missing-name", {"regularizers": [{"fn": "logit_l2"}]}, [], "regularizers[0].name: is required"),
    (
        "regularizer-fn-not-a-string",
        {"regularizers": [{"name": "r", "fn": 3}]},
        [],
        "regularizers[0].fn: must be a non-empty string or null, got 3",
    ),
    (
        "regularizer-module-fails-on-import",
        {"regularizers": [{"name": "r", "fn": "tests.fixtures.broken_import:fn"}]},
        [],
        "regularizers[0].fn: regularizer 'r': cannot import 'tests.fixtures.broken_import:fn': RuntimeError: simulator",
    ),
    ("section-not-a-mapping", {"vgs": [1]}, [], "vgs: must be a mapping of enabled, beta, alpha"),
    ("bool-as-string", {"telemetry": {"enabled": "yes"}}, [], "telemetry.enabled: must be true or false, got 'yes'"),
    (
        "cli-set-logit-scale-zero",
        {},
        ["--set", "model.head_logit_scale.op=0"],
        "model.head_logit_scale.op: must be > 0.0, got 0",
    ),
    # A local MLflow store that can never work: refused before training, nothing created.
    (
        "store-dir-not-creatable",
        {},
        ["--mlflow-uri", "file:///proc/mlruns"],
        "mlflow.tracking_uri: file:///proc/mlruns: /proc is a directory nothing can be created in",
    ),
    (
        "sqlite-store-under-a-file",
        {},
        ["--mlflow-uri", "sqlite:////proc/version/mlflow.db"],
        "mlflow.tracking_uri: sqlite:////proc/version/mlflow.db: /proc/version is not a directory",
    ),
    # The checkpoint root is written after a whole iteration: checked up front, never created (issue #37 item 8).
    (
        "checkpoint-dir-under-a-file",
        {"checkpoint_dir": "/proc/version/ckpt"},
        [],
        "config error: checkpoint_dir: /proc/version/ckpt can never be created: /proc/version is a file, not a "
        "directory; give --checkpoint-dir a directory you can write to",
    ),
    (
        "cli-checkpoint-dir-is-a-file",
        {},
        ["--checkpoint-dir", "/proc/version"],
        "config error: checkpoint_dir: /proc/version is a file, not a directory; give --checkpoint-dir a directory "
        "you can write to",
    ),
    (
        "checkpoint-dir-nothing-can-be-made-in",  # /proc: not even root creates a directory there
        {"checkpoint_dir": "/proc/gradmon-ckpt/runs"},
        [],
        "config error: checkpoint_dir: /proc/gradmon-ckpt/runs can never be created: nothing can be created in "
        "/proc; give --checkpoint-dir a directory you can write to",
    ),
    (
        "learners-sharing-a-gpu",
        {"resources": {"num_learners": 2, "num_gpus_per_learner": 0.5}},
        [],
        "resources.num_gpus_per_learner: with 2 learners each needs a whole GPU",
    ),
    pytest.param(
        "gpu-not-on-this-machine",
        {"resources": {"num_gpus_per_learner": 1}},
        [],
        "resources.num_gpus_per_learner: 1 learner(s) x 1 GPU need 1 GPU(s) on this machine (local Ray), it has 0",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU (unit test below)"),
    ),
]


def _needs_a_checkpoint(overrides: dict) -> bool:
    restore = str(overrides.get("restore_from", ""))
    return restore.startswith("@") and restore != EMPTY_DIR


def _case(c):
    """A table row as a pytest param: (id, overrides, extra args, expected), or one wrapped in
    ``pytest.param`` to carry marks.  A row restoring a real checkpoint (``@name``) is ``e2e``."""
    if hasattr(c, "marks"):
        return pytest.param(*c.values[1:], id=c.values[0], marks=c.marks)
    marks = [pytest.mark.e2e] if _needs_a_checkpoint(c[1]) else []
    return pytest.param(*c[1:], id=c[0], marks=marks)


@pytest.mark.parametrize(("overrides", "extra", "expected"), [_case(c) for c in CASES])
def test_bad_input_exits_2_with_one_line_and_no_mlflow_run(overrides, extra, expected, request, tmp_path, capsys):
    data = _merge(SMALL, overrides)
    if data.get("restore_from") == EMPTY_DIR:
        (tmp_path / "not_a_checkpoint").mkdir()
        data["restore_from"] = str(tmp_path / "not_a_checkpoint")
    elif _needs_a_checkpoint(data):
        checkpoints = request.getfixturevalue("checkpoints")  # starts Ray: only these rows ask
        data["restore_from"] = str(checkpoints[data["restore_from"][1:]])
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    store = tmp_path / "mlflow.db"
    rc = main(["train", "--config", str(config), "--mlflow-uri", f"sqlite:///{store}", *extra])
    out, err = capsys.readouterr()
    err = err.strip()
    assert "training" not in out  # no banner before the check fails
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("gradmon-ray: config error: "), err
    assert expected in err, err
    assert "Traceback" not in err
    assert not store.exists()  # no MLflow run, not even an empty store


def test_the_table_is_at_least_25_cases():
    ids = [_case(c).id for c in CASES]
    assert len(CASES) >= 25 and len(set(ids)) == len(CASES)


def test_gpus_a_local_ray_would_need_are_counted():
    from gradmon_ray.rllib.preflight import check_local_gpus

    two = config_from_dict({"resources": {"num_learners": 2, "num_gpus_per_learner": 1}})
    check_local_gpus(two, visible=2)  # enough
    with pytest.raises(
        ConfigError, match=r"2 learner\(s\) x 1 GPU need 2 GPU\(s\) on this machine \(local Ray\), it has 1"
    ):
        check_local_gpus(two, visible=1)
    cluster = config_from_dict({"resources": {"num_gpus_per_learner": 1, "ray_address": "ray://head:10001"}})
    check_local_gpus(cluster, visible=0)  # a cluster's GPUs are the cluster's business
    check_local_gpus(config_from_dict({}), visible=0)  # CPU learners


@pytest.mark.parametrize("command", [["watch", "--once"], ["report", "0123abcd"]], ids=["watch", "report"])
def test_read_only_commands_never_create_a_store(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for extra in ([], ["--tracking-uri", f"sqlite:///{tmp_path / 'elsewhere.db'}"]):
        assert main([*command, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "no MLflow store at sqlite:///" in err, err
    assert list(tmp_path.iterdir()) == []  # no mlflow.db, nothing at all


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[str, str]:
    """``(tracking URI, run id)``: a finished run in a real sqlite store (made once: a new store costs seconds)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'm.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("gradmon-ray")).info.run_id
    client.set_terminated(run_id)
    return uri, run_id


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        ("/proc/rep", "/proc/rep can never be created: nothing can be created in /proc"),  # not even root
        ("{tmp}/a-file", "{tmp}/a-file is a file, not a directory"),
        ("{tmp}/a-file/rep", "{tmp}/a-file/rep can never be created: {tmp}/a-file is a file, not a directory"),
        ("/proc", "/proc is a directory nothing can be written to"),
        (None, "/proc is a directory nothing can be written to"),  # the default, gradmon-report-<id>, in cwd /proc
    ],
    ids=["missing-under-proc", "a-file", "under-a-file", "unwritable-directory", "default-in-unwritable-cwd"],
)
def test_report_out_that_cannot_be_written_is_one_line_before_mlflow_is_read(
    out, expected, finished_run, tmp_path, monkeypatch, capsys
):
    """Issue #47 item 7: ``report --out /proc/rep`` read the run, then exited 1 with ``FileNotFoundError``.
    A real run in a real store (today's code reads it and fails writing), then a server nobody answers
    (the check comes before MLflow is asked anything: not its "no server" line)."""
    from tests.e2e.processes import free_port

    uri, run_id = finished_run
    (tmp_path / "a-file").write_text("not a directory")
    if out is None:
        monkeypatch.chdir("/proc")
    flag = [] if out is None else ["--out", out.format(tmp=tmp_path)]
    for tracking_uri in (uri, f"http://127.0.0.1:{free_port()}"):
        rc = main(["report", run_id, *flag, "--tracking-uri", tracking_uri])
        err = capsys.readouterr().err.strip()
        assert rc == 2, err
        want = f"--out: {expected.format(tmp=tmp_path)}; give --out a directory you can write to"
        assert err == f"gradmon-ray: config error: {want}"  # one line, no traceback


@pytest.mark.parametrize(
    ("argv", "hint"), [([], "'gradmon-ray --help'"), (["train", "--bogus"], "'gradmon-ray train --help'")]
)
def test_usage_errors_name_the_right_command(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert hint in capsys.readouterr().err


def test_unreadable_yaml_and_non_mapping_yaml(tmp_path, capsys):
    for text, expected in (("ppo: [1, 2", "is not valid YAML"), ("- 1\n- 2\n", "must hold a mapping")):
        config = tmp_path / "run.yaml"
        config.write_text(text)
        assert main(["train", "--config", str(config), "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "m.db").exists()


@pytest.mark.e2e  # a real checkpoint from a local Ray
def test_a_fitting_checkpoint_passes_and_an_old_vgs_state_passes_when_accepted(checkpoints):
    check_restore_point(config_from_dict(_merge(SMALL, {"restore_from": str(checkpoints["good"])})))
    accepted = {"restore_from": str(checkpoints["old_vgs"]), "vgs": {"accept_old_checkpoint": True}}
    check_restore_point(config_from_dict(_merge(SMALL, accepted)))
    vgs_off = {"restore_from": str(checkpoints["old_vgs"]), "vgs": {"enabled": False}}
    check_restore_point(config_from_dict(_merge(SMALL, vgs_off)))  # VGS off: its state is irrelevant


@pytest.mark.e2e  # a real checkpoint from a local Ray
def test_restore_from_continues_the_checkpointed_run(checkpoints, tmp_path):
    """A real run from the checkpoint: the learner's own clock, VGS steps and weights carry on."""
    from mlflow.tracking import MlflowClient

    from gradmon_ray import metric_names as mn
    from gradmon_ray.app.train.run import run_training

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config_from_dict(
        _merge(SMALL, {"restore_from": str(checkpoints["good"]), "mlflow": {"tracking_uri": uri, "experiment": "r"}})
    )
    outcome = run_training(cfg, progress=None)
    run = MlflowClient(uri).get_run(outcome.run_id)
    assert run.data.tags[mn.TAG_RESTORED_FROM] == str(checkpoints["good"])
    assert run.data.metrics[mn.TELEMETRY_ITERATION] == 2.0  # iteration 1 came from the checkpoint
    assert run.data.metrics[mn.VGS_STEP_COUNT] > 2  # the checkpoint's steps plus this iteration's
    assert not math.isnan(run.data.metrics[mn.head_metric(mn.HEAD_GRAD_NORM_PREV, "op")])  # prev value restored


def test_a_relative_store_inside_a_job_working_dir_is_refused(tmp_path):
    """Under ``ray job submit`` the working directory is Ray's throwaway copy: a relative store
    there (the embedded default) would vanish with it; absolute paths and servers are fine."""
    from gradmon_ray.tracking.store_check import ephemeral_store_problem

    job_dir = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    problem = ephemeral_store_problem("sqlite:///mlflow.db", job_dir)
    assert problem is not None and "temporary working directory" in problem and str(job_dir) in problem
    assert ephemeral_store_problem("mlruns", job_dir) is not None  # a relative file store too
    assert ephemeral_store_problem(f"sqlite:///{tmp_path / 'm.db'}", job_dir) is None
    assert ephemeral_store_problem("http://head:5000", job_dir) is None
    assert ephemeral_store_problem("sqlite:///mlflow.db", tmp_path) is None  # an ordinary directory
