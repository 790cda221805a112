"""Nothing an outage holds is lost to a hard kill, and each point lands once across an outage,
``--resume`` and ``replay`` (issue #37 item 4).

One real ``gradmon-ray train`` (a process of its own, its own Ray) against a real ``mlflow
server``: the server killed after iteration 2, the trainer SIGKILLed three iterations later (no
``close``, no trailer, nothing flushed; its checkpoint is the last even iteration, so a resume
trains again what the spill file already holds).  The module's fixture makes that interrupted run
once (store, spill file, checkpoints; relative paths, so copies of it are whole runs) and each
test works on copies of it:

- ``replay`` of the spill file: every iteration the trainer printed after the outage began comes
  back, each once (by metric step), into a fresh store; and into the dead server's own store the
  run's history is complete with no step twice (what MLflow took before the kill is not replayed);
- ``--resume`` (which delivers the spill file first), then ``replay`` (nothing left to do): every
  (metric, step) of the run once, the spilled steps at the spill file's values (the recomputed
  iteration is not logged beside its spilled value), and every iteration there.  The other order
  (``replay`` first, the resume then has nothing to deliver) differs only before training:
  ``tests/app/test_resume_spill.py::test_a_replay_before_the_resume_leaves_it_nothing_to_deliver``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.train.checkpoints import LATEST, RESUME_FILE
from gradmon_ray.tracking.spill import decode_value, read_spill
from gradmon_ray.tracking.spill_replay import replay_spill
from tests.e2e.in_process import run_cli
from tests.e2e.processes import BIN, SMALL_TRAIN_ARGS, MlflowServer, alive, clean_env, free_port

pytestmark = pytest.mark.e2e

KILL_SERVER_AFTER = 2  # iterations MLflow takes before its server dies
MORE = 3  # iterations the trainer then runs before it is SIGKILLed (odd: the resume trains one again)
ITERATIONS = KILL_SERVER_AFTER + MORE + 2
"""Two to spare after the kill: the trainer must still be training when the SIGKILL lands."""
ITERATION = re.compile(r"^iter (\d+)/")


@dataclass
class Outage:
    base: Path
    """The interrupted run's directory: ``server.db``, ``spill/``, ``ckpt/`` (never changed by a test)."""
    printed: list[int]
    """The iterations the trainer printed before the SIGKILL."""
    started: set[int]
    """Processes the trainer started (its Ray), alive when it was killed: gone by the time a test asks."""


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


@pytest.fixture(scope="module")
def outage(tmp_path_factory) -> Outage:
    base = tmp_path_factory.mktemp("outage")
    server = MlflowServer(free_port(), base)
    server.start()
    trainer, printed, started = None, [], set()
    try:
        server.wait(120)
        args = [*SMALL_TRAIN_ARGS, "--iterations", str(ITERATIONS), "--mlflow-uri", server.uri]
        args += ["--experiment", "outage", "--checkpoint-dir", "ckpt", "--set", "checkpoint_every=2"]
        args += ["--set", "mlflow.spill_dir=spill", "--set", "mlflow.plots_every=0"]
        trainer = subprocess.Popen(
            [str(BIN / "gradmon-ray"), "train", *args],
            cwd=base,
            stdout=subprocess.PIPE,
            stderr=(base / "trainer.err").open("w"),
            text=True,
            env=clean_env(),
            start_new_session=True,  # its own process group: the Ray it starts goes with it
        )
        deadline = time.monotonic() + 420
        for line in trainer.stdout:
            assert time.monotonic() < deadline, "the trainer is too slow"
            match = ITERATION.match(line)
            if not match:
                continue
            printed.append(int(match.group(1)))
            if printed[-1] == KILL_SERVER_AFTER:
                server.kill(grace_s=0)  # SIGTERM then SIGKILL: the server is gone
            elif printed[-1] >= KILL_SERVER_AFTER + MORE:
                started = _descendants(trainer.pid)
                os.killpg(trainer.pid, signal.SIGKILL)  # no close(), no trailer, nothing flushed
                break
        trainer.wait(timeout=60)
        err = (base / "trainer.err").read_text()[-3000:]
        assert trainer.returncode == -signal.SIGKILL, (trainer.returncode, printed, err)
    finally:
        if trainer is not None and trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(timeout=60)
        server.kill(grace_s=0)
    return Outage(base, printed, started)


def _copy(outage: Outage, to: Path) -> tuple[str, Path]:
    """A copy of the interrupted run: its store URI and its spill file."""
    to.mkdir()
    shutil.copy(outage.base / "server.db", to / "server.db")
    for name in ("spill", "ckpt"):
        shutil.copytree(outage.base / name, to / name, symlinks=True)
    (spill,) = (to / "spill").glob("*.jsonl")
    return f"sqlite:///{to / 'server.db'}", spill


