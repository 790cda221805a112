"""``train --resume`` and the outage's spill file (issue #37 item 4), a finished run, a run's name, in
the fast lane: real checkpoints (the real ``CheckpointReporter``), a real sqlite store, the spill
file written by the real ``SpillWriter``; only ``run_training`` is replaced where Ray would start.

The run logged iterations 1-2, then its server went down: 3-7 went to the spill file; its
checkpoint is at 5.  Whichever of ``--resume`` and ``replay`` runs first, MLflow ends with every
step once, at the value the spill file holds, and the resume logs nothing up to 7 again."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app import cli
from gradmon_ray.app.cli_common import TrackingUri
from gradmon_ray.app.train.messages import interrupted_lines
from gradmon_ray.app.train.resume import CHECKPOINT_ROOT_ENV, spill_directories
from gradmon_ray.app.train.run import TrainingOutcome
from gradmon_ray.tracking.spill import REPLAYED_SUFFIX, SpillWriter
from tests.app.conftest import Learners
from tests.app.test_resume_command import _fake_training, _run
from tests.app.test_resume_flags import DONE, _interrupted

T0, LOGGED, SPILLED = 1_700_000_000_000, [1, 2], [3, 4, 5, 6, 7]


def value(step: int) -> float:
    """The oracle: metric ``m`` at ``step``, in MLflow and in the spill file alike."""
    return step * 1.5 - 0.25


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (CHECKPOINT_ROOT_ENV, "MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def store(tmp_path: Path) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).create_experiment("interrupted")
    return uri


def _outage(store: str, learners: Learners, bad_key: bool = False) -> tuple[str, Path]:
    """The run (checkpoint at ``DONE``) with ``LOGGED`` in MLflow and ``SPILLED`` in ./gradmon-spill."""
    run_id = _interrupted(store, learners)
    client = MlflowClient(store)
    for step in LOGGED:
        client.log_metric(run_id, mn.LEARNERS_UPDATED, 1.0, timestamp=T0 + step, step=step)
        client.log_metric(run_id, "m", value(step), timestamp=T0 + step, step=step)
    spill = Path("gradmon-spill") / "run-20250304T120509Z-77.jsonl"
    writer = SpillWriter(spill, {"tracking_uri": "http://127.0.0.1:9", "experiment": "interrupted", "run_id": None})
    key = "bad?key" if bad_key else "m"
    items = [(s, T0 + s, {mn.LEARNERS_UPDATED: 1.0, key: value(s)}, {}) for s in SPILLED]
    writer.write_iterations(items, run_id, SPILLED)
    writer.write_trailer(run_id, "KILLED")
    return run_id, spill


def _assert_each_step_once(store: str, run_id: str) -> None:
    client = MlflowClient(store)
    steps = [*LOGGED, *SPILLED]
    assert sorted((p.step, p.value) for p in client.get_metric_history(run_id, "m")) == [(s, value(s)) for s in steps]
    assert sorted(p.step for p in client.get_metric_history(run_id, mn.LEARNERS_UPDATED)) == steps


def _another_runs_spill(store: str) -> Path:
    other = Path("gradmon-spill") / "other.jsonl"
    SpillWriter(other, {"experiment": "interrupted"}).write_iterations([(1, T0, {"m": 9.0}, {})], "f" * 32, [1])
    return other


def test_resume_delivers_the_spill_first_and_a_replay_after_it_has_nothing_to_do(store, learners, monkeypatch, capsys):
    seen = _fake_training(monkeypatch)
    run_id, spill = _outage(store, learners)
    other = _another_runs_spill(store)
    before = other.read_bytes()
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", store]) == 0
    out = capsys.readouterr().out
    assert f"gradmon-ray: delivered 5 iterations of run {run_id} that {spill.resolve()} kept during an outage\n" in out
    assert seen["resume"].logged_through == SPILLED[-1] and seen["resume"].iterations_done == DONE
    assert not spill.exists() and spill.with_name(spill.name + REPLAYED_SUFFIX).exists()
    assert other.read_bytes() == before  # another run's file: not touched
    assert cli.main(["replay", str(spill), "--tracking-uri", store]) == 0
    assert "was replayed already" in capsys.readouterr().out
    _assert_each_step_once(store, run_id)


def test_a_replay_before_the_resume_leaves_it_nothing_to_deliver(store, learners, monkeypatch, capsys):
    seen = _fake_training(monkeypatch)
    run_id, spill = _outage(store, learners)
    assert cli.main(["replay", str(spill), "--tracking-uri", store]) == 0
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", store]) == 0
    assert "delivered" not in capsys.readouterr().out
    assert seen["resume"].logged_through == SPILLED[-1]
    _assert_each_step_once(store, run_id)


def test_a_spill_file_that_cannot_be_delivered_refuses_the_resume_naming_the_replay(
    store, learners, monkeypatch, capsys
):
    """A metric name MLflow refuses (``bad?key``): one line naming the file and the command; nothing trained."""
    seen = _fake_training(monkeypatch)
    run_id, spill = _outage(store, learners, bad_key=True)
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", store]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    head = f"gradmon-ray: config error: --resume: could not deliver run {run_id}'s outage spill first ("
    assert line.startswith(head)
    assert "bad?key" in line  # MLflow's reason
    assert line.endswith(f"; deliver it with: gradmon-ray replay {spill.resolve()} --tracking-uri {store}, then resume")
    assert len(line) - len(str(spill.resolve())) - len(store) <= 300 and seen == {} and spill.exists()


def test_a_complete_run_is_refused_before_ray_and_more_iterations_are_taken(store, learners, monkeypatch, capsys):
    """FINISHED with all its 20 iterations in MLflow, its checkpoint at 5: refused; --iterations 21 trains on."""
    seen = _fake_training(monkeypatch)
    run_id = _interrupted(store, learners)
    client, own = MlflowClient(store), learners.cfg.iterations
    for step in range(1, own + 1):
        client.log_metric(run_id, mn.LEARNERS_UPDATED, 1.0, step=step)
    client.set_terminated(run_id, "FINISHED")
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", store]) == 2
    assert capsys.readouterr().err == (
        f"gradmon-ray: config error: --resume: run {run_id} is complete: it has all {own} iterations (FINISHED); "
        f"to train it further, give --iterations N with N > {own}\n"
    )
    assert seen == {}
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", store, "--iterations", str(own + 1)]) == 0
    assert seen["cfg"].iterations == own + 1 and seen["resume"].logged_through == own


def test_a_run_checkpointed_after_its_last_iteration_is_refused(store, learners, monkeypatch, capsys):
    seen = _fake_training(monkeypatch)
    cfg = learners.cfg.model_copy(update={"iterations": DONE})
    run_id = _interrupted(store, learners, cfg)  # KILLED or never closed: the checkpoint has every iteration
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", store]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(f"is complete: it has all {DONE} iterations (RUNNING); to train it further, give "
                         f"--iterations N with N > {DONE}")  # fmt: skip
    assert seen == {}


def test_resume_takes_a_name_only_one_run_has(store, learners, monkeypatch, capsys):
    seen = _fake_training(monkeypatch)
    run_id = _interrupted(store, learners)
    name = MlflowClient(store).get_run(run_id).info.run_name
    assert cli.main(["train", "--resume", name, "--mlflow-uri", store]) == 0
    assert f"gradmon-ray: resuming run {run_id} after iteration {DONE} of " in capsys.readouterr().out
    assert seen["resume"].iterations_done == DONE
    twin = _run(store, Path.cwd() / "gradmon-checkpoints", name=name)
    assert cli.main(["train", "--resume", name, "--mlflow-uri", store]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"gradmon-ray: config error: --resume: 2 runs are named '{name}', started: {twin} (")
    assert cli.main(["train", "--resume", "no-such-run", "--mlflow-uri", store]) == 2
    assert capsys.readouterr().err == (
        f"gradmon-ray: config error: --resume: no run 'no-such-run' at {store}: no run has that id or name\n"
    )


def test_spill_directories_are_the_runs_own_here_and_where_it_started(tmp_path):
    root = tmp_path / "start" / "ck" / "pts"
    assert spill_directories("/abs/spill", "ck/pts", root) == [Path("/abs/spill")]
    assert spill_directories("sp", "ck/pts", root) == [Path.cwd() / "sp", tmp_path / "start" / "sp"]
    assert spill_directories("sp", None, tmp_path / "start" / "gradmon-checkpoints") == [
        Path.cwd() / "sp",
        tmp_path / "start" / "sp",
    ]
    assert spill_directories("sp", str(root), root) == [Path.cwd() / "sp"]  # an absolute root tells nothing


def test_the_interrupted_message_says_the_resume_delivers_the_spill(store, learners, tmp_path):
    run_id = _interrupted(store, learners)
    spill = tmp_path / "gradmon-spill" / "x y.jsonl"
    outcome = TrainingOutcome(run_id, 6, checkpoint_root=str(tmp_path / "gradmon-checkpoints"), spill_path=str(spill))
    lines = interrupted_lines(outcome, TrackingUri.of(store), 20)
    assert lines[-1] == (
        f"gradmon-ray: iterations MLflow did not take are kept in {spill}: the resume delivers them first "
        f"(or now: gradmon-ray replay '{spill}'); leave the file there till then"
    )
