"""``train --resume`` from the resumable checkpoints (``checkpoint_every``): what survives a failed
save, what a resumed run carries over (health-stop streaks, the learner state it checks) and
what it writes.  Real RLlib training on the local Ray, a real sqlite MLflow store, the resume
through the CLI's own entry point; expected values come from MLflow's history and the files on disk."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app import cli
from gradmon_ray.app.train.checkpoints import LATEST, RESUME_FILE, CheckpointStateMismatchError
from gradmon_ray.app.train.final_checkpoint import FINAL
from gradmon_ray.app.train.resume import CHECKPOINT_ROOT_ENV, resume_point
from gradmon_ray.app.train.run import run_training
from tests.e2e.resumable_runs import newest_checkpoint, newest_state, resumable_config

pytestmark = pytest.mark.e2e


def _on_disk(tmp_path: Path) -> dict[str, Any]:
    return newest_state(tmp_path / "ckpt")


def _only_run(client: MlflowClient) -> Any:
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    return run


def _steps(client: MlflowClient, run_id: str, name: str) -> list[int]:
    return sorted(point.step for point in client.get_metric_history(run_id, name))


def _interrupt_after(iteration: int, total: int):
    """A ``progress`` callback that presses Ctrl-C once ``iteration`` is done (after its checkpoint)."""

    def progress(line: str) -> None:
        if line.startswith(f"iter {iteration}/{total} "):
            raise KeyboardInterrupt

    return progress


@pytest.fixture
def cli_resume(monkeypatch, tmp_path):
    """``gradmon-ray train --resume RUN_ID`` in this process (the CLI sets two MLflow env vars: undone after),
    with ``tmp_path`` as the checkpoint root it may load from."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(CHECKPOINT_ROOT_ENV, str(tmp_path))
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)

    def resume(run_id: str, uri: str, *extra: str) -> int:
        return cli.main(["train", "--resume", run_id, "--mlflow-uri", uri, *extra])

    return resume


def test_a_checkpoint_save_that_fails_leaves_the_previous_one_to_resume_from(
    ray_session, tmp_path, monkeypatch, cli_resume
):
    """The iteration-2 save fails halfway (disk full): the newest complete checkpoint (and ``latest``)
    must still be iteration 1's, and ``--resume`` continues from it, training iteration 2 again
    without logging it twice, and tags that range as recomputed; the next save clears the half-written one."""
    from ray.rllib.algorithms.algorithm import Algorithm

    cfg = resumable_config(tmp_path, iterations=3, checkpoint_every=1)
    save = Algorithm.save_to_path
    saves: list[str] = []

    def save_failing_the_second_time(self: Any, path: Any = None, **kwargs: Any) -> Any:
        saves.append(str(path))
        if len(saves) == 2:
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / "half_written").write_bytes(b"\0" * 64)
            raise OSError(28, "No space left on device")
        return save(self, path, **kwargs)

    monkeypatch.setattr(Algorithm, "save_to_path", save_failing_the_second_time)
    with pytest.raises(OSError, match="No space left"):
        run_training(cfg, progress=None)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    run = _only_run(client)
    assert run.info.status == "FAILED"
    assert _steps(client, run.info.run_id, mn.LEARNERS_UPDATED) == [1, 2]  # iteration 2 was logged before its save
    state = _on_disk(tmp_path)
    assert state["iterations_done"] == 1 and state["run_id"] == run.info.run_id
    run_dir = tmp_path / "ckpt" / run.info.run_id
    assert (run_dir / LATEST).resolve() == newest_checkpoint(tmp_path / "ckpt").resolve()
    assert not (run_dir / LATEST / "algo" / "half_written").exists()
    assert [p.name for p in run_dir.glob(".partial-*/algo/half_written")], "the failed save's staging"

    assert cli_resume(run.info.run_id, cfg.mlflow.tracking_uri) == 0
    again = client.get_run(run.info.run_id)
    assert again.info.status == "FINISHED"
    assert again.data.tags[mn.TAG_RESUMED_FROM] == "1"
    assert again.data.tags[mn.TAG_RECOMPUTED_ITERATIONS] == "2-2"
    for name in (mn.LEARNERS_UPDATED, mn.GLOBAL_GRAD_NORM):
        assert _steps(client, run.info.run_id, name) == [1, 2, 3], name  # each once, none missing
    assert _on_disk(tmp_path)["iterations_done"] == 3
    # staging cleared; ``final`` is RLlib's end-of-run checkpoint, in the run's own directory
    assert sorted(p.name.split("-")[0] for p in run_dir.iterdir()) == ["ckpt", FINAL, LATEST]


