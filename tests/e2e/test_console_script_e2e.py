"""The ``gradmon-ray`` console script in a process of its own: the one CLI training of the suite
that is not run in-process (Ctrl-C goes to a process; a fresh process shows Ray's start-up noise
and writes into its ``HOME``).

``gradmon-ray train`` on the embedded defaults (tiny batches), in an empty directory with an
empty ``HOME``: it prints its MLflow run before the first iteration and none of Ray's or MLflow's
start-up noise (Ray's actor-restart notice is in Ray's own driver log instead); SIGINT after the
first iteration ends it with exit 130 and a resume command; that command, run as printed (through
the CLI's ``main``, on the session's Ray, from the same directory), finishes the same run; every
file the run made is one the README's "Files a run writes" list names, and no
``~/ray_results/<run>`` is left.  (That two default runs with the same seed get different names:
the generator in ``tests/app/test_run_names.py::test_two_default_names_after_the_same_seed_differ``,
and this run named by it, not by MLflow's generator, below; a second training here cost 7 CPU-s.)

Expected values come from MLflow's store (run status, name, metric history, tags) and the
checkpoint's resume file on disk, never from what the product printed; what it printed is
compared with them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.ray_noise import RAY_ACTOR_RESTART_NOTICE
from gradmon_ray.app.train.checkpoints import LATEST, RESUME_FILE
from tests.e2e.in_process import CliResult, run_cli
from tests.e2e.processes import BIN, clean_env, kill_group

pytestmark = pytest.mark.e2e

ITERATIONS = 3
TINY = ["--set", "ppo.train_batch_size=256", "--set", "ppo.minibatch_size=128", "--set", "ppo.num_epochs=1"]
TINY += ["--set", "model.trunk_hiddens=[32]"]
RUN_LINE = re.compile(r"^gradmon-ray: MLflow run ([0-9a-f]{32}) \((\S+)\) in experiment 'gradmon-ray' at (\S+)$")
ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"^FactoredOps-v0-\d{8}-\d{6}-[a-z0-9]{4}$")
RESUME_WITH = "gradmon-ray: resume it (from this directory) with: "


@dataclass
class Interrupted:
    store: str
    root: Path
    work: Path
    home: Path
    """The interrupted process's ``HOME``, empty before it started."""
    started: float
    """``time.time()`` when it started (Ray's session directories after it are its own or later)."""
    run_id: str
    lines: list[str]
    """What the interrupted ``train`` printed on stdout."""
    killed_status: str
    killed_steps: list[int]
    name_before: str
    checkpointed: int
    """``iterations_done`` of the checkpoint on disk after the interrupt."""
    stderr: str
    """What the interrupted ``train`` wrote to standard error."""
    resumed: CliResult
    argv: list[str]
    """The resume command as printed, split as a shell would."""
    runs_after_resume: list[str]
    """The experiment's run ids once the resume had finished."""
    run_dirs_after_resume: list[str]
    """The run directories under the checkpoint root then (a later test's run adds its own)."""


def _train(iterations: int) -> list[str]:
    """``gradmon-ray train`` on the embedded defaults: ./mlflow.db, ./mlruns, ./gradmon-checkpoints."""
    return ["train", "--iterations", str(iterations), *TINY]


def _steps(client: MlflowClient, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, mn.LEARNERS_UPDATED))


@contextlib.contextmanager
def _sigint_as_a_terminal_delivers_it() -> Iterator[None]:
    """A child inherits SIGINT ignored or blocked from this process (an xdist worker process starts
    with it ignored), and the console script then rightly ignores the signal: for the start of the
    child, SIGINT is unblocked and has Python's default handler, as in a shell started from a terminal."""
    previous = signal.getsignal(signal.SIGINT)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _start(work: Path, home: Path, err: IO[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BIN / "gradmon-ray"), *_train(ITERATIONS)],
        cwd=work,
        env=clean_env(HOME=str(home)),
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        start_new_session=True,  # its own group, so that the cleanup below can take Ray's processes too
    )


@pytest.fixture(scope="module")
def interrupted(ray_session, tmp_path_factory: pytest.TempPathFactory) -> Interrupted:
    tmp = tmp_path_factory.mktemp("interrupt")
    work, home = tmp / "work", tmp / "home"
    root, store = work / "gradmon-checkpoints", f"sqlite:///{work / 'mlflow.db'}"
    work.mkdir()
    home.mkdir()
    err = (tmp / "train.err").open("w")
    started = time.time()
    here = (signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, set()))  # for a failure
    with _sigint_as_a_terminal_delivers_it():
        proc = _start(work, home, err)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(f"iter 1/{ITERATIONS} "):
                os.kill(proc.pid, signal.SIGINT)  # Ctrl-C, to the trainer only
                break
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            kill_group(proc)
        err.close()
    lines += rest.splitlines()
    assert proc.returncode == 130, (proc.returncode, here, lines, (tmp / "train.err").read_text()[-3000:])
    (run_id,) = [m.group(1) for line in lines if (m := RUN_LINE.match(line))]
    client = MlflowClient(store)
    killed, killed_steps = client.get_run(run_id), _steps(client, run_id)  # before the resume
    state = json.loads((root / run_id / LATEST / RESUME_FILE).read_text())
    (command,) = [line[len(RESUME_WITH) :] for line in lines if line.startswith(RESUME_WITH)]
    argv = shlex.split(command)
    assert argv[0] == "gradmon-ray"
    resumed = run_cli(argv[1:], work)
    runs_after_resume = [r.info.run_id for r in client.search_runs([killed.info.experiment_id])]
    run_dirs = [p.name for p in root.iterdir() if p.is_dir() and re.fullmatch("[0-9a-f]{32}", p.name)]
    return Interrupted(
        store,
        root,
        work,
        home,
        started,
        run_id,
        lines,
        killed.info.status,
        killed_steps,
        killed.info.run_name,
        int(state["iterations_done"]),
        (tmp / "train.err").read_text(),
        resumed,
        argv,
        runs_after_resume,
        run_dirs,
    )


