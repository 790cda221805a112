"""Issue #28 end to end: ``gradmon-ray train`` on the default config (tiny batches), the console
script in a process of its own (the one CLI training of the suite that is not run in-process:
Ctrl-C goes to a process), prints its MLflow run before the first iteration and none of Ray's or
MLflow's start-up noise; SIGINT to that process after the first iteration ends it with exit 130
and a resume command; that command, run as printed (through the CLI's ``main``, on the session's
Ray), finishes the same run.  Two default runs (same default seed) get different names.

Expected values come from MLflow's store (run status, name, metric history, tags) and the
checkpoint's resume file on disk, never from what the product printed; what it printed is
compared with them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.checkpointing import LATEST, RESUME_FILE
from tests.e2e.in_process import CliResult, run_cli
from tests.e2e.processes import BIN, clean_env, kill_group

pytestmark = pytest.mark.e2e

ITERATIONS = 3
TINY = ["--set", "ppo.train_batch_size=256", "--set", "ppo.minibatch_size=128", "--set", "ppo.num_epochs=1"]
TINY += ["--set", "model.trunk_hiddens=[32]", "--set", "mlflow.plots_every=0"]
RUN_LINE = re.compile(r"^gradmon-ray: MLflow run ([0-9a-f]{32}) \((\S+)\) in experiment 'gradmon-ray' at (\S+)$")
NAME = re.compile(r"^FactoredOps-v0-\d{8}-\d{6}-[a-z0-9]{4}$")
RESUME_WITH = "gradmon-ray: resume it (from this directory) with: "


@dataclass
class Interrupted:
    store: str
    root: Path
    work: Path
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


def _train(work: Path, store: str, root: Path, iterations: int) -> list[str]:
    argv = ["train", "--iterations", str(iterations), *TINY]
    return [*argv, "--mlflow-uri", store, "--checkpoint-dir", str(root)]


def _steps(client: MlflowClient, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, mn.LEARNERS_UPDATED))


@pytest.fixture(scope="module")
def interrupted(ray_session, tmp_path_factory: pytest.TempPathFactory) -> Interrupted:
    tmp = tmp_path_factory.mktemp("interrupt")
    work, root, store = tmp / "work", tmp / "ckpt", f"sqlite:///{tmp / 'mlflow.db'}"
    work.mkdir()
    err = (tmp / "train.err").open("w")
    proc = subprocess.Popen(
        [str(BIN / "gradmon-ray"), *_train(work, store, root, ITERATIONS)],
        cwd=work,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        start_new_session=True,  # its own group, so that the cleanup below can take Ray's processes too
    )
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
    assert proc.returncode == 130, (proc.returncode, (tmp / "train.err").read_text()[-3000:])
    (run_id,) = [m.group(1) for line in lines if (m := RUN_LINE.match(line))]
    client = MlflowClient(store)
    killed, killed_steps = client.get_run(run_id), _steps(client, run_id)  # before the resume
    state = json.loads((root / run_id / LATEST / RESUME_FILE).read_text())
    (command,) = [line[len(RESUME_WITH) :] for line in lines if line.startswith(RESUME_WITH)]
    argv = shlex.split(command)
    assert argv[0] == "gradmon-ray"
    resumed = run_cli(argv[1:], work)
    return Interrupted(
        store,
        root,
        work,
        run_id,
        lines,
        killed.info.status,
        killed_steps,
        killed.info.run_name,
        int(state["iterations_done"]),
        (tmp / "train.err").read_text(),
        resumed,
        argv,
    )


def test_the_run_is_announced_before_its_first_iteration(interrupted: Interrupted):
    lines = interrupted.lines
    (start,) = [i for i, line in enumerate(lines) if RUN_LINE.match(line)]
    first = lines.index(next(line for line in lines if line.startswith(f"iter 1/{ITERATIONS} ")))
    assert start < first
    _, name, shown = RUN_LINE.match(lines[start]).groups()
    assert name == interrupted.name_before and NAME.match(name), name  # MLflow's own record of the name
    assert shown == interrupted.store


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
    assert interrupted.argv == [
        "gradmon-ray", "train", "--resume", interrupted.run_id,
        "--mlflow-uri", interrupted.store, "--checkpoint-dir", str(interrupted.root),
    ]  # fmt: skip


def test_the_printed_command_finishes_the_same_run(interrupted: Interrupted):
    resumed = interrupted.resumed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    client = MlflowClient(interrupted.store)
    (run,) = client.search_runs([client.get_experiment_by_name("gradmon-ray").experiment_id])
    assert run.info.run_id == interrupted.run_id and run.info.status == "FINISHED"
    assert run.info.run_name == interrupted.name_before  # a resumed run keeps its name
    assert run.data.tags[mn.TAG_RESUMED_FROM] == str(interrupted.checkpointed)
    assert _steps(client, interrupted.run_id) == list(range(1, ITERATIONS + 1))  # each iteration once
    run_dirs = [p.name for p in interrupted.root.iterdir() if p.is_dir() and re.fullmatch("[0-9a-f]{32}", p.name)]
    assert run_dirs == [interrupted.run_id]  # resumable checkpoints: in the run's own directory only
    assert sorted(p.name for p in interrupted.work.iterdir()) == []  # nothing left in the working directory


def test_two_default_runs_get_different_names(interrupted: Interrupted):
    """A second run with the same (default) seed: MLflow's generator named both alike; now they differ."""
    proc = run_cli(_train(interrupted.work, interrupted.store, interrupted.root, 1), interrupted.work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(interrupted.store)
    runs = client.search_runs([client.get_experiment_by_name("gradmon-ray").experiment_id])
    assert len(runs) == 2 and {r.data.params["seed"] for r in runs} == {"0"}
    names = [r.info.run_name for r in runs]
    assert len(set(names)) == 2 and all(NAME.match(n) for n in names), names
