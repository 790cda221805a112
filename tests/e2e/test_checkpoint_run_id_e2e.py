"""``train --resume RUN_ID`` needs the run id in the checkpoint, and the MLflow sink creates the
run on its own thread: a checkpoint may be due before the run exists (a slow store, a loaded
box; CI once saw ``belongs to run None``).  And a checkpoint names only the run that wrote it:
runs sharing a ``checkpoint_dir`` never resume from each other's.  Real RLlib training, a real
sqlite store; only the moment the sink creates its run is held back.

Each run keeps its checkpoints in its own directory of the checkpoint root, so runs sharing a
``checkpoint_dir`` cannot overwrite each other's any more (they once did: ``latest`` was shared).

One root serves three tests (``shared_root``: a run whose creation waits for its first checkpoint,
then a second run beside it, then a third stopped before its first checkpoint): each training run
is an algorithm built and trained, about 2 CPU-s, and a new sqlite store about 1 more."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray.app.train import checkpoints
from gradmon_ray.app.train.resume import resume_point
from gradmon_ray.app.train.run import TrainingOutcome, run_training
from gradmon_ray.config import ConfigError
from gradmon_ray.tracking import MlflowSink
from tests.e2e.resumable_runs import newest_state, resumable_config

pytestmark = pytest.mark.e2e

ITERATIONS = 2


def _config(tmp_path: Any, **top: Any) -> Any:
    return resumable_config(tmp_path, **{"iterations": ITERATIONS, "checkpoint_every": 1, **top})


def _hold_run_creation(monkeypatch: pytest.MonkeyPatch, release: threading.Event) -> None:
    """The sink creates its run only once ``release`` is set (at most 120 s later)."""
    create_run = MlflowSink._create_run

    def held(self: MlflowSink) -> Any:
        release.wait(120)
        return create_run(self)

    monkeypatch.setattr(MlflowSink, "_create_run", held)


def _checkpoint_run_id(cfg: Any) -> str | None:
    """The run id in the newest checkpoint under ``cfg``'s root, whichever run directory holds it."""
    return newest_state(checkpoints.checkpoint_root(cfg))["run_id"]


def _resume_point(cfg: Any, run_id: str) -> Any:
    """The point ``--resume RUN_ID --iterations ITERATIONS+1`` continues from (a complete run is
    refused without a larger ``--iterations``; these tests read which checkpoint it finds)."""
    root = checkpoints.checkpoint_root(cfg)
    return resume_point(cfg.mlflow.tracking_uri, run_id, root, iterations=ITERATIONS + 1)[1]


@dataclass(frozen=True)
class SharedRoot:
    tmp: Path
    held: TrainingOutcome
    """The first run: MLflow created it only once its first checkpoint asked for its id."""
    held_ids: list[str | None]
    """The run id in the newest checkpoint after each of ``held``'s iterations."""
    beside: TrainingOutcome
    """The second run, with the same ``checkpoint_dir`` (the default one, run twice in one directory)."""


@pytest.fixture(scope="module")
def shared_root(ray_session, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedRoot]:
    tmp = tmp_path_factory.mktemp("shared_root")
    cfg = _config(tmp)
    release = threading.Event()
    with pytest.MonkeyPatch.context() as monkeypatch:
        _hold_run_creation(monkeypatch, release)
        ask = MlflowSink.run_id_waiting_once

        def asked(self: MlflowSink, timeout_s: float) -> str | None:
            release.set()
            return ask(self, timeout_s)

        monkeypatch.setattr(MlflowSink, "run_id_waiting_once", asked)
        ids: list[str | None] = []
        held = run_training(cfg, progress=lambda line: ids.append(_checkpoint_run_id(cfg)))
    yield SharedRoot(tmp, held, ids, run_training(cfg, progress=None))


def test_the_first_checkpoint_waits_for_the_run_it_belongs_to(shared_root: SharedRoot):
    """The run is created only once the first checkpoint asks for its id: the checkpoint waits
    for it and names it (reading the sink's id without waiting wrote None), and resumes."""
    held = shared_root.held
    assert held.iterations_done == ITERATIONS and held.run_id is not None
    assert shared_root.held_ids == [held.run_id] * ITERATIONS  # every checkpoint, from the first, names the run
    point = _resume_point(_config(shared_root.tmp), held.run_id)
    assert point.iterations_done == ITERATIONS and point.logged_through == ITERATIONS