EXPLODING, STREAK = mn.HEALTH_CODES["exploding"], 5


def test_a_resumed_run_keeps_the_health_stop_streak_and_checkpoints_where_it_stops(ray_session, tmp_path, cli_resume):
    """Head ``op`` explodes from iteration 1 (logits x100); ``exploding_iterations: 5`` stops the
    run at the 5th exploding iteration in a row.  Ctrl-C after iteration 3 (checkpoint at 2), then
    ``--resume``: the streak of 2 comes back with the checkpoint, so the run stops at iteration 5,
    not 2 + 5; the stop writes a checkpoint (5 is not a multiple of ``checkpoint_every``)."""
    iterations = 8
    cfg = resumable_config(
        tmp_path,
        iterations=iterations,
        checkpoint_every=2,
        health_stop={"exploding_iterations": STREAK},
        model={"trunk_hiddens": [32], "head_logit_scale": {"op": 100.0}},
    )
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, progress=_interrupt_after(3, iterations))
    client = MlflowClient(cfg.mlflow.tracking_uri)
    run_id = _only_run(client).info.run_id
    assert _on_disk(tmp_path)["iterations_done"] == 2

    assert cli_resume(run_id, cfg.mlflow.tracking_uri) == 0
    run = client.get_run(run_id)
    health = sorted(
        (p.step, p.value) for p in client.get_metric_history(run_id, mn.head_metric(mn.HEAD_GRAD_HEALTH, "op"))
    )
    steps = [step for step, _ in health]
    assert steps == sorted(set(steps)), f"iterations logged twice: {steps}"
    # Where the rule must fire, from the codes MLflow holds: the first step ending STREAK exploding in a row.
    codes = [int(value) for _, value in health]
    expected = next(i + 1 for i in range(len(codes)) if codes[max(0, i + 1 - STREAK) : i + 1] == [EXPLODING] * STREAK)
    assert expected == STREAK  # op explodes from iteration 1 on: the premise of this test
    assert run.info.status == "FINISHED"
    stop_reason = run.data.tags[mn.TAG_STOP_REASON]
    assert stop_reason.startswith(f"iteration {expected}: head 'op' exploding"), stop_reason
    assert steps == list(range(1, expected + 1))
    assert run.data.tags[mn.TAG_RESUMED_FROM] == "2" and run.data.tags[mn.TAG_RECOMPUTED_ITERATIONS] == "3-3"
    state = _on_disk(tmp_path)
    assert state["iterations_done"] == expected and state["run_id"] == run_id
    assert state["health"]["exploding/op"] == STREAK


def test_resume_refuses_a_checkpoint_whose_learner_state_is_not_the_one_it_was_written_with(
    ray_session, tmp_path, cli_resume, capsys
):
    """``algo/`` of the newest checkpoint replaced by the iteration-1 save while its
    ``gradmon_resume.json`` says 2 (two saves mixed by hand, the manifest made to match):
    ``--resume`` restores it, finds a learner state other than the recorded digest and stops
    before training or logging anything."""
    cfg = resumable_config(tmp_path, iterations=2, checkpoint_every=1)
    first_save = tmp_path / "algo_after_1"

    def keep_the_first_save(line: str) -> None:
        if line.startswith("iter 1/"):
            shutil.copytree(newest_checkpoint(tmp_path / "ckpt") / "algo", first_save)

    outcome = run_training(cfg, progress=keep_the_first_save)
    version = newest_checkpoint(tmp_path / "ckpt", outcome.run_id)
    shutil.rmtree(version / "algo")
    shutil.copytree(first_save, version / "algo")
    state = json.loads((version / RESUME_FILE).read_text())
    files = [p for p in (version / "algo").rglob("*") if p.is_file()]
    manifest = {p.relative_to(version / "algo").as_posix(): p.stat().st_size for p in files}
    (version / RESUME_FILE).write_text(json.dumps({**state, "manifest": manifest}))
    # The run is complete (2 of 2): a resume that trains on (--iterations 3) gets to the digest check.
    _, point = resume_point(cfg.mlflow.tracking_uri, outcome.run_id, iterations=3)
    assert point.iterations_done == 2

    capsys.readouterr()
    assert cli_resume(outcome.run_id, cfg.mlflow.tracking_uri, "--iterations", "3") == 1
    failure = capsys.readouterr().err.strip().splitlines()[-1]
    assert failure.startswith(f"gradmon-ray: run failed: {CheckpointStateMismatchError.__name__}: "), failure
    assert "not the one written with it" in failure
    client = MlflowClient(cfg.mlflow.tracking_uri)
    assert _steps(client, outcome.run_id, mn.LEARNERS_UPDATED) == [1, 2]  # nothing trained on top of it
    assert mn.TAG_RESUMED_FROM not in client.get_run(outcome.run_id).data.tags


