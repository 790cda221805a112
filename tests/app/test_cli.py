"""``app/cli.py``: bad input exits 2 with one line and no traceback, in a real subprocess (``e2e``:
the in-process table is ``test_bad_inputs.py``); ``--set`` takes the help text's own example."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gradmon_ray.app.cli import build_parser, main


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradmon_ray.app.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.mark.e2e  # subprocesses
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "--set", "ppo.lrr=1"], "gradmon-ray: config error: ppo.lrr: unknown key; allowed keys here: lr,"),
        (["train", "--set", "ppo.minibatch_size=-3"], "gradmon-ray: config error: ppo.minibatch_size: must be >= 1"),
        (["train", "--num-learners", "-1"], "gradmon-ray: config error: resources.num_learners: must be >= 0"),
        (["train", "--config", "nope.yaml"], "gradmon-ray: config error: --config: file not found: nope.yaml"),
        (["train", "--set", "novalue"], "gradmon-ray: config error: --set: expected KEY=VALUE"),
        (["train", "--iterations", "x"], "gradmon-ray: argument --iterations: invalid int value: 'x'"),
        (["frobnicate"], "gradmon-ray: argument command: invalid choice"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(args, expected, tmp_path):
    proc = _cli(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(expected), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "mlflow.db").exists()  # nothing started


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


@pytest.mark.e2e  # a subprocess
def test_help_exits_0():
    proc = _cli("train", "--help")
    assert proc.returncode == 0 and "--mlflow-uri" in proc.stdout


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