def test_the_run_is_announced_before_its_first_iteration(interrupted: Interrupted):
    lines = interrupted.lines
    (start,) = [i for i, line in enumerate(lines) if RUN_LINE.match(line)]
    first = lines.index(next(line for line in lines if line.startswith(f"iter 1/{ITERATIONS} ")))
    assert start < first
    _, name, shown = RUN_LINE.match(lines[start]).groups()
    assert name == interrupted.name_before and NAME.match(name), name  # MLflow's own record of the name
    assert shown == "sqlite:///mlflow.db"  # the embedded default, as given: ./mlflow.db of the directory it ran in


def test_the_console_script_prints_none_of_rays_or_mlflows_start_up_noise(interrupted: Interrupted):
    """A fresh process: Ray's start-up notices (never the hint to switch token auth off), RLlib's
    new-API-stack notice and MLflow's new-store migration lines are filtered from its stderr."""
    err = interrupted.stderr
    assert "RAY_AUTH_MODE" not in err and "new API stack" not in err, err[-3000:]
    assert "Creating initial MLflow database tables" not in err, err[-3000:]


def test_ctrl_c_ends_the_run_killed_with_its_last_iteration_checkpointed(interrupted: Interrupted):
    """The first Ctrl-C lets the iteration under way finish and checkpoints it: what MLflow logged
    before the exit is exactly what the checkpoint on disk holds, and the printed line says so."""
    assert interrupted.killed_status == "KILLED"
    assert interrupted.checkpointed in (1, 2)  # the signal came after iteration 1, during 1's tail or 2
    assert interrupted.killed_steps == list(range(1, interrupted.checkpointed + 1))
    (said,) = [line for line in interrupted.lines if "ended KILLED" in line]
    assert said == (
        f"gradmon-ray: interrupted: MLflow run {interrupted.run_id} ended KILLED after iteration "
        f"{interrupted.checkpointed} of {ITERATIONS}, checkpointed at iteration {interrupted.checkpointed}"
    )
    # The embedded defaults: the store and checkpoints a bare ``train`` in this directory uses.
    assert interrupted.argv == ["gradmon-ray", "train", "--resume", interrupted.run_id]


def test_the_printed_command_finishes_the_same_run(interrupted: Interrupted):
    resumed = interrupted.resumed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert interrupted.runs_after_resume == [interrupted.run_id]  # the resume made no run of its own
    client = MlflowClient(interrupted.store)
    run = client.get_run(interrupted.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == interrupted.name_before  # a resumed run keeps its name
    assert run.data.tags[mn.TAG_RESUMED_FROM] == str(interrupted.checkpointed)
    assert _steps(client, interrupted.run_id) == list(range(1, ITERATIONS + 1))  # each iteration once
    assert interrupted.run_dirs_after_resume == [interrupted.run_id]  # resumable checkpoints: the run's own directory


def _readme_files() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("### Files a run writes", 1)[1].split("\n#", 1)[0]


def test_everything_the_run_writes_is_in_the_readmes_list(interrupted: Interrupted):
    """In the working directory (the interrupted process and its resume) and in the interrupted
    process's ``HOME``, with no ``~/ray_results/<run>`` directory left behind."""
    listed = _readme_files()
    made = sorted(p.name for p in interrupted.work.iterdir())
    assert {"mlflow.db", "mlruns", "gradmon-checkpoints"} <= set(made)
    for name in made:
        assert f"`./{name}" in listed, f"the run wrote ./{name}, which the README's list does not name"
    plots = sorted(p.name for p in (interrupted.work / "mlruns").glob("*/*/artifacts/plots/*.png"))
    assert plots and all(f"`{p}`" in listed or "plots/*.png" in listed for p in plots)
    results = interrupted.home / "ray_results"
    assert not results.exists() or list(results.iterdir()) == []
    for entry in sorted(interrupted.home.rglob("*")):
        if entry.is_file():
            relative = entry.relative_to(interrupted.home).as_posix()
            top = relative.split("/")[0] + "/" + relative.split("/")[1] if "/" in relative else relative
            assert f"~/{top}" in listed, f"the run wrote ~/{relative}, which the README's list does not name"


def test_rays_restart_notice_went_to_its_own_log_not_the_terminal(interrupted: Interrupted):
    """The driver's core worker logs the notice to Ray's session log, so its absence from what the
    process printed is the filter's doing, not Ray's silence."""
    out = "\n".join(interrupted.lines) + interrupted.stderr
    assert "max_restarts > 0" not in out
    ray_tmp = Path(os.environ.get("RAY_TMPDIR") or "/tmp") / "ray"  # tests/conftest.py: one per xdist worker
    sessions = [p for p in ray_tmp.glob("session_*") if p.stat().st_mtime >= interrupted.started]
    driver_logs = [
        log
        for session in sessions
        for log in (session / "logs").glob("python-core-driver-*.log")
        if re.search(RAY_ACTOR_RESTART_NOTICE, log.read_text(errors="replace"))
    ]
    assert driver_logs, sessions
