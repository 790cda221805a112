"""Resumable checkpoints on disk (``gradmon_ray.app.train.checkpoints``), without Ray: written by the real
``CheckpointReporter`` from a real learner, read back by the real reader, restored into another
learner whose gradmon state digest (read off that learner) must be the one recorded.

The crash matrix fails the save at each of its filesystem steps in turn (the algorithm writer,
every open/write/fsync/rename/replace/symlink, the deletion of the old version) and checks that
the checkpoint found afterwards is the previous or the new one, complete and consistent."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from gradmon_ray.app.train import checkpoints
from gradmon_ray.app.train.checkpoints import (
    LATEST,
    RESUME_FILE,
    CheckpointReporter,
    newest_version,
    read_version,
    save_checkpoint,
    versions,
)
from gradmon_ray.app.train.resume import find_checkpoint
from tests.app.conftest import Learners

RUN = "0123456789abcdef0123456789abcdef"


def _reporter(learners: Learners, root: Path, run_id: str | None = RUN) -> CheckpointReporter:
    return CheckpointReporter(learners.cfg, lambda timeout_s: run_id, root=root)


def test_a_checkpoint_is_a_complete_version_in_the_runs_own_directory(learners: Learners, tmp_path: Path):
    """Layout and content: ``<root>/<run id>/ckpt-<iteration>-*`` with ``algo/`` and the resume
    file (run id, iterations, the learner's digest, the config without the URI's password),
    ``latest`` a symlink to it; restoring it gives back the digest read off the learner."""
    root = tmp_path / "ckpt"
    _reporter(learners, root)(1, {}, learners.at("a"), None, None)
    run_dir = root / RUN
    (version,) = [p for p in run_dir.iterdir() if p.name.startswith("ckpt-")]
    assert version.name.startswith("ckpt-00000001-")
    assert (run_dir / LATEST).is_symlink() and (run_dir / LATEST).resolve() == version.resolve()
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([LATEST, version.name])  # no leftovers
    state = json.loads((version / RESUME_FILE).read_text())
    assert state["run_id"] == RUN and state["iterations_done"] == 1
    assert state["state_digest"] == learners.digest_a
    assert learners.restored_digest(version / "algo") == learners.digest_a
    text = (version / RESUME_FILE).read_text()
    assert "SECRET-77" not in text and state["config"]["mlflow"]["tracking_uri"] == "http://bob:***@127.0.0.1:5999"
    sizes = {rel: (version / "algo" / rel).stat().st_size for rel in state["manifest"]}
    assert state["manifest"] and sizes == state["manifest"]


def test_a_newer_save_replaces_the_older_version_and_runs_never_share_one(learners: Learners, tmp_path: Path):
    root = tmp_path / "ckpt"
    other = "f" * 32
    _reporter(learners, root)(1, {}, learners.at("a"), None, None)
    _reporter(learners, root, other)(1, {}, learners.at("b"), None, None)
    _reporter(learners, root)(2, {}, learners.at("b"), None, None)
    (mine,) = versions(root / RUN)  # the iteration-1 version is gone
    assert mine[1]["iterations_done"] == 2 and mine[1]["state_digest"] == learners.digest_b
    (theirs,) = versions(root / other)
    assert theirs[1]["run_id"] == other and theirs[1]["iterations_done"] == 1


def test_a_version_with_a_truncated_file_is_not_complete(learners: Learners, tmp_path: Path):
    """A file shorter than the manifest says (a torn copy, a disk that lied) makes the version
    incomplete: the reader skips it and takes the older complete one."""
    root = tmp_path / "ckpt"
    run_dir = root / RUN
    older = save_checkpoint(run_dir, 1, lambda p: learners.at("a").save_to_path(str(p)), {"run_id": RUN})
    keep = tmp_path / "keep"
    shutil.copytree(older, keep)
    newer = save_checkpoint(run_dir, 2, lambda p: learners.at("b").save_to_path(str(p)), {"run_id": RUN})
    shutil.copytree(keep, older)  # both versions on disk
    victim = max((p for p in (newer / "algo").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:-1])
    assert read_version(newer) is None and read_version(older) is not None
    assert newest_version(run_dir)[0] == older


class Crash(BaseException):
    """A process dying at a filesystem step: nothing catches it, nothing after it runs."""


class _Steps:
    """Counts the save's filesystem steps and raises ``Crash`` at step ``crash_at`` (0: never)."""

    MUTATING = ("open", "write", "fsync", "rename", "replace", "symlink", "mkdir", "makedirs", "unlink", "rmdir")

    def __init__(self, crash_at: int) -> None:
        self.crash_at, self.count, self.crashed_in = crash_at, 0, ""

    def step(self, name: str) -> None:
        self.count += 1
        if self.count == self.crash_at and not self.crashed_in:
            self.crashed_in = name
            raise Crash(name)

    def os_proxy(self) -> Any:
        steps = self

        class CountingOs:
            def __getattr__(self, name: str) -> Any:
                real = getattr(os, name)
                if name not in _Steps.MUTATING:
                    return real

                def counted(*args: Any, **kwargs: Any) -> Any:
                    if not (name == "close" or steps.crashed_in):
                        steps.step(f"os.{name}")
                    return real(*args, **kwargs)

                return counted

        return CountingOs()

    def shutil_proxy(self) -> Any:
        steps = self

        class CountingShutil:
            def __getattr__(self, name: str) -> Any:
                real = getattr(shutil, name)
                if name != "rmtree":
                    return real

                def rmtree(*args: Any, **kwargs: Any) -> Any:
                    if not steps.crashed_in:
                        steps.step("shutil.rmtree")
                    return real(*args, **kwargs)

                return rmtree

        return CountingShutil()

    def writer(self, algo: Any) -> Any:
        """``algo`` whose ``save_to_path`` counts as one step; a crash there leaves half the files."""
        steps = self

        class Writing:
            learner_group = algo.learner_group

            def save_to_path(self, path: str) -> str:
                if steps.crashed_in:
                    return algo.save_to_path(path)
                steps.count += 1
                if steps.count == steps.crash_at:
                    steps.crashed_in = "algo.save_to_path"
                    algo.save_to_path(path)
                    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
                    for victim in files[len(files) // 2 :]:
                        victim.unlink()  # died halfway through writing the algorithm
                    raise Crash("algo.save_to_path")
                return algo.save_to_path(path)

        return Writing()


class _FileAlgo:
    """An algorithm stand-in (no RLlib, no Ray): ``save_to_path`` writes ``payload`` split over files
    in nested directories, as RLlib's does; its one learner's gradmon digest is the payload's SHA-256."""

    PARTS = ("learner_group/learner/module_state.bin", "learner_group/learner/optim.bin", "algo_state.bin", "meta")

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.learner_group = self

    def foreach_learner(self, fn: Any) -> list[Any]:
        from tests.app.conftest import _Result

        return [_Result(fn(self))]

    def gradmon_state_digest(self) -> str:
        return hashlib.sha256(self.payload).hexdigest()

    def save_to_path(self, path: str) -> str:
        size = -(-len(self.payload) // len(self.PARTS))
        for i, rel in enumerate(self.PARTS):
            (Path(path) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(path) / rel).write_bytes(self.payload[i * size : (i + 1) * size])
        return path


def _payload_in(algo_dir: Path) -> bytes:
    """The test's own restore of a ``_FileAlgo`` save: its parts read back in order (raises if one is gone)."""
    return b"".join((algo_dir / rel).read_bytes() for rel in _FileAlgo.PARTS)


def _save_with_steps(monkeypatch: pytest.MonkeyPatch, cfg: Any, algo: Any, root: Path, crash_at: int) -> _Steps:
    steps = _Steps(crash_at)
    with monkeypatch.context() as patch:
        patch.setattr(checkpoints, "os", steps.os_proxy())
        patch.setattr(checkpoints, "shutil", steps.shutil_proxy())
        reporter = CheckpointReporter(cfg, lambda timeout_s: RUN, root=root)
        with contextlib.suppress(Crash):
            reporter(2, {}, steps.writer(algo), None, None)
    return steps


def test_a_crash_at_any_step_of_a_save_leaves_the_previous_or_the_new_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Iteration 1 saved (payload a); the iteration-2 save (payload b) dies at step k, for every k.
    Afterwards the newest complete checkpoint is iteration 1 or 2, its files read back to the payload
    saved with it and its digest is that payload's (a's or b's: never a mix), once the new version is
    published it is the new one, ``latest`` always points at a complete version (the old one, or the
    new one once it is complete: never switched first), and the next save works and cleans up.
    The oracle is the test's own: the payloads it handed the stand-in and their SHA-256 (hashlib)."""
    from tests.app.conftest import tiny_config

    cfg = tiny_config(tmp_path)
    payload = {1: bytes(range(256)) * 7, 2: b"b-state " * 301, 3: b"c" * 999}
    digest = {i: hashlib.sha256(p).hexdigest() for i, p in payload.items()}

    def reporter(root: Path) -> CheckpointReporter:
        return CheckpointReporter(cfg, lambda timeout_s: RUN, root=root)

    template = tmp_path / "template"
    reporter(template)(1, {}, _FileAlgo(payload[1]), None, None)
    shutil.copytree(template, tmp_path / "count", symlinks=True)
    clean = _save_with_steps(monkeypatch, cfg, _FileAlgo(payload[2]), tmp_path / "count", crash_at=0)
    total = clean.count
    # the writer, the resume file (open, write, fsync), an fsync per file and directory, the
    # rename, symlink and replace, the run directory's fsync, the old version renamed and removed
    assert total >= 12, total
    found_new_from = latest_new_from = None
    for k in range(1, total + 1):
        root = tmp_path / f"crash-{k}"
        shutil.copytree(template, root, symlinks=True)
        steps = _save_with_steps(monkeypatch, cfg, _FileAlgo(payload[2]), root, crash_at=k)
        at = (k, steps.crashed_in)
        assert steps.crashed_in, k
        version, state = find_checkpoint(root, RUN)
        done = state["iterations_done"]
        assert done in (1, 2), at
        assert state["state_digest"] == digest[done], at
        assert _payload_in(version / "algo") == payload[done], at
        if found_new_from is None and done == 2:
            found_new_from = k
        if found_new_from is not None:
            assert done == 2, f"crash at step {k} ({steps.crashed_in}) went back to the previous checkpoint"
        latest = root / RUN / LATEST
        assert latest.is_symlink(), at  # the template's latest is replaced, never removed
        target = os.readlink(latest)
        pointed = read_version(latest)
        assert pointed is not None, (
            f"crash at step {k} ({steps.crashed_in}): latest -> {target}, not a complete version"
        )
        assert target.startswith("ckpt-") and pointed["iterations_done"] in (1, 2), at
        assert pointed["state_digest"] == digest[pointed["iterations_done"]], at
        assert _payload_in(latest / "algo") == payload[pointed["iterations_done"]], at
        if pointed["iterations_done"] == 2:
            assert done == 2, at
            latest_new_from = latest_new_from or k
        if latest_new_from is not None:
            assert pointed["iterations_done"] == 2, f"crash at step {k} ({steps.crashed_in}): latest went back"
        reporter(root)(3, {}, _FileAlgo(payload[3]), None, None)  # the run goes on after a resume
        version, state = find_checkpoint(root, RUN)
        assert state["iterations_done"] == 3 and _payload_in(version / "algo") == payload[3], at
        assert state["state_digest"] == digest[3], at
        run_dir = root / RUN
        assert sorted(p.name for p in run_dir.iterdir()) == sorted([LATEST, version.name]), k
        assert (run_dir / LATEST).resolve() == version.resolve(), k
    assert found_new_from is not None and 1 < found_new_from <= total
    # latest moves to the new version only after it is published (the rename), so strictly later
    assert latest_new_from is not None and found_new_from < latest_new_from <= total


def test_a_checkpoint_saved_before_the_run_had_an_id_is_moved_to_the_runs_directory_when_stamped(
    learners: Learners, tmp_path: Path
):
    root = tmp_path / "ckpt"
    ids: list[str | None] = [None]
    reporter = CheckpointReporter(learners.cfg, lambda timeout_s: ids[0], root=root)
    reporter(1, {}, learners.at("a"), None, None)
    (unnamed,) = root.iterdir()
    assert unnamed.name.startswith("unnamed-") and newest_version(unnamed)[1]["run_id"] is None
    reporter.stamp_run_id(RUN)
    assert [p.name for p in root.iterdir()] == [RUN]
    version, state = find_checkpoint(root, RUN)
    assert state["run_id"] == RUN and learners.restored_digest(version / "algo") == learners.digest_a


def test_the_first_checkpoint_with_the_run_id_replaces_the_unnamed_one(learners: Learners, tmp_path: Path):
    root = tmp_path / "ckpt"
    ids: list[str | None] = [None]
    reporter = CheckpointReporter(learners.cfg, lambda timeout_s: ids[0], root=root)
    reporter(1, {}, learners.at("a"), None, None)
    ids[0] = RUN
    reporter(2, {}, learners.at("b"), None, None)
    reporter.stamp_run_id(RUN)  # nothing left to stamp
    assert [p.name for p in root.iterdir()] == [RUN]
    assert find_checkpoint(root, RUN)[1]["iterations_done"] == 2


def _version_by_hand(run_dir: Path, name: str, iterations: int, saved_ns: int, *, algo: bool = True) -> Path:
    """A version directory written by hand: ``algo/`` with one file, and its resume file (manifest)."""
    version = run_dir / name
    if algo:
        (version / "algo").mkdir(parents=True)
        (version / "algo" / "w.bin").write_bytes(b"\0" * 8)
    else:
        version.mkdir(parents=True)
    state = {"iterations_done": iterations, "saved_ns": saved_ns, "run_id": "r"}
    if algo:
        state["manifest"] = {"w.bin": 8}
    (version / RESUME_FILE).write_text(json.dumps(state))
    return version


def test_the_newest_version_is_the_most_iterations_whatever_its_name_or_save_time(tmp_path):
    """Ordered by iterations done, then save time: a name that sorts last (a copy renamed by hand) or a
    later save of fewer iterations (a clock set back) never wins over more iterations."""
    run_dir = tmp_path / "run"
    _version_by_hand(run_dir, "ckpt-00000009-x", iterations=3, saved_ns=50)
    most = _version_by_hand(run_dir, "ckpt-00000007-y", iterations=7, saved_ns=10)
    same = _version_by_hand(run_dir, "ckpt-00000007-a", iterations=7, saved_ns=20)
    assert [(v.name, s["iterations_done"]) for v, s in checkpoints.versions(run_dir)] == [
        ("ckpt-00000009-x", 3),
        (most.name, 7),
        (same.name, 7),  # the same iterations: the later save last
    ]
    assert checkpoints.newest_version(run_dir)[0] == same


def test_a_legacy_latest_directory_without_its_algorithm_is_not_a_version(tmp_path):
    run_dir = tmp_path / "run"
    _version_by_hand(run_dir, LATEST, iterations=4, saved_ns=1, algo=False)
    assert checkpoints.versions(run_dir) == []
    (run_dir / LATEST / "algo").mkdir()  # the layout before per-run directories, complete
    assert [s["iterations_done"] for _, s in checkpoints.versions(run_dir)] == [4]


def test_the_resume_state_keeps_the_health_streaks_and_each_version_its_save_time(tmp_path, learners):
    """What ``--resume`` reads back: the health monitor's own state (its streaks) under ``health``,
    and in every saved version the save time that orders versions of one iteration."""
    import time

    class Monitor:  # a health monitor's state, as HealthStopMonitor.state_dict() returns it
        def state_dict(self) -> dict:
            return {"streaks": {"op": 3}, "last_iteration": 7}

    state = checkpoints.resume_state(learners.at("a"), 7, "r", Monitor())
    assert state["health"] == {"streaks": {"op": 3}, "last_iteration": 7} and state["iterations_done"] == 7
    before = time.time_ns()
    version = save_checkpoint(tmp_path / "run", 7, lambda p: learners.at("a").save_to_path(str(p)), state)
    saved = read_version(version)
    assert saved["health"] == state["health"] and before <= saved["saved_ns"] <= time.time_ns()
