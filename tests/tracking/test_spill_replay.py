"""``spill_replay``: a replay cut short and run again ends with one run and every point once (issue
#37 item 5), in the fast lane: a real sqlite MLflow store, the cut made by MLflow's own client
failing right after the store carried out the call (as a kill would leave it: the store has it,
the replay never learned).  tests/e2e/test_replay_kill_e2e.py SIGKILLs a real replay against a
real ``mlflow server``.  Expected values come from the formula the spill file was written with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray.app.cli import main
from gradmon_ray.tracking.spill import REPLAYED_SUFFIX, SpillWriter, spill_records
from gradmon_ray.tracking.spill_replay import REPLAY_KEY_TAG, replay_spill

T0 = 1_700_000_000_000


def value(step: int, k: int) -> float:
    """The oracle: what the spill file holds for metric ``m<k>`` at ``step``."""
    return step * 0.25 + k / 8


def write_spill(
    path: Path, steps: int, keys: int, *, experiment: str = "replayed", uri: str = "http://127.0.0.1:9"
) -> None:
    """A spill file of a run MLflow never created: ``steps`` iterations of ``keys`` metrics
    (``value(step, k)``), the params and start tags, and a trailer ending the run KILLED."""
    writer = SpillWriter(
        path,
        {"tracking_uri": uri, "experiment": experiment, "run_name": "cut-short", "run_id": None,
         "params": {"seed": "7", "ppo.lr": "0.001"}, "tags": {"gradmon.env": "FactoredOps-v0"}},
    )  # fmt: skip
    items = [
        (step, T0 + step, {f"m{k}": value(step, k) for k in range(keys)}, {"gradmon.last": str(step)})
        for step in range(1, steps + 1)
    ]
    writer.write_iterations(items, None, range(1, steps + 1))
    writer.write_trailer(None, "KILLED")


def assert_replayed_once(uri: str, experiment: str, steps: int, keys: int) -> Any:
    """Exactly one run in ``experiment``, every (key, step) once with the value the file holds; the run."""
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    for k in range(keys):
        history = sorted((p.step, p.value) for p in client.get_metric_history(run.info.run_id, f"m{k}"))
        assert history == [(step, value(step, k)) for step in range(1, steps + 1)], f"m{k}"
    assert run.data.params == {"seed": "7", "ppo.lr": "0.001"}
    assert run.data.tags["gradmon.last"] == str(steps) and run.data.tags["gradmon.env"] == "FactoredOps-v0"
    assert run.info.status == "KILLED"
    return run


class CutShort(Exception):
    """Stands for the SIGKILL: raised once the store has done the call."""


def cut_after(monkeypatch: pytest.MonkeyPatch, method: str, nth: int) -> list[Any]:
    """``MlflowClient.<method>``'s ``nth`` call is carried out, then raises ``CutShort``; the calls' results."""
    original = getattr(MlflowClient, method)
    results: list[Any] = []

    def then_cut(self: MlflowClient, *args: Any, **kwargs: Any) -> Any:
        results.append(original(self, *args, **kwargs))
        if len(results) == nth:
            monkeypatch.setattr(MlflowClient, method, original)
            raise CutShort(method)
        return results[-1]

    monkeypatch.setattr(MlflowClient, method, then_cut)
    return results


STORES = {
    "sqlite": lambda tmp: f"sqlite:///{tmp / 'm.db'}",
    # MLflow's file store appends every point it is given: a point logged again is there twice
    # (MLflow 3.17 takes a file store only with MLFLOW_ALLOW_FILE_STORE=true: the test sets it)
    "file": lambda tmp: (tmp / "mlruns").as_uri(),
}


def count_retry(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts what the client is asked from here on: metric histories read, metric points handed to ``log_batch``."""
    counts = {"reads": 0, "sent": 0}
    read, log_batch = MlflowClient.get_metric_history, MlflowClient.log_batch

    def counted_read(self: MlflowClient, *args: Any, **kwargs: Any) -> Any:
        counts["reads"] += 1
        return read(self, *args, **kwargs)

    def counted_log_batch(self: MlflowClient, run_id: str, metrics: Any = (), *args: Any, **kwargs: Any) -> Any:
        counts["sent"] += len(metrics)
        return log_batch(self, run_id, metrics, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "get_metric_history", counted_read)
    monkeypatch.setattr(MlflowClient, "log_batch", counted_log_batch)
    return counts


