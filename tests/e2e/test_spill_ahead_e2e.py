"""Nothing an outage holds is lost to a hard kill: ``gradmon-ray train`` against a real ``mlflow
server``, the server killed after the first iterations, the trainer SIGKILLed some iterations
later (no ``close``, no trailer), then ``gradmon-ray replay`` of its spill file.

Every iteration the trainer printed after the outage began must come back from the spill file,
each exactly once (by metric step), into a fresh store; and replayed into the dead server's own
store, the run's history is complete with no step twice (what MLflow took before the kill is
not in the replay)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.tracking.spill import read_spill
from gradmon_ray.tracking.spill_replay import replay_spill
from tests.e2e.in_process import run_cli
from tests.e2e.processes import BIN, SMALL_TRAIN_ARGS, MlflowServer, alive, clean_env, free_port

pytestmark = pytest.mark.e2e

KILL_SERVER_AFTER = 2  # iterations MLflow takes before its server dies
MORE = 5  # iterations the trainer then runs before it is SIGKILLed
ITERATION = re.compile(r"^iter (\d+)/")


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (its Ray: GCS, raylet, workers, ...), from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _all_gone(pids: set[int], timeout_s: float = 60.0) -> set[int]:
    """The processes of ``pids`` still alive after ``timeout_s`` (empty: all gone)."""
    deadline = time.monotonic() + timeout_s
    left = set(pids)
    while left and time.monotonic() < deadline:
        left = {pid for pid in left if alive(pid)}
        time.sleep(0.5)
    return left


def _steps(uri: str, run_id: str) -> list[int]:
    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, mn.LEARNERS_UPDATED))


def test_a_trainer_killed_during_an_outage_loses_no_iteration(tmp_path):
    server = MlflowServer(free_port(), tmp_path)
    server.start()
    uri = server.uri
    trainer = None
    printed: list[int] = []
    try:
        server.wait(90)
        args = [*SMALL_TRAIN_ARGS, "--iterations", "200", "--mlflow-uri", uri, "--experiment", "spill-ahead"]
        args += ["--set", f"mlflow.spill_dir={tmp_path / 'spill'}", "--set", "mlflow.plots_every=0"]
        args += ["--checkpoint-dir", str(tmp_path / "ckpt")]  # checkpoints are on by default: not into the repository
        trainer = subprocess.Popen(
            [str(BIN / "gradmon-ray"), "train", *args],
            stdout=subprocess.PIPE,
            stderr=(tmp_path / "trainer.err").open("w"),
            text=True,
            env=clean_env(),
            start_new_session=True,  # its own process group: Ray's processes it starts go with it
        )
        deadline = time.monotonic() + 420
        killed_server_at, started = None, set()
        for line in trainer.stdout:
            assert time.monotonic() < deadline, "the trainer is too slow"
            match = ITERATION.match(line)
            if not match:
                continue
            printed.append(int(match.group(1)))
            if printed[-1] == KILL_SERVER_AFTER:
                server.kill(grace_s=0)  # SIGTERM then SIGKILL: the server is gone
                killed_server_at = printed[-1]
            elif killed_server_at is not None and printed[-1] >= killed_server_at + MORE:
                started = _descendants(trainer.pid)
                os.killpg(trainer.pid, signal.SIGKILL)  # no close(), no trailer, nothing flushed
                break
        trainer.wait(timeout=60)
        err = (tmp_path / "trainer.err").read_text()[-3000:]
        assert trainer.returncode == -signal.SIGKILL, (trainer.returncode, err)
        left = _all_gone(started)
        for pid in left:  # started by our trainer: not to outlive this test
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes the trainer started outlived it: {sorted(left)}"
    finally:
        if trainer is not None and trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(timeout=60)
        server.kill(grace_s=0)
    after_outage = [i for i in printed if i > KILL_SERVER_AFTER]
    assert len(after_outage) >= MORE, printed

    (spill,) = (tmp_path / "spill").glob("*.jsonl")
    header, records, trailer = read_spill(spill)
    assert trailer is None and header["experiment"] == "spill-ahead"  # killed: the writer never closed
    kept = shutil.copy(spill, tmp_path / "kept.jsonl")

    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    replay = run_cli(["replay", str(spill), "--tracking-uri", fresh], tmp_path)  # the CLI's main, in this process
    assert replay.returncode == 0, replay.stderr[-3000:]
    client = MlflowClient(fresh)
    (run,) = client.search_runs([client.get_experiment_by_name("spill-ahead").experiment_id])
    steps = _steps(fresh, run.info.run_id)
    recovered = sorted(set(steps) & set(after_outage))
    print(
        f"spill-ahead: server killed after iteration {KILL_SERVER_AFTER}, trainer SIGKILLed after "
        f"iteration {printed[-1]}; {len(recovered)} of the {len(after_outage)} iterations printed after the "
        f"outage recovered by replay (steps {recovered}), {len(steps)} steps replayed in all; "
        f"{len(started)} processes of the trainer (its Ray) gone with it"
    )
    assert len(steps) == len(set(steps)), f"a step replayed twice: {steps}"
    assert len(recovered) >= len(after_outage) - 1, (recovered, after_outage)

    # Into the dead server's own store: the run is there with what MLflow took before the kill.
    own = f"sqlite:///{tmp_path / 'server.db'}"
    run_id = next(r["run_id"] for r in records if r.get("run_id"))
    before = _steps(own, run_id)
    # What it took before the kill (on a loaded box possibly nothing yet: those iterations were
    # spilled with the rest, and the history check below counts them).
    assert max(before, default=0) <= KILL_SERVER_AFTER + 1, before
    result = replay_spill(kept, own)
    assert result.run_id == run_id and not result.created_run
    history = _steps(own, run_id)
    assert history == sorted(set(history)), f"a step logged twice: {history}"
    assert set(range(1, KILL_SERVER_AFTER + 1)) | set(recovered) <= set(history)
