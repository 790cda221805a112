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

PROCESSES = 2

# One interpreter imports the sink and MLflow's SQL store and alembic (about 3 CPU-seconds), then
# forks the processes that race: each opens the new file with an empty store cache of its own, as a
# Tune trial does, and the migration (about 1 CPU-second each) is what they race on.
_OPEN_SINKS = textwrap.dedent(
    """
    import os, sys
    import alembic.command, mlflow.store.db.utils, mlflow.store.tracking.sqlalchemy_store
    from gradmon_ray.tracking.mlflow_sink import MlflowSink
    print("ready", flush=True)
    sys.stdin.readline()
    go_read, go_write = os.pipe()
    children = []
    for _ in range(int(sys.argv[2])):
        if (pid := os.fork()) == 0:
            os.close(go_write)
            os.read(go_read, 1)  # every process opens the store at the same moment
            sink = MlflowSink(sys.argv[1], "together", retry_backoff_s=0.1)
            sink.log_iteration(1, {"x": 1.0})
            ok = sink.close(timeout_s=60)
            print("RESULT", ok, sink.failed_writes, sink.last_error, flush=True)
            os._exit(0)  # no interpreter teardown in a fork: the parent's atexit hooks are not ours
        children.append(pid)
    os.write(go_write, b"g" * len(children))
    sys.exit(max(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in children))
    """
)


@pytest.mark.e2e  # processes: MLflow's migration race is between processes (threads share its store cache)
def test_processes_opening_one_new_sqlite_store_together_all_get_their_run(tmp_path):
    """The driver no longer creates the store when it pickles the config: two processes opening a new
    file at once ran MLflow's unlocked migration together, and one of them failed (``duplicate column
    name: step``), or both for good (``Online migration expected to match one row``): a lost run."""
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _OPEN_SINKS, uri, str(PROCESSES)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            assert proc.stdout.readline().strip() == "ready", stderr.read_text()[-2000:]  # MLflow imported
            out, _ = proc.communicate("go\n", timeout=120)
        finally:
            proc.kill()
    results = [line for line in out.splitlines() if line.startswith("RESULT")]
    # no failed write at all, not even a retried one
    assert results == ["RESULT True 0 None"] * PROCESSES, (out, stderr.read_text()[-4000:])
    assert proc.returncode == 0, stderr.read_text()[-4000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("together").experiment_id])
    assert len(runs) == PROCESSES and {r.info.status for r in runs} == {"FINISHED"}