@pytest.mark.parametrize("store", list(STORES))
@pytest.mark.parametrize(
    ("method", "nth", "file_reads", "sent"),
    [  # the retry: histories read (file store; a SQL store is never read), points sent per store
        ("create_experiment", 1, 0, {"file": 2500, "sqlite": 2500}),
        # before the run's id is in the file: found again by its replay_key tag; it has no metric yet
        ("create_run", 1, 0, {"file": 2500, "sqlite": 2500}),
        ("log_batch", 1, 0, {"file": 2500, "sqlite": 2500}),  # the params, right after the run was recorded
        # mid-metrics: the first of 3 metric batches recorded in the file, the second done unacknowledged:
        # every key has a point in it (read back on the file store), the third never sent
        ("log_batch", 3, 100, {"file": 500, "sqlite": 1500}),
        ("log_batch", 5, 0, {"file": 0, "sqlite": 0}),  # the tags, after every metric batch was recorded
        ("set_terminated", 1, 0, {"file": 0, "sqlite": 0}),  # everything in, the file not renamed yet
    ],
)
def test_a_replay_cut_short_and_retried_ends_with_one_run_and_each_point_once(
    tmp_path, monkeypatch, method, nth, file_reads, sent, store
):
    spill, uri = tmp_path / "s.jsonl", STORES[store](tmp_path)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    write_spill(spill, steps=25, keys=100)  # 2500 points: 3 metric batches of at most 1000
    cut_after(monkeypatch, method, nth)
    with pytest.raises(CutShort):
        replay_spill(spill, uri)
    assert spill.exists()  # not renamed: the replay did not finish
    counts = count_retry(monkeypatch)
    result = replay_spill(spill, uri)
    assert counts == {"reads": file_reads if store == "file" else 0, "sent": sent[store]}
    run = assert_replayed_once(uri, "replayed", 25, 100)
    assert (result.run_id, result.created_run, result.iterations, result.metrics) == (run.info.run_id, True, 25, 2500)
    records = spill_records(spill.with_name(spill.name + REPLAYED_SUFFIX))
    (key,) = {r["replay_key"] for r in records if "replay_key" in r}
    assert run.data.tags[REPLAY_KEY_TAG] == key
    assert {r["replayed_into"] for r in records if "replayed_into" in r} == {run.info.run_id}


