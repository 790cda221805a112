"""``app/cli.py``: bad input exits 2 with one line and no traceback: two cases in a real subprocess
(``e2e``: a config error returned by ``main`` and an argparse error, the two ways out of the process
with status 2), the rest through ``main`` in this process (the table of refused config values is
``test_bad_inputs.py``); ``--set`` takes the help text's own example."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gradmon_ray.app.cli import build_parser, main

CONFIG_ERROR = "gradmon-ray: config error: "


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradmon_ray.app.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def _one_clear_line(returncode: object, stderr: str, expected: str, cwd: Path) -> None:
    assert returncode == 2, stderr
    assert stderr.startswith(expected), stderr
    assert "Traceback" not in stderr
    # A config error is one line; argparse's adds one line of usage hint (test_usage_errors_name_the_right_command).
    assert len(stderr.strip().splitlines()) == (1 if expected.startswith(CONFIG_ERROR) else 2), stderr
    assert not (cwd / "mlflow.db").exists()  # nothing started


@pytest.mark.e2e  # subprocesses: each imports torch, RLlib and MLflow (about 2 CPU-s), so one per way out
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "--set", "ppo.lrr=1"], f"{CONFIG_ERROR}ppo.lrr: unknown key; allowed keys here: lr,"),
        (["train", "--iterations", "x"], "gradmon-ray: argument --iterations: invalid int value: 'x'"),
    ],
    ids=["config-error", "argparse-error"],
)
def test_bad_input_exits_2_with_one_clear_line_from_a_process(args, expected, tmp_path):
    proc = _cli(*args, cwd=tmp_path)
    _one_clear_line(proc.returncode, proc.stderr, expected, tmp_path)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "--set", "ppo.minibatch_size=-3"], f"{CONFIG_ERROR}ppo.minibatch_size: must be >= 1"),
        (["train", "--num-learners", "-1"], f"{CONFIG_ERROR}resources.num_learners: must be >= 0"),
        (["train", "--config", "nope.yaml"], f"{CONFIG_ERROR}--config: file not found: nope.yaml"),
        (["train", "--set", "novalue"], f"{CONFIG_ERROR}--set: expected KEY=VALUE"),
        (["frobnicate"], "gradmon-ray: argument command: invalid choice"),
    ],
    ids=["set-negative", "flag-negative", "config-not-found", "set-without-value", "unknown-command"],
)
def test_bad_input_exits_2_with_one_clear_line(args, expected, tmp_path, monkeypatch, capsys):
    """The same through ``main`` in this process (argparse's errors leave it as ``SystemExit``)."""
    monkeypatch.chdir(tmp_path)  # ``nope.yaml`` is looked up here, and nothing may be created here
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        code: object = main(args)
    except SystemExit as exc:
        code = exc.code
    _one_clear_line(code, capsys.readouterr().err, expected, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_value_in_a_config_file_is_one_line_naming_the_field(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo:\n  grad_clip_by: l1\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "gradmon-ray: config error: ppo.grad_clip_by: must be one of 'global_norm', 'norm', 'value', got 'l1'"
    ), err
    assert list(tmp_path.iterdir()) == [bad]  # no mlflow.db: nothing started


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0 and "--mlflow-uri" in capsys.readouterr().out


def test_set_takes_the_help_texts_own_exponent_float(monkeypatch, tmp_path, capsys):
    """``--set ppo.lr=1e-3`` (the --help and README example) reaches training as 0.001."""
    from types import SimpleNamespace

    import gradmon_ray.app.train.run

    seen = {}

    def fake_run_training(cfg, progress=None, checked=False):
        seen["cfg"] = cfg
        return SimpleNamespace(run_id="r", mlflow_complete=True, checkpoint_path=None)

    monkeypatch.setattr(gradmon_ray.app.train.run, "run_training", fake_run_training)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    args = ["train", "--mlflow-uri", uri, "--set", "ppo.lr=1e-3", "--set", "ppo.kl_target=.5e-2"]
    args += ["--set", "vgs.eps=2.5E-8"]
    assert main(args) == 0, capsys.readouterr().err
    cfg = seen["cfg"]
    assert cfg.ppo.lr == 1e-3 and cfg.ppo.kl_target == 0.005 and cfg.vgs.eps == 2.5e-8
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    (set_flag,) = [a for a in train._actions if "--set" in a.option_strings]
    assert "--set ppo.lr=1e-3" in set_flag.help  # the example this test runs
