"""SIGTERM (what ``timeout``, Kubernetes and ``ray job stop`` send) ends ``gradmon-ray train`` as
Ctrl-C does: the iteration under way finishes and is checkpointed, the MLflow run ends ``KILLED``
(it stayed ``RUNNING`` before), the resume command is printed and the exit code is 130.

The trainer is the console script in a process of its own, on the session's shared Ray (Ray's auth
variables kept; its start-up is the console-script test's subject), signalled after its first iteration line.
Expected values come from MLflow's store and the checkpoint's resume file, never from what the
trainer printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.train.checkpoints import LATEST, RESUME_FILE
from tests.e2e.processes import BIN, SMALL_TRAIN_ARGS, clean_env, kill_group

pytestmark = pytest.mark.e2e

ITERATIONS = 4


def test_sigterm_checkpoints_the_iteration_ends_the_run_killed_and_prints_the_resume(lasting_ray_address, tmp_path):
    argv = [str(BIN / "gradmon-ray"), "train", *SMALL_TRAIN_ARGS, "--iterations", str(ITERATIONS)]
    argv += ["--set", "checkpoint_every=100", "--set", "mlflow.plots_every=0", "--ray-address", lasting_ray_address]
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env={**os.environ, "PATH": clean_env()["PATH"]},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(f"iter 1/{ITERATIONS} "):
                os.kill(proc.pid, signal.SIGTERM)
                break
        rest, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    lines += rest.splitlines()
    assert proc.returncode == 130, (lines, err[-3000:])
    assert "gradmon-ray: SIGTERM: stopping after this iteration, once it is checkpointed" in err

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gradmon-ray").experiment_id])
    run_id = run.info.run_id
    state = json.loads((tmp_path / "gradmon-checkpoints" / run_id / LATEST / RESUME_FILE).read_text())
    done = int(state["iterations_done"])  # checkpoint_every=100: only the interrupt saved one
    assert run.info.status == "KILLED" and run.data.tags[mn.TAG_STATUS] == "killed"
    assert done in (1, 2)  # the signal came after iteration 1: during 1's tail or 2
    assert sorted(p.step for p in client.get_metric_history(run_id, mn.LEARNERS_UPDATED)) == list(range(1, done + 1))
    assert (
        f"gradmon-ray: interrupted: MLflow run {run_id} ended KILLED after iteration {done} of {ITERATIONS}, "
        f"checkpointed at iteration {done}"
    ) in lines
    assert f"gradmon-ray: resume it (from this directory) with: gradmon-ray train --resume {run_id}" in lines
