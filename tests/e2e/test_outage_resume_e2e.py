"""Exactly once across an outage, ``--resume`` and ``replay`` (issue #37 item 4): a real
``gradmon-ray train`` against a real ``mlflow server``, the server killed after iteration 2 (later
iterations spill), the trainer SIGKILLed after iteration 5 (its checkpoint is at 4: the resume
trains 5 again).  The interrupted run (store, spill file, checkpoints) is copied twice, and each
copy finished in one order: ``--resume`` then ``replay``, ``replay`` then ``--resume``.  Both must
end with every (metric, step) of the run once, the spilled steps at the spill file's values (the
recomputed iteration 5 is not logged beside its spilled value), and all 6 iterations there."""

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
from gradmon_ray.tracking.spill import decode_value, read_spill
from tests.e2e.in_process import run_cli
from tests.e2e.processes import BIN, SMALL_TRAIN_ARGS, MlflowServer, clean_env, free_port

pytestmark = pytest.mark.e2e

ITERATIONS, KILL_SERVER_AFTER, KILL_TRAINER_AFTER = 6, 2, 5
ITERATION = re.compile(r"^iter (\d+)/")


def _interrupted_by_an_outage(base: Path) -> None:
    """Train in ``base`` (relative spill and checkpoint dirs, so copies of ``base`` are whole runs)."""
    server = MlflowServer(free_port(), base)
    server.start()
    trainer = None
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
            start_new_session=True,  # its own process group: its Ray goes with it
        )
        deadline = time.monotonic() + 300
        for line in trainer.stdout:
            assert time.monotonic() < deadline, "the trainer is too slow"
            match = ITERATION.match(line)
            if match and int(match.group(1)) == KILL_SERVER_AFTER:
                server.kill(grace_s=0)
            elif match and int(match.group(1)) == KILL_TRAINER_AFTER:
                os.killpg(trainer.pid, signal.SIGKILL)  # no close, no trailer: the worst interruption
                break
        trainer.wait(timeout=60)
        assert trainer.returncode == -signal.SIGKILL, (base / "trainer.err").read_text()[-3000:]
    finally:
        if trainer is not None and trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(timeout=60)
        server.kill(grace_s=0)


def _copy(base: Path, to: Path) -> tuple[str, Path]:
    """A copy of the interrupted run: its store URI and its spill file."""
    to.mkdir()
    shutil.copy(base / "server.db", to / "server.db")
    for name in ("spill", "ckpt"):
        shutil.copytree(base / name, to / name, symlinks=True)
    (spill,) = (to / "spill").glob("*.jsonl")
    return f"sqlite:///{to / 'server.db'}", spill


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


def test_resume_and_replay_in_either_order_leave_each_point_once(ray_session, tmp_path, monkeypatch):
    base = tmp_path / "base"
    base.mkdir()
    _interrupted_by_an_outage(base)
    client = MlflowClient(f"sqlite:///{base / 'server.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
    run_id = run.info.run_id
    for order in ("resume-then-replay", "replay-then-resume"):
        here = tmp_path / order
        uri, spill = _copy(base, here)
        spilled = _spilled_values(spill)
        assert {step for _, step in spilled} >= {3, 4, KILL_TRAINER_AFTER}, sorted(spilled)  # the outage's steps
        monkeypatch.chdir(here)
        resume = ["train", "--resume", run_id, "--mlflow-uri", uri, "--checkpoint-dir", str(here / "ckpt")]
        replay = ["replay", str(spill), "--tracking-uri", uri]
        for argv in [resume, replay] if order == "resume-then-replay" else [replay, resume]:
            done = run_cli(argv, here)
            assert done.returncode == 0, (order, argv[0], done.stdout[-2000:], done.stderr[-2000:])
            if argv is replay and order == "resume-then-replay":
                assert "was replayed already" in done.stdout  # the resume delivered it
            if argv is resume:
                delivered = "gradmon-ray: delivered" in done.stdout
                assert delivered == (order == "resume-then-replay"), done.stdout
        _assert_each_point_once(uri, run_id, spilled)
        assert MlflowClient(uri).get_run(run_id).data.tags[mn.TAG_RESUMED_FROM] == "4"