@pytest.mark.parametrize("store", list(STORES))
def test_a_store_restored_from_before_the_replay_gets_every_point_again(tmp_path, monkeypatch, store):
    """The file records every point as in the run, and then the store is put back from a copy taken
    before that replay (the run there, without them): a replay again logs them, each once."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri, spill = STORES[store](tmp_path), tmp_path / "s.jsonl"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("replayed")).info.run_id
    client.log_metric(run_id, "m0", value(1, 0), timestamp=T0 + 1, step=1)  # delivered before the outage
    writer = SpillWriter(spill, {"tracking_uri": uri, "experiment": "replayed", "run_id": run_id})
    writer.write_iterations([(s, T0 + s, {"m0": value(s, 0)}, {}) for s in (2, 3)], run_id, [2, 3])
    held = tmp_path / ("m.db" if store == "sqlite" else "mlruns")
    backup = tmp_path / "backup"
    (shutil.copy if store == "sqlite" else shutil.copytree)(held, backup)
    replay_spill(spill, uri, mark_done=False)
    assert [r["replay_logged"] for r in spill_records(spill) if "replay_logged" in r] == [2]
    (shutil.copy if store == "sqlite" else shutil.copytree)(
        backup, held, **({} if store == "sqlite" else {"dirs_exist_ok": True})
    )
    assert sorted(p.step for p in client.get_metric_history(run_id, "m0")) == [1]  # restored: 2 and 3 gone
    replay_spill(spill, uri)
    history = sorted((p.step, p.value) for p in client.get_metric_history(run_id, "m0"))
    assert history == [(s, value(s, 0)) for s in (1, 2, 3)]


def test_the_created_run_is_on_disk_before_any_metric_is_logged(tmp_path, monkeypatch):
    spill, uri = tmp_path / "s.jsonl", f"sqlite:///{tmp_path / 'm.db'}"
    write_spill(spill, steps=2, keys=3)
    original = MlflowClient.log_batch
    seen: list[list[str]] = []

    def log_batch(self: MlflowClient, run_id: str, **kwargs: Any) -> Any:
        seen.append([r.get("replayed_into") for r in spill_records(spill) if "replayed_into" in r])
        return original(self, run_id, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)
    result = replay_spill(spill, uri, mark_done=False)
    assert seen and all(ids == [result.run_id] for ids in seen)


def test_a_retry_into_another_store_creates_the_run_there_once(tmp_path, monkeypatch):
    """Cut short in store A after its run was created, then replayed into store B (twice): B gets one
    run of its own; A keeps the one the first attempt created."""
    spill = tmp_path / "s.jsonl"
    first, other = f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
    write_spill(spill, steps=3, keys=2)
    cut_after(monkeypatch, "log_batch", 1)
    with pytest.raises(CutShort):
        replay_spill(spill, first)
    replay_spill(spill, other, mark_done=False)
    replay_spill(spill, other, mark_done=False)
    assert_replayed_once(other, "replayed", 3, 2)
    client = MlflowClient(first)
    assert len(client.search_runs([client.get_experiment_by_name("replayed").experiment_id])) == 1


def test_replaying_a_file_already_replayed_says_so_and_changes_nothing(tmp_path, capsys):
    spill, uri = tmp_path / "s.jsonl", f"sqlite:///{tmp_path / 'm.db'}"
    write_spill(spill, steps=2, keys=2)
    assert main(["replay", str(spill), "--tracking-uri", uri]) == 0
    capsys.readouterr()
    assert main(["replay", str(spill), "--tracking-uri", uri]) == 0
    done = spill.with_name(spill.name + REPLAYED_SUFFIX)
    assert capsys.readouterr().out == f"gradmon-ray: {spill} was replayed already (it is now {done}); nothing to do\n"
    assert_replayed_once(uri, "replayed", 2, 2)


def test_the_replay_lines_are_strict_json(tmp_path):
    spill = tmp_path / "s.jsonl"
    write_spill(spill, steps=1, keys=1)
    replay_spill(spill, f"sqlite:///{tmp_path / 'm.db'}", mark_done=False)
    tail = [json.loads(line) for line in spill.read_text().splitlines()[-3:]]
    assert [sorted(r) for r in tail] == [["replay_key"], ["replayed_into"], ["into", "points", "replay_logged"]]


def test_points_the_run_holds_already_are_not_logged_again_into_a_file_store(tmp_path, monkeypatch):
    """The run the file names exists and holds steps 1-2 already (the sink delivered them, and was
    killed before it marked them in the file, NaN included): a replay into the file store adds only
    step 3; a point at the same step with another timestamp is another point, and is kept."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri, spill = (tmp_path / "mlruns").as_uri(), tmp_path / "s.jsonl"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("replayed")).info.run_id
    for step in (1, 2):
        client.log_metric(run_id, "m0", value(step, 0), timestamp=T0 + step, step=step)
        client.log_metric(run_id, "nan", float("nan"), timestamp=T0 + step, step=step)
    client.log_metric(run_id, "m0", 9.0, timestamp=T0, step=3)  # step 3 at another time: not the file's point
    writer = SpillWriter(spill, {"tracking_uri": uri, "experiment": "replayed", "run_id": run_id})
    items = [(s, T0 + s, {"m0": value(s, 0), "nan": float("nan")}, {}) for s in (1, 2, 3)]
    writer.write_iterations(items, run_id, [1, 2, 3])
    result = replay_spill(spill, uri)
    assert (result.run_id, result.created_run, result.metrics) == (run_id, False, 6)
    assert sorted((p.step, p.value) for p in client.get_metric_history(run_id, "m0")) == [
        (1, value(1, 0)), (2, value(2, 0)), (3, value(3, 0)), (3, 9.0)
    ]  # fmt: skip
    assert sorted(p.step for p in client.get_metric_history(run_id, "nan")) == [1, 2, 3]
