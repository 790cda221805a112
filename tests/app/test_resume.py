"""``train --resume``'s guards in the fast lane (no Ray): each against a checkpoint written on disk by
the real ``CheckpointReporter`` from a real learner, and a run in a real sqlite MLflow store.

- the digest: ``resume_point`` hands on the digest written with the checkpoint (read off the
  learner when it was saved), and ``verify_restored_state`` refuses a restore that differs;
- the run id: a checkpoint that names another run is refused;
- the root: only a checkpoint under the allowed root is loaded, after resolving ``..`` and symlinks;
  through the CLI that is exit 2 and one line, before Ray or MLflow writes anything.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app import cli
from gradmon_ray.app.train.checkpoints import (
    RESUME_FILE,
    CheckpointReporter,
    CheckpointStateMismatchError,
    verify_restored_state,
)
from gradmon_ray.app.train.resume import CHECKPOINT_ROOT_ENV, resume_point
from gradmon_ray.config import ConfigError
from tests.app.conftest import Learners


@pytest.fixture(autouse=True)
def _no_root_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CHECKPOINT_ROOT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite MLflow store for the module (creating one costs seconds); every test makes its own runs."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"
    MlflowClient(uri).create_experiment("resume")
    return uri


def _run(store: str, root: Path, logged_through: int = 0) -> tuple[str, str]:
    """A run in ``store``, tagged as ``train`` tags it, with ``update/trained`` logged up to ``logged_through``."""
    uri = store
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("resume") or client.get_experiment(client.create_experiment("resume"))
    run_id = client.create_run(exp.experiment_id, tags={mn.TAG_CHECKPOINT_DIR: str(root)}).info.run_id
    for step in range(1, logged_through + 1):
        client.log_metric(run_id, mn.LEARNERS_UPDATED, 1.0, step=step)
    return uri, run_id


def _checkpoint(learners: Learners, root: Path, run_id: str, iteration: int, which: str) -> None:
    CheckpointReporter(learners.cfg, lambda timeout_s: run_id, root=root)(iteration, {}, learners.at(which), None, None)


def test_resume_point_carries_the_digest_written_with_the_checkpoint(store: str, learners: Learners, tmp_path: Path):
    """The guard the seeded bug disabled (the digest read under the wrong key, so nothing was
    compared): the point's digest is the learner's own at save time, restoring the point's
    algorithm gives it back, and the check passes only for that digest."""
    root = tmp_path / "gradmon-checkpoints"
    uri, run_id = _run(store, root, logged_through=3)
    _checkpoint(learners, root, run_id, 2, "b")
    cfg, point = resume_point(uri, run_id)
    assert point.state_digest == learners.digest_b
    assert point.iterations_done == 2 and point.logged_through == 3
    assert point.checkpoint_root == str(root) and cfg.checkpoint_dir == str(root)
    assert cfg.ppo.train_batch_size == learners.cfg.ppo.train_batch_size
    restored = learners.restored_digest(Path(point.checkpoint_path))
    verify_restored_state(point.state_digest, restored, point.checkpoint_path)  # passes
    with pytest.raises(CheckpointStateMismatchError, match="not the one written with it"):
        verify_restored_state(point.state_digest, learners.digest_a, point.checkpoint_path)
    with pytest.raises(CheckpointStateMismatchError, match="records no learner state digest"):
        verify_restored_state(None, restored, point.checkpoint_path)


def test_a_checkpoint_whose_algorithm_is_from_another_save_fails_the_digest_check(
    store: str, learners: Learners, tmp_path: Path
):
    """``algo/`` of the iteration-1 save under the iteration-2 resume file (two saves mixed by hand):
    the restored learner's digest is a's, the recorded one b's, and the check refuses it."""
    root = tmp_path / "gradmon-checkpoints"
    uri, run_id = _run(store, root)
    _checkpoint(learners, root, run_id, 1, "a")
    (first,) = (root / run_id).glob("ckpt-*")
    shutil.copytree(first / "algo", tmp_path / "algo-1")
    _checkpoint(learners, root, run_id, 2, "b")
    (second,) = (root / run_id).glob("ckpt-*")
    shutil.rmtree(second / "algo")
    shutil.copytree(tmp_path / "algo-1", second / "algo")
    state = json.loads((second / RESUME_FILE).read_text())
    files = [p for p in (second / "algo").rglob("*") if p.is_file()]
    manifest = {p.relative_to(second / "algo").as_posix(): p.stat().st_size for p in files}
    (second / RESUME_FILE).write_text(json.dumps({**state, "manifest": manifest}))  # a careful mixer
    _, point = resume_point(uri, run_id)
    assert point.iterations_done == 2 and point.state_digest == learners.digest_b
    restored = learners.restored_digest(Path(point.checkpoint_path))
    assert restored == learners.digest_a
    with pytest.raises(CheckpointStateMismatchError, match="not the one written with it"):
        verify_restored_state(point.state_digest, restored, point.checkpoint_path)


