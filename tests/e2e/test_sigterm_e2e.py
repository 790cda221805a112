"""SIGTERM (what ``timeout``, Kubernetes and ``ray job stop`` send) ends ``gradmon-ray train`` as
Ctrl-C does: the iteration under way finishes and is checkpointed, the MLflow run ends ``KILLED``
(it stayed ``RUNNING`` before), the resume command is printed and the exit code is 130.

The trainer is ``gradmon-ray train`` through the CLI's ``main`` in this process, on the session's
shared Ray: ``ray.init`` made Ray's own driver SIGTERM handler (``sys.exit(15)``, the run would end
FAILED) this process's, as in a console script, and a real SIGTERM is sent to this process once the
first iteration's line is printed.  (A process of its own, signalled from outside and ended with
its exit code, is ``test_console_script_e2e.py``'s, with Ctrl-C; a subprocess here cost about 6 CPU-s
more: torch, RLlib and MLflow imported again.)  Expected values come from MLflow's store and the
checkpoint's resume file, never from what the trainer printed.
"""

from __future__ import annotations

import inspect
import json
import os
import signal

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.train.checkpoints import LATEST, RESUME_FILE
from tests.e2e.in_process import run_cli
from tests.e2e.processes import SMALL_TRAIN_ARGS

pytestmark = pytest.mark.e2e

ITERATIONS = 3


def _rays_driver_handler() -> object:
    """This process's SIGTERM handler, which must be the one ``ray.init`` installed (the premise)."""
    import ray._private.worker

    handler = signal.getsignal(signal.SIGTERM)
    assert callable(handler) and inspect.getsourcefile(handler) == inspect.getsourcefile(ray._private.worker), handler
    return handler


def test_sigterm_checkpoints_the_iteration_ends_the_run_killed_and_prints_the_resume(
    ray_session, tmp_path, monkeypatch
):
    from gradmon_ray.app.train.messages import ProgressPrinter

    rays = _rays_driver_handler()
    printed = ProgressPrinter.__call__

    def sigterm_after_the_first_iteration(self: ProgressPrinter, line: str) -> None:
        printed(self, line)
        if line.startswith(f"iter 1/{ITERATIONS} "):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ProgressPrinter, "__call__", sigterm_after_the_first_iteration)
    argv = ["train", *SMALL_TRAIN_ARGS, "--iterations", str(ITERATIONS)]
    proc = run_cli([*argv, "--set", "checkpoint_every=100", "--set", "mlflow.plots_every=0"], tmp_path)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 130, (lines, proc.stderr[-3000:])
    assert "gradmon-ray: SIGTERM: stopping after this iteration, once it is checkpointed" in proc.stderr
    assert signal.getsignal(signal.SIGTERM) is rays  # put back after the run

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
