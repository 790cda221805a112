"""``mlflow.spill_dir`` under ``ray job submit --working-dir``: Ray runs the job's driver in its own
copy of the working directory and deletes it, so a relative spill directory is taken from the
node's home instead (issue #47 item 1; the real job: tests/e2e/test_job_submit_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradmon_ray.app.train.messages import job_spill_line
from gradmon_ray.config import GradmonConfig, load_config
from gradmon_ray.config.sections import durable_job_path
from gradmon_ray.tracking.spill import default_spill_path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path("session_2026-11-29_03-57-00_1_2/runtime_resources/working_dir_files/_ray_pkg_d5c0fc8637ea1039")
"""Where Ray 2.60 unpacks a job's ``--working-dir`` (under its temp dir), as the e2e test saw it."""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


@pytest.fixture
def in_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory of a job's driver: Ray's copy of the shipped directory."""
    package = tmp_path / "ray" / PACKAGE
    package.mkdir(parents=True)
    monkeypatch.chdir(package)
    return package


@pytest.mark.parametrize(
    ("setting", "in_home"),
    [("gradmon-spill", "gradmon-spill"), ("spill/runs", "spill/runs"), ("./s", "s")],
)
def test_a_relative_spill_dir_in_a_job_is_in_the_nodes_home(home: Path, in_job: Path, setting: str, in_home: str):
    assert durable_job_path(setting) == str(home / in_home)
    assert GradmonConfig.model_validate({"mlflow": {"spill_dir": setting}}).mlflow.spill_dir == str(home / in_home)


def test_the_default_and_the_shipped_default_yaml_in_a_job(home: Path, in_job: Path):
    """Left out, and as tune_configs/default.yaml writes it (the docs' job command uses that file)."""
    assert load_config().mlflow.spill_dir == str(home / "gradmon-spill")
    assert load_config(ROOT / "tune_configs" / "default.yaml").mlflow.spill_dir == str(home / "gradmon-spill")
    assert load_config(None, {"mlflow.spill_dir": "other"}).mlflow.spill_dir == str(home / "other")


def test_an_absolute_spill_dir_in_a_job_stays_where_it_is(home: Path, in_job: Path, tmp_path: Path):
    assert durable_job_path(str(tmp_path / "shared")) == str(tmp_path / "shared")
    assert durable_job_path("~/mine") == "~/mine"  # home already: ~ is expanded where the file is made
    assert default_spill_path("~/mine", "r").parent == home / "mine"


def test_outside_a_job_a_relative_spill_dir_stays_relative(home: Path, tmp_path: Path, monkeypatch):
    # A directory that merely has one of Ray's names in its path is not a job's package.
    for cwd in (tmp_path, tmp_path / "working_dir_files" / "x", tmp_path / "runtime_resources"):
        cwd.mkdir(parents=True, exist_ok=True)
        monkeypatch.chdir(cwd)
        assert load_config().mlflow.spill_dir == "gradmon-spill"
        assert default_spill_path("gradmon-spill", "r").parent == cwd / "gradmon-spill"


def test_the_jobs_start_line_names_the_place_and_the_node(home: Path, in_job: Path, monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "ip-10-0-1-23")
    line = job_spill_line(load_config().mlflow.spill_dir)
    assert line == (
        f"gradmon-ray: iterations MLflow cannot take are kept in {home / 'gradmon-spill'} on node ip-10-0-1-23 "
        "(Ray deletes the job's directory)"
    )
    assert job_spill_line("gradmon-spill", cwd=home) is None  # not a job: the banner says nothing more


def test_a_jobs_checkpoints_go_to_the_nodes_home_and_resume_looks_there(home: Path, in_job: Path):
    """``./gradmon-checkpoints`` would be in Ray's copy too: a failed job's ``--resume`` had nothing to load."""
    from gradmon_ray.app.train.checkpoints import checkpoint_root
    from gradmon_ray.app.train.resume import allowed_root

    assert checkpoint_root(load_config()) == home / "gradmon-checkpoints"
    assert checkpoint_root(load_config(None, {"checkpoint_dir": "ckpt/runs"})) == home / "ckpt" / "runs"
    assert allowed_root() == (home / "gradmon-checkpoints").resolve()
    assert allowed_root(str(in_job.parent / "elsewhere")) == (in_job.parent / "elsewhere").resolve()


def test_the_callbacks_spill_dir_in_a_job_is_in_the_nodes_home(home: Path, in_job: Path):
    """``GradmonMLflowCallback`` pins its settings on the driver: a relative ``spill_dir`` there too."""
    from gradmon_ray.tracking.callback_settings import CallbackSettings, pinned_settings

    pinned = pinned_settings(CallbackSettings(tracking_uri="sqlite:////tmp/x.db", spill_dir="gradmon-spill"))
    assert pinned.spill_dir == str(home / "gradmon-spill")