def test_a_checkpoint_without_a_digest_is_refused(store: str, learners: Learners, tmp_path: Path):
    root = tmp_path / "gradmon-checkpoints"
    uri, run_id = _run(store, root)
    _checkpoint(learners, root, run_id, 1, "a")
    (version,) = (root / run_id).glob("ckpt-*")
    state = json.loads((version / RESUME_FILE).read_text())
    (version / RESUME_FILE).write_text(json.dumps({k: v for k, v in state.items() if k != "state_digest"}))
    with pytest.raises(ConfigError, match="records no learner state digest"):
        resume_point(uri, run_id)


def test_a_checkpoint_naming_another_run_is_refused(store: str, learners: Learners, tmp_path: Path):
    """The run's directory holds a checkpoint another run wrote (copied in by hand): refused,
    naming the run it belongs to."""
    root = tmp_path / "gradmon-checkpoints"
    uri, run_id = _run(store, root)
    other = "e" * 32
    _checkpoint(learners, root, other, 1, "a")
    (root / other).rename(root / run_id)
    with pytest.raises(ConfigError, match=f"belongs to run {other}, not {run_id}"):
        resume_point(uri, run_id)


def test_runs_sharing_a_root_each_resume_from_their_own(store: str, learners: Learners, tmp_path: Path):
    root = tmp_path / "gradmon-checkpoints"
    uri, first = _run(store, root)
    _, second = _run(store, root)
    _checkpoint(learners, root, first, 1, "a")
    _checkpoint(learners, root, second, 2, "b")
    assert resume_point(uri, first)[1].state_digest == learners.digest_a
    assert resume_point(uri, second)[1].state_digest == learners.digest_b


def test_a_run_without_a_checkpoint_is_refused(store: str, learners: Learners, tmp_path: Path):
    root = tmp_path / "gradmon-checkpoints"
    uri, run_id = _run(store, root)
    with pytest.raises(ConfigError, match=f"no complete checkpoint of run {run_id}"):
        resume_point(uri, run_id)


@pytest.mark.parametrize(
    "tag",
    [
        lambda tmp: tmp / "elsewhere",  # a directory outside the root
        lambda tmp: tmp / "gradmon-checkpoints" / ".." / "elsewhere",  # inside, until `..` is resolved
    ],
    ids=["outside", "dot-dot"],
)
def test_a_tag_pointing_outside_the_root_is_refused(store: str, learners: Learners, tmp_path: Path, tag: Any):
    """Anyone who can write a tag can point ``gradmon.checkpoint_dir`` at a pickle of theirs: a
    complete, valid-looking checkpoint there is still not loaded."""
    target = tag(tmp_path)
    uri, run_id = _run(store, target)
    _checkpoint(learners, (tmp_path / "elsewhere"), run_id, 1, "a")
    with pytest.raises(ConfigError, match=r"outside the allowed checkpoint root .*gradmon-checkpoints"):
        resume_point(uri, run_id)
    assert resume_point(uri, run_id, tmp_path / "elsewhere")[1].iterations_done == 1  # allowed when given


def test_a_run_directory_symlinked_out_of_the_root_is_refused(store: str, learners: Learners, tmp_path: Path):
    root = tmp_path / "gradmon-checkpoints"
    uri, run_id = _run(store, root)
    _checkpoint(learners, tmp_path / "evil", run_id, 1, "a")
    root.mkdir()
    (root / run_id).symlink_to(tmp_path / "evil" / run_id, target_is_directory=True)
    with pytest.raises(ConfigError, match=r"resolves to .*evil.*, outside"):
        resume_point(uri, run_id)


