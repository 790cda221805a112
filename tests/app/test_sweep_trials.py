"""``app/sweep/trials.py``: a retried Tune trial delivers what its failed attempt spilled before it
trains again (issue #46 item 4), as ``train --resume`` does, in the fast lane: Tune's own
``Checkpoint`` of a local directory (no Ray started), the spill file written by the real
``SpillWriter``, a real sqlite store.

The failed attempt logged iterations 1-2, then MLflow lagged: 3-7 went to its spill file; its
checkpoint is at 5.  The retry must hand ``run_training`` "logged through 7", with MLflow holding
every step once, at the value the spill file holds, so that neither the recomputed 6-7 nor a later
``gradmon-ray replay`` of the file adds a second point.  Values come from the formula they were
written with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from ray.tune import Checkpoint

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import main
from gradmon_ray.app.sweep.trials import TRIAL_STATE_FILE, _resume_point
from gradmon_ray.config import config_from_dict
from gradmon_ray.tracking.spill import REPLAYED_SUFFIX, SpillWriter
from tests.e2e.processes import free_port

T0, LOGGED, SPILLED, CHECKPOINTED = 1_700_000_000_000, [1, 2], [3, 4, 5, 6, 7], 5


def value(step: int) -> float:
    """The oracle: metric ``m`` at ``step``, in MLflow and in the spill file alike."""
    return step * 1.5 - 0.25


@pytest.fixture
def failed_attempt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, Path, Checkpoint]:
    """The trial's run (steps ``LOGGED`` in MLflow), its spill file in ``./gradmon-spill`` (the trial's
    working directory, as Tune keeps it across attempts) and Tune's checkpoint at ``CHECKPOINTED``."""
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("sweep")).info.run_id
    for step in LOGGED:
        client.log_metric(run_id, mn.LEARNERS_UPDATED, 1.0, timestamp=T0 + step, step=step)
        client.log_metric(run_id, "m", value(step), timestamp=T0 + step, step=step)
    spill = Path("gradmon-spill") / "heads_00000-20250304T120509Z-77.jsonl"
    writer = SpillWriter(spill, {"tracking_uri": store, "experiment": "sweep", "run_id": run_id})
    items = [(s, T0 + s, {mn.LEARNERS_UPDATED: 1.0, "m": value(s)}, {}) for s in SPILLED]
    writer.write_iterations(items, run_id, SPILLED)
    writer.write_trailer(run_id, "FAILED")  # the attempt's close, its learner lost
    directory = tmp_path / "tune-checkpoint"
    (directory / "algo").mkdir(parents=True)
    state = {"run_id": run_id, "iterations_done": CHECKPOINTED, "health": {}, "state_digest": "d" * 64}
    (directory / TRIAL_STATE_FILE).write_text(json.dumps(state))
    return store, run_id, spill, Checkpoint.from_directory(str(directory))


def _cfg(store: str):
    return config_from_dict({"mlflow": {"tracking_uri": store, "experiment": "sweep"}})


def _each_step_once(store: str, run_id: str) -> list[tuple[int, float]]:
    return sorted((p.step, p.value) for p in MlflowClient(store).get_metric_history(run_id, "m"))


def test_a_retry_delivers_the_failed_attempts_spill_before_it_trains(failed_attempt, capsys):
    store, run_id, spill, checkpoint = failed_attempt
    resume, resumed_run = _resume_point(_cfg(store), checkpoint)
    shutil.rmtree(Path(resume.checkpoint_path).parent)  # run_trial's own cleanup
    assert resumed_run == run_id and resume.iterations_done == CHECKPOINTED
    assert resume.logged_through == SPILLED[-1]  # 6 and 7, trained again, are not logged again
    assert _each_step_once(store, run_id) == [(s, value(s)) for s in [*LOGGED, *SPILLED]]
    assert not spill.exists() and spill.with_name(spill.name + REPLAYED_SUFFIX).exists()
    assert f"delivered 5 iterations of run {run_id}" in capsys.readouterr().out
    assert main(["replay", str(spill), "--tracking-uri", store]) == 0  # the user's replay afterwards
    assert "was replayed already" in capsys.readouterr().out
    assert _each_step_once(store, run_id) == [(s, value(s)) for s in [*LOGGED, *SPILLED]]


def test_a_retry_while_mlflow_is_down_trains_on_and_leaves_the_spill_for_a_replay(failed_attempt, caplog, monkeypatch):
    """MLflow does not answer the retry: the trial is not failed for it; the file stays, a warning names
    the replay, and the iterations it holds count as logged (replayed later, never logged twice)."""
    store, run_id, spill, checkpoint = failed_attempt
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # what `gradmon-ray tune` sets: failures are quick
    down = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level("WARNING", logger="gradmon_ray"):
        resume, _ = _resume_point(_cfg(down), checkpoint)
    shutil.rmtree(Path(resume.checkpoint_path).parent)
    assert resume.logged_through == SPILLED[-1] and spill.exists()
    assert f"deliver it with: gradmon-ray replay {spill.resolve()} --tracking-uri {down}; the retried" in caplog.text
    assert main(["replay", str(spill), "--tracking-uri", store]) == 0  # MLflow back: the user replays
    assert _each_step_once(store, run_id) == [(s, value(s)) for s in [*LOGGED, *SPILLED]]
