"""CLI: bad input exits 2 with one line and no traceback (real subprocesses)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gradmon_ray.cli import main


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradmon_ray.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


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


def test_bad_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo:\n  grad_clip_by: l1\n")
    assert main(["train", "--config", str(bad)]) == 2


def test_help_exits_0():
    proc = _cli("train", "--help")
    assert proc.returncode == 0 and "--mlflow-uri" in proc.stdout