def _steps(uri: str, run_id: str) -> list[int]:
    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, mn.LEARNERS_UPDATED))


def test_a_trainer_killed_during_an_outage_loses_no_iteration(outage: Outage, tmp_path):
    printed = outage.printed
    after_outage = [i for i in printed if i > KILL_SERVER_AFTER]
    assert len(after_outage) >= MORE, printed
    own, spill = _copy(outage, tmp_path / "copy")
    header, records, trailer = read_spill(spill)
    assert trailer is None and header["experiment"] == "outage"  # killed: the writer never closed
    kept = shutil.copy(spill, tmp_path / "kept.jsonl")

    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    replay = run_cli(["replay", str(spill), "--tracking-uri", fresh], tmp_path)  # the CLI's main, in this process
    assert replay.returncode == 0, replay.stderr[-3000:]
    client = MlflowClient(fresh)
    (run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
    steps = _steps(fresh, run.info.run_id)
    recovered = sorted(set(steps) & set(after_outage))
    print(
        f"spill-ahead: server killed after iteration {KILL_SERVER_AFTER}, trainer SIGKILLed after "
        f"iteration {printed[-1]}; {len(recovered)} of the {len(after_outage)} iterations printed after the "
        f"outage recovered by replay (steps {recovered}), {len(steps)} steps replayed in all"
    )
    assert len(steps) == len(set(steps)), f"a step replayed twice: {steps}"
    assert len(recovered) >= len(after_outage) - 1, (recovered, after_outage)

    # Into the dead server's own store: the run is there with what MLflow took before the kill.
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
    # Asked last: the trainer's Ray ends while the replays above run, not while a test waits for it.
    left = _all_gone(outage.started)
    for pid in left:  # started by our trainer: not to outlive this test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes the trainer started outlived it: {sorted(left)}"


def _spilled_values(spill: Path) -> dict[tuple[str, int], float]:
    """(metric, step) -> value the spill file holds undelivered: the oracle for those steps."""
    _, records, _ = read_spill(spill)
    return {(k, int(r["step"])): decode_value(v) for r in records for k, v in r["metrics"].items()}


def _assert_each_point_once(uri: str, run_id: str, spilled: dict[tuple[str, int], float]) -> None:
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    histories = {key: client.get_metric_history(run_id, key) for key in run.data.metrics}
    for key, history in histories.items():
        steps = [p.step for p in history]
        assert len(steps) == len(set(steps)), f"{key}: a step logged twice: {sorted(steps)}"
    assert sorted(p.step for p in histories[mn.LEARNERS_UPDATED]) == list(range(1, ITERATIONS + 1))
    held = {(key, p.step): p.value for key, history in histories.items() for p in history}
    spilled_finite = {kv: v for kv, v in spilled.items() if v == v}  # NaN != NaN: a NaN point is checked by step only
    assert {kv: held.get(kv) for kv in spilled_finite} == spilled_finite


def test_a_resume_then_a_replay_leave_each_point_once(outage: Outage, ray_session, tmp_path, monkeypatch):
    client = MlflowClient(f"sqlite:///{outage.base / 'server.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
    run_id = run.info.run_id
    # The checkpoint the resume starts from, read on disk: the last even iteration the trainer finished.
    checkpointed = json.loads((outage.base / "ckpt" / run_id / LATEST / RESUME_FILE).read_text())["iterations_done"]
    assert checkpointed % 2 == 0 and checkpointed < outage.printed[-1] < ITERATIONS, (checkpointed, outage.printed)
    here = tmp_path / "resume"
    uri, spill = _copy(outage, here)
    spilled = _spilled_values(spill)
    # The outage's steps, the one the resume trains again included.
    assert {step for _, step in spilled} >= set(range(KILL_SERVER_AFTER + 1, outage.printed[-1] + 1)), spilled
    monkeypatch.chdir(here)
    resume = run_cli(["train", "--resume", run_id, "--mlflow-uri", uri, "--checkpoint-dir", str(here / "ckpt")], here)
    assert resume.returncode == 0, (resume.stdout[-2000:], resume.stderr[-2000:])
    assert "gradmon-ray: delivered" in resume.stdout  # the spill first, then training
    replay = run_cli(["replay", str(spill), "--tracking-uri", uri], here)
    assert replay.returncode == 0 and "was replayed already" in replay.stdout, replay.stderr[-2000:]
    _assert_each_point_once(uri, run_id, spilled)
    assert MlflowClient(uri).get_run(run_id).data.tags[mn.TAG_RESUMED_FROM] == str(checkpointed)