@pytest.mark.parametrize("given", ["root", "run-dir", "env", "dot-dot"])
def test_the_root_or_the_runs_directory_can_be_given(
    store: str, learners: Learners, tmp_path: Path, monkeypatch, given: str
):
    """The checkpoint root may be given as the root, the run's own directory, the environment
    variable, or a path that resolves to the root; the run then renews its checkpoints there."""
    root = tmp_path / "store" / "ckpts"
    uri, run_id = _run(store, root)
    _checkpoint(learners, root, run_id, 1, "a")
    where: Path | None = {"root": root, "run-dir": root / run_id, "dot-dot": root / "x" / ".."}.get(given)
    if given == "env":
        monkeypatch.setenv(CHECKPOINT_ROOT_ENV, str(root))
    _, point = resume_point(uri, run_id, where)
    assert point.state_digest == learners.digest_a
    assert Path(point.checkpoint_root).resolve() == root.resolve()


def test_a_checkpoint_in_the_layout_before_per_run_directories_still_resumes(
    store: str, learners: Learners, tmp_path: Path
):
    """``<root>/latest/{algo, gradmon_resume.json}``, as the previous release wrote it."""
    root = tmp_path / "gradmon-checkpoints"
    uri, run_id = _run(store, root)
    _checkpoint(learners, root, run_id, 1, "a")
    (version,) = (root / run_id).glob("ckpt-*")
    state = json.loads((version / RESUME_FILE).read_text())
    shutil.copytree(version / "algo", root / "latest" / "algo")
    (root / "latest" / RESUME_FILE).write_text(json.dumps({k: v for k, v in state.items() if k != "manifest"}))
    shutil.rmtree(root / run_id)
    _, point = resume_point(uri, run_id)
    assert point.checkpoint_path == str(root / "latest" / "algo") and point.state_digest == learners.digest_a


def test_cli_resume_outside_the_root_exits_2_with_one_line(store: str, learners: Learners, tmp_path: Path, capsys):
    """Through ``gradmon-ray train --resume``: exit 2, one line naming the root and how to allow
    the directory, no traceback, and no Ray started, nothing written to the run."""
    import ray

    uri, run_id = _run(store, tmp_path / "elsewhere")
    _checkpoint(learners, tmp_path / "elsewhere", run_id, 1, "a")
    capsys.readouterr()  # MLflow's notes on creating the store above
    ray_before = ray.is_initialized()  # an e2e test earlier in the session may have started one
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", uri]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "outside the allowed checkpoint root" in err[0] and CHECKPOINT_ROOT_ENV in err[0], err
    assert ray.is_initialized() == ray_before  # this command started no Ray
    run = MlflowClient(uri).get_run(run_id)
    assert run.data.metrics == {} and mn.TAG_RESUMED_FROM not in run.data.tags


def test_cli_resume_of_a_run_the_store_does_not_hold_exits_2_with_one_line(store: str, capsys):
    """``train --resume`` with a run id that is in no experiment: exit 2, one line saying so with
    the store (the id as given), and no Ray started."""
    import ray

    missing = "0" * 32
    capsys.readouterr()
    ray_before = ray.is_initialized()
    assert cli.main(["train", "--resume", missing, "--mlflow-uri", store]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"gradmon-ray: config error: --resume: no run '{missing}' at "), err
    assert ray.is_initialized() == ray_before  # this command started no Ray


def test_a_resumed_runs_probe_logs_no_iteration_mlflow_has_already(tmp_path):
    """The interrupted attempt logged probe metrics up to iteration 3; the resumed run trains 3 again
    (``skip_through``: its ``logged_through``) and 4: the probe of 3 is run but not logged a second
    time, the probe of 4 is.  The probe is the real ``GradientProbe`` on the designed batch, in this
    process, writing to a real sqlite store; the oracle is the steps MLflow holds."""
    from gradmon_ray.probe.actor import GradientProbe
    from tests.probe.designed_batch import designed_module_and_batch, probe_request

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("probe")).info.run_id
    client.log_metric(run_id, mn.PROBE_DURATION_S, 0.5, step=3)  # the interrupted attempt's probe of 3
    module, batch = designed_module_and_batch()
    probe = GradientProbe(tracking_uri=uri, run_id=run_id, num_buckets=2, device="cpu", skip_through=3)
    assert [probe.analyse(probe_request(module, batch, iteration=i)).status for i in (3, 4)] == ["ok", "ok"]
    assert probe.flush(60)
    steps = sorted(p.step for p in client.get_metric_history(run_id, mn.PROBE_DURATION_S))
    assert steps == [3, 4]  # 3 once (the first attempt's), 4 from the resumed run
