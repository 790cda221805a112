"""What ``train`` prints at a run's start and after Ctrl-C, and ``--checkpoint-dir`` (issues #27, #28),
without Ray: checkpoints written on disk by the real ``CheckpointReporter`` from a real learner, a
real sqlite store, the printed resume command parsed by the CLI's own parser and run through
``--resume``'s own checkpoint lookup (``resume_point``), whose answer is compared with the files on disk.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app import cli
from gradmon_ray.app.cli_common import TrackingUri
from gradmon_ray.app.train.checkpoints import LATEST, RESUME_FILE, CheckpointReporter
from gradmon_ray.app.train.messages import ProgressPrinter, interrupted_lines, resume_argv, started_line
from gradmon_ray.app.train.mlflow_run import RunStarted
from gradmon_ray.app.train.resume import CHECKPOINT_ROOT_ENV, resume_point
from gradmon_ray.app.train.run import TrainingOutcome
from tests.app.conftest import Learners

RESUME_WITH = "resume it (from this directory) with: "


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No checkpoint root or store from the environment; ``tmp_path`` is the working directory."""
    monkeypatch.delenv(CHECKPOINT_ROOT_ENV, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)


def _run(store: str, root: Path, name: str = "FactoredOps-v0-20250304-120509-ab12") -> str:
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("interrupted")
    tags = {mn.TAG_CHECKPOINT_DIR: str(root)}
    return client.create_run(exp.experiment_id, run_name=name, tags=tags).info.run_id


def _checkpoint(learners: Learners, root: Path, run_id: str, iteration: int) -> None:
    CheckpointReporter(learners.cfg, lambda timeout_s: run_id, root=root).save(iteration, learners.at("a"), None)


def _on_disk(root: Path, run_id: str) -> dict[str, Any]:
    return json.loads((root / run_id / LATEST / RESUME_FILE).read_text())


def _outcome(run_id: str | None, root: Path | None, done: int) -> TrainingOutcome:
    return TrainingOutcome(run_id=run_id, iterations_done=done, checkpoint_root=str(root) if root else None)


def _printed_command(lines: list[str]) -> list[str]:
    (line,) = [line for line in lines if RESUME_WITH in line]
    return shlex.split(line.split(RESUME_WITH, 1)[1])


def test_the_printed_command_resumes_from_the_checkpoint_on_disk(store, learners, tmp_path):
    """A store and a checkpoint root that are not the defaults here: the command names both; parsed
    by the CLI's parser, it leads ``--resume``'s lookup to the checkpoint the disk holds."""
    root = tmp_path / "ckpts"
    run_id = _run(store, root)
    _checkpoint(learners, root, run_id, 4)
    lines = interrupted_lines(_outcome(run_id, root, 5), TrackingUri.of(store), 20)
    assert lines[0] == (
        f"gradmon-ray: interrupted: MLflow run {run_id} ended KILLED after iteration 5 of 20, "
        f"checkpointed at iteration {_on_disk(root, run_id)['iterations_done']}"
    )
    argv = _printed_command(lines)
    assert argv[0] == "gradmon-ray"
    args = cli.build_parser().parse_args(argv[1:])
    assert (args.command, args.resume, args.mlflow_uri, args.checkpoint_dir) == ("train", run_id, store, str(root))
    _, point = resume_point(args.mlflow_uri, args.resume, args.checkpoint_dir)
    assert Path(point.checkpoint_path) == (root / run_id / LATEST).resolve() / "algo"
    assert point.iterations_done == 4