def test_a_checkpoint_saved_before_the_run_exists_gets_its_id_when_the_run_ends(
    ray_session, tmp_path, monkeypatch, caplog
):
    """MLflow creates the run only after the last iteration (longer than the checkpoint's wait):
    the checkpoints are written without the id (in an ``unnamed-*`` directory), with one warning,
    and the run's end writes the id into the latest one and moves it to the run's directory,
    which ``--resume`` then accepts."""
    cfg = _config(tmp_path)
    release = threading.Event()
    _hold_run_creation(monkeypatch, release)
    monkeypatch.setattr(checkpoints, "RUN_ID_WAIT_S", 0.2)
    ids: list[str | None] = []

    def progress(line: str) -> None:
        ids.append(_checkpoint_run_id(cfg))
        if line.startswith(f"iter {ITERATIONS}/"):
            release.set()

    with caplog.at_level(logging.WARNING, logger=checkpoints.__name__):
        outcome = run_training(cfg, progress=progress)
    assert ids == [None] * ITERATIONS
    warnings = [r.getMessage() for r in caplog.records if r.name == checkpoints.__name__]
    assert len(warnings) == 1 and "written before MLflow created the run" in warnings[0]
    assert outcome.run_id is not None and outcome.mlflow_complete
    assert _checkpoint_run_id(cfg) == outcome.run_id
    root = checkpoints.checkpoint_root(cfg)
    assert (root / outcome.run_id).is_dir() and not list(root.glob("unnamed-*"))  # moved, nothing left behind
    assert _resume_point(cfg, outcome.run_id).iterations_done == ITERATIONS


def test_runs_sharing_a_checkpoint_dir_each_resume_from_their_own(shared_root: SharedRoot):
    """Two runs with one ``checkpoint_dir``: each keeps its checkpoint in its own directory, so the
    later run no longer replaces the earlier's, and each resumes from the checkpoint that names it."""
    cfg = _config(shared_root.tmp)
    earlier, later = shared_root.held, shared_root.beside
    assert earlier.run_id != later.run_id
    root = checkpoints.checkpoint_root(cfg)
    for outcome in (earlier, later):
        assert newest_state(root, outcome.run_id)["run_id"] == outcome.run_id
        point = _resume_point(cfg, outcome.run_id)
        assert point.iterations_done == ITERATIONS and f"/{outcome.run_id}/ckpt-" in point.checkpoint_path


def test_a_run_stopped_before_its_first_checkpoint_leaves_the_previous_runs_checkpoint_alone(
    shared_root: SharedRoot,
):
    """A run with ``checkpoint_every: 5`` is stopped (Ctrl-C) after iteration 1, before it saved
    anything, in a ``checkpoint_dir`` holding other runs' checkpoints: the end of the run must
    not write its id into the newest of them (``--resume`` would then continue it from the other
    run's weights); the other runs still resume from theirs, this one is refused."""
    earlier = {shared_root.held.run_id, shared_root.beside.run_id}
    root = checkpoints.checkpoint_root(_config(shared_root.tmp))
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    def ctrl_c(line: str) -> None:
        raise KeyboardInterrupt

    later_cfg = _config(shared_root.tmp, iterations=10, checkpoint_every=5)
    with pytest.raises(KeyboardInterrupt):
        run_training(later_cfg, progress=ctrl_c)
    assert {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert newest_state(root)["run_id"] == shared_root.beside.run_id  # the newest checkpoint, still its own
    client = MlflowClient(later_cfg.mlflow.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    (later,) = [run for run in runs if run.info.run_id not in earlier]
    assert later.info.status == "KILLED"
    with pytest.raises(ConfigError, match=f"no complete checkpoint of run {later.info.run_id}"):
        _resume_point(later_cfg, later.info.run_id)
    for run_id in sorted(earlier):
        assert _resume_point(later_cfg, run_id).iterations_done == ITERATIONS
