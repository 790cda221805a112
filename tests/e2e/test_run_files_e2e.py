"""What a default ``gradmon-ray train`` leaves on the terminal and on disk, read from the disk itself.

One CI-sized run in a subprocess, in an empty directory, with ``HOME`` an empty directory too (so
that everything the run writes there is visible): Ray's C++ actor restart notice is not in its
output but is in Ray's own driver log, no ``~/ray_results/<run>`` directory is left behind, and
every file or directory the run creates is one the README's "Files a run writes" list names.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from gradmon_ray.app.ray_noise import RAY_ACTOR_RESTART_NOTICE
from tests.e2e.processes import BIN, SMALL_TRAIN_ARGS, clean_env

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("files")
    cwd, home = tmp / "run", tmp / "home"
    cwd.mkdir()
    home.mkdir()
    proc = subprocess.run(
        [str(BIN / "gradmon-ray"), "train", *SMALL_TRAIN_ARGS],
        cwd=cwd,
        env=clean_env(HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    sessions = sorted(Path("/tmp/ray").glob("session_*"), key=lambda p: p.stat().st_mtime)
    return {"proc": proc, "cwd": cwd, "home": home, "sessions": sessions}


def _readme_files() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("### Files a run writes", 1)[1].split("\n#", 1)[0]


def test_the_run_succeeds_and_ray_did_log_the_restart_notice_to_its_own_file(default_run):
    proc = default_run["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The driver's core worker logs it to Ray's session log: the notice was emitted (so its absence
    # from the terminal below is the filter's doing, not Ray's silence).
    driver_logs = [
        log
        for session in default_run["sessions"][-5:]
        for log in (session / "logs").glob("python-core-driver-*.log")
        if re.search(RAY_ACTOR_RESTART_NOTICE, log.read_text(errors="replace"))
    ]
    assert driver_logs


def test_the_restart_notice_is_not_in_the_runs_output(default_run):
    proc = default_run["proc"]
    assert "max_restarts > 0" not in proc.stdout + proc.stderr


def test_no_ray_results_run_directory_is_left_in_home(default_run):
    results = default_run["home"] / "ray_results"
    assert not results.exists() or list(results.iterdir()) == []


def test_everything_the_run_writes_is_in_the_readmes_list(default_run):
    listed = _readme_files()
    made = sorted(p.name for p in default_run["cwd"].iterdir())
    assert {"mlflow.db", "mlruns"} <= set(made)
    for name in made:
        assert f"`./{name}" in listed, f"the run wrote ./{name}, which the README's list does not name"
    plots = sorted(p.name for p in (default_run["cwd"] / "mlruns").glob("*/*/artifacts/plots/*.png"))
    assert plots and all(f"`{p}`" in listed or "plots/*.png" in listed for p in plots)
    for entry in sorted(default_run["home"].rglob("*")):
        if entry.is_file():
            relative = entry.relative_to(default_run["home"]).as_posix()
            top = relative.split("/")[0] + "/" + relative.split("/")[1] if "/" in relative else relative
            assert f"~/{top}" in listed, f"the run wrote ~/{relative}, which the README's list does not name"