def test_defaults_are_left_out_of_the_printed_command(store, learners, tmp_path, monkeypatch):
    """The store ``MLFLOW_TRACKING_URI`` names and ``./gradmon-checkpoints``: ``--resume RUN_ID`` alone."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    root = tmp_path / "gradmon-checkpoints"
    run_id = _run(store, root)
    _checkpoint(learners, root, run_id, 2)
    argv = _printed_command(interrupted_lines(_outcome(run_id, root, 2), TrackingUri.of(store), 3))
    assert argv == ["gradmon-ray", "train", "--resume", run_id]
    _, point = resume_point(store, run_id)  # what that bare command finds
    assert point.iterations_done == 2


def test_a_uri_with_a_password_is_printed_masked_and_said_so(learners, tmp_path):
    uri = "http://bob:S3cret-99@mlflow.example:5000"
    root = tmp_path / "gradmon-checkpoints"
    _checkpoint(learners, root, "f" * 32, 1)
    lines = interrupted_lines(_outcome("f" * 32, root, 1), TrackingUri.of(uri), 3)
    text = "\n".join(lines)
    assert "S3cret-99" not in text
    assert _printed_command(lines)[-2:] == ["--mlflow-uri", "http://bob:***@mlflow.example:5000"]
    assert "credentials are masked as ***" in lines[-1]


def test_no_command_when_nothing_can_be_resumed(store, learners, tmp_path):
    root = tmp_path / "gradmon-checkpoints"
    run_id = _run(store, root)
    (no_checkpoint,) = interrupted_lines(_outcome(run_id, root, 2), TrackingUri.of(store), 20)
    assert "no checkpoint of it was saved yet, so it cannot be resumed" in no_checkpoint
    (off,) = interrupted_lines(_outcome(run_id, None, 2), TrackingUri.of(store), 20)
    assert "checkpoints are off (checkpoint_every: 0)" in off
    other = _run(store, root)
    _checkpoint(learners, root, other, 1)  # another run's checkpoint in the same root does not count
    (not_mine,) = interrupted_lines(_outcome(run_id, root, 2), TrackingUri.of(store), 20)
    assert "cannot be resumed" in not_mine
    (never,) = interrupted_lines(_outcome(None, root, 2), TrackingUri.of(store), 20)
    assert "MLflow never created the run, it cannot be resumed" in never


def test_the_start_line_names_the_run_and_masks_the_store(capsys):
    uri = "http://u:pw-1@h:5000"
    ProgressPrinter(TrackingUri.of(uri)).run_started(RunStarted("a" * 32, "CartPole-v1-x", "gradmon-ray", uri))
    out = capsys.readouterr().out
    assert (
        out
        == f"gradmon-ray: MLflow run {'a' * 32} (CartPole-v1-x) in experiment 'gradmon-ray' at http://u:***@h:5000\n"
    )
    assert "has not created the run yet" in started_line(
        RunStarted(None, None, "e", "sqlite:///m.db"), "sqlite:///m.db"
    )


def test_resume_argv_gives_an_absolute_checkpoint_dir(tmp_path):
    argv = resume_argv("r" * 32, TrackingUri.of("sqlite:///mlflow.db"), Path("elsewhere"))
    assert argv == ["gradmon-ray", "train", "--resume", "r" * 32, "--checkpoint-dir", str(tmp_path / "elsewhere")]


def _fake_training(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    import gradmon_ray.app.train.run

    seen: dict[str, Any] = {}

    def fake_run_training(cfg, progress=None, checked=False, sink=None, resume=None):
        seen.update(cfg=cfg, resume=resume)
        if sink is not None:
            sink.close()
        return TrainingOutcome(run_id="r", iterations_done=cfg.iterations, mlflow_complete=True)

    monkeypatch.setattr(gradmon_ray.app.train.run, "run_training", fake_run_training)
    return seen


def test_checkpoint_dir_flag_sets_the_root_of_a_new_run(monkeypatch, tmp_path, capsys):
    seen = _fake_training(monkeypatch)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    assert cli.main(["train", "--mlflow-uri", uri, "--checkpoint-dir", "mine", "--iterations", "1"]) == 0
    assert seen["cfg"].checkpoint_dir == "mine"
    assert cli.main(["train", "--mlflow-uri", uri, "--iterations", "1", "--set", "checkpoint_dir=cfg"]) == 0
    assert seen["cfg"].checkpoint_dir == "cfg"
    args = ["train", "--mlflow-uri", uri, "--iterations", "1", "--set", "checkpoint_dir=cfg", "--checkpoint-dir", "f"]
    assert cli.main(args) == 0
    assert seen["cfg"].checkpoint_dir == "cfg"  # --set is applied last, as for every other flag


def test_checkpoint_dir_flag_is_the_root_resume_loads_from(store, learners, tmp_path, monkeypatch, capsys):
    """Checkpoints outside ``./gradmon-checkpoints``: refused without the flag (exit 2), loaded from
    the flag's root with it (the point handed to training is the checkpoint on disk)."""
    seen = _fake_training(monkeypatch)
    root = tmp_path / "kept"
    run_id = _run(store, root)
    _checkpoint(learners, root, run_id, 3)
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", store]) == 2
    assert "outside the allowed checkpoint root" in capsys.readouterr().err
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", store, "--checkpoint-dir", str(root)]) == 0
    point = seen["resume"]
    assert Path(point.checkpoint_path) == (root / run_id / LATEST).resolve() / "algo"
    assert point.iterations_done == _on_disk(root, run_id)["iterations_done"] == 3


@pytest.mark.parametrize("flag", [["--run-name", "other"], ["--experiment", "other"], ["--seed", "3"]])
def test_resume_keeps_the_runs_own_name_and_config(store, flag, capsys):
    assert cli.main(["train", "--resume", "0" * 32, "--mlflow-uri", store, *flag]) == 2
    err = capsys.readouterr().err
    assert err == (
        "gradmon-ray: config error: --resume: takes the run's own config; "
        "only --iterations, --mlflow-uri, --checkpoint-dir and --ray-address may be given\n"
    )


def test_a_resumed_run_is_running_again_before_its_first_iteration(store, learners, tmp_path, monkeypatch):
    """A run left KILLED (Ctrl-C) is resumed: by the time ``run_training`` has waited for its sink's
    first try at MLflow (``_TrainingRun.announce``, before the first iteration), MLflow has the run
    RUNNING with our status tag "running" again, so that ``watch --run-id`` follows it; it ends
    FINISHED.  Only the training is a stand-in (Ray would start): the sink is ``--resume``'s own."""
    import gradmon_ray.app.train.run
    import gradmon_ray.rllib.preflight
    from gradmon_ray.app.train.run import _TrainingRun

    root = tmp_path / "gradmon-checkpoints"
    run_id = _run(store, root)
    _checkpoint(learners, root, run_id, 2)
    client = MlflowClient(store)
    client.set_tag(run_id, mn.TAG_STATUS, "killed")
    client.set_terminated(run_id, "KILLED")
    at_first_iteration = {}

    def training(cfg, progress=None, sink=None, resume=None, checked=False):
        _TrainingRun(cfg, sink, progress, None, resume, False).announce()
        run = client.get_run(run_id)
        at_first_iteration.update(status=run.info.status, tag=run.data.tags[mn.TAG_STATUS])
        sink.close(status="FINISHED")
        return TrainingOutcome(run_id=run_id, iterations_done=cfg.iterations, mlflow_complete=True)

    monkeypatch.setattr(gradmon_ray.app.train.run, "run_training", training)
    # the env and model checks (test_resume_flags checks resume runs them) build the model: 1.5 s here
    monkeypatch.setattr(gradmon_ray.rllib.preflight, "preflight", lambda cfg: None)
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", store]) == 0
    assert at_first_iteration == {"status": "RUNNING", "tag": "running"}
    assert client.get_run(run_id).info.status == "FINISHED"
