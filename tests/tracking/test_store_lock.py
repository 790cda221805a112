"""``tracking/store_lock.py``: processes that open one new sqlite store together all get their run.

The driver no longer creates a ``GradmonMLflowCallback``'s store when it pickles the config (issue
#47 item 4, ``test_callback_store.py``): the first run does, in whichever process it starts, and
Tune trials start together.  MLflow migrates a new sqlite file with no lock between processes
(threads of one process share its store cache, so only processes show it).  The oracle is the
store read back by a fresh ``MlflowClient``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from mlflow.tracking import MlflowClient

_OPEN_SINK = textwrap.dedent(
    """
    import sys
    from gradmon_ray.tracking.mlflow_sink import MlflowSink
    print("ready", flush=True)
    sys.stdin.readline()  # every process opens the store at the same moment
    sink = MlflowSink(sys.argv[1], "together", retry_backoff_s=0.1)
    sink.log_iteration(1, {"x": 1.0})
    ok = sink.close(timeout_s=60)
    print("RESULT", ok, sink.failed_writes, sink.last_error, flush=True)
    """
)


@pytest.mark.e2e  # processes: MLflow's migration race is between processes (threads share its store cache)
def test_processes_opening_one_new_sqlite_store_together_all_get_their_run(tmp_path):
    """The driver no longer creates the store when it pickles the config: two processes opening a new
    file at once ran MLflow's unlocked migration together, and one of them failed (``duplicate column
    name: step``), or both for good (``Online migration expected to match one row``): a lost run."""
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    argv = [sys.executable, "-c", _OPEN_SINK, uri]
    logs = [(tmp_path / f"stderr-{i}.txt").open("w") for i in range(2)]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen(argv, stderr=log, **pipes) for log in logs]
    try:
        assert [proc.stdout.readline().strip() for proc in procs] == ["ready"] * 2  # MLflow imported
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outs = [proc.communicate(timeout=120)[0] for proc in procs]
        results = [next((line for line in out.splitlines() if line.startswith("RESULT")), out) for out in outs]
    finally:
        for proc, log in zip(procs, logs, strict=True):
            proc.kill()
            log.close()
    stderr = [(tmp_path / f"stderr-{i}.txt").read_text()[-2000:] for i in range(2)]
    assert results == ["RESULT True 0 None"] * 2, (results, stderr)  # no failed write at all, not even a retried one
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("together").experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