def test_a_run_resumed_from_another_directory_renews_the_checkpoint_it_came_from(
    ray_session, tmp_path, monkeypatch, cli_resume
):
    """``checkpoint_dir`` unset, Ctrl-C after iteration 1, then ``--resume`` from another working
    directory: refused (exit 2) until that root is allowed (``$GRADMON_CHECKPOINT_DIR``); then the
    resumed run renews the checkpoint where the run's ``gradmon.checkpoint_dir`` tag points (so a
    second ``--resume`` continues from iteration 3, not 1 again), and leaves no checkpoint in the
    new directory.  (A relative ``checkpoint_dir`` takes the same path as the unset one, whose
    default is relative: ``checkpoint_root``'s ``abspath``; relative roots in a job:
    tests/config/test_job_spill_dir.py.  A run of it here cost a training run and two resumes.)"""
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    first.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(first)
    cfg = resumable_config(tmp_path, iterations=3, checkpoint_every=1, checkpoint_dir=None)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, progress=_interrupt_after(1, 3))
    client = MlflowClient(cfg.mlflow.tracking_uri)
    run = _only_run(client)
    root = first / "gradmon-checkpoints"  # what the default relative path meant there
    assert run.data.tags[mn.TAG_CHECKPOINT_DIR] == str(root)

    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv(CHECKPOINT_ROOT_ENV)
    assert cli_resume(run.info.run_id, cfg.mlflow.tracking_uri) == 2  # ./gradmon-checkpoints here is not it
    monkeypatch.setenv(CHECKPOINT_ROOT_ENV, str(root))
    assert cli_resume(run.info.run_id, cfg.mlflow.tracking_uri) == 0
    state = newest_state(root, run.info.run_id)
    assert state["iterations_done"] == 3 and state["run_id"] == run.info.run_id
    assert sorted(p.name for p in elsewhere.iterdir() if "mlflow" not in p.name) == []
    _, point = resume_point(cfg.mlflow.tracking_uri, run.info.run_id, iterations=4)  # 3 of 3: trained on
    assert point.iterations_done == 3


def test_a_resume_that_logs_no_new_iteration_still_tags_the_run_as_resumed(
    ray_session, tmp_path, cli_resume, monkeypatch
):
    """Ctrl-C right after the last iteration was logged (checkpoint at 2 of 3): ``--resume``
    trains iteration 3 again and logs nothing new for it, and the run still gets its resume
    tags (from 2, 3-3 recomputed, the restored state's digest), as a resume that trains on does.
    While it trains, the run left KILLED is RUNNING again (what ``watch --run-id`` follows)."""
    from gradmon_ray.app.train.messages import ProgressPrinter

    cfg = resumable_config(tmp_path, iterations=3, checkpoint_every=2)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, progress=_interrupt_after(3, 3))
    client = MlflowClient(cfg.mlflow.tracking_uri)
    run_id = _only_run(client).info.run_id
    digest = _on_disk(tmp_path)["state_digest"]
    assert client.get_run(run_id).info.status == "KILLED"
    while_training = []
    printed = ProgressPrinter.__call__

    def recording(self: ProgressPrinter, line: str) -> None:
        if line.startswith("iter "):
            while_training.append(client.get_run(run_id).info.status)
        printed(self, line)

    monkeypatch.setattr(ProgressPrinter, "__call__", recording)
    assert cli_resume(run_id, cfg.mlflow.tracking_uri) == 0
    assert while_training == ["RUNNING"]  # iteration 3, trained again
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[mn.TAG_RESUMED_FROM] == "2"
    assert run.data.tags[mn.TAG_RECOMPUTED_ITERATIONS] == "3-3"
    assert run.data.tags[mn.TAG_RESUMED_STATE_DIGEST] == digest
    assert _steps(client, run_id, mn.LEARNERS_UPDATED) == [1, 2, 3]
