"""``tracking/diagnosis_tags.py``: the learners' diagnoses into tags, artifacts and the console line.

Real sqlite MLflow stores; a dead HTTP server for the spill.  Bugs this catches: an event's
artifact lost when two iterations go to MLflow in one write or come back from a spill file (the
merged tags keep only the last event's), a learner whose re-run did not reproduce chosen over one
whose did, a tag MLflow refuses for its length, the skipped count of one module of several.
"""

from __future__ import annotations

import json
import math

from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.blame import RESULT_KEY, Diagnosis
from gradmon_ray.tracking import MlflowSink
from gradmon_ray.tracking.diagnosis_tags import (
    MAX_TAG_CHARS,
    diagnoses_from_tag,
    diagnoses_in,
    diagnosis_tags,
    load_diagnoses,
    skipped_summary,
)
from gradmon_ray.tracking.result_metrics import progress_line
from gradmon_ray.tracking.spill_replay import replay_spill


def _diagnosis(iteration: int, module: str = "p1", *, reproduced=True, count=3, rank=0) -> Diagnosis:
    rows = {"count": count, "fields": ["rewards"], "first": {"episode_id": "e", "agent_id": None, "t": 4, "row": 9}}
    return Diagnosis(iteration, module, 0, 4, 4, ["op"], ["policy"], "pi.op.weight", rows, reproduced, rank=rank)


def test_the_learner_whose_own_rows_reproduced_it_is_chosen_per_module():
    result = {
        "learners": {
            "p1": {RESULT_KEY: [_diagnosis(1, reproduced=False, count=0).to_json(), _diagnosis(1, rank=1).to_json()]},
            "p2": {RESULT_KEY: [], "grad/global_norm": 1.0},
            "__all_modules__": {},
        }
    }
    (chosen,) = diagnoses_in(result)
    assert chosen.rank == 1 and chosen.reproduced is True


def test_many_modules_fit_one_tag_the_rerun_details_go_first():
    diagnoses = [_diagnosis(1, f"module_{i}") for i in range(40)]
    for d in diagnoses:
        d.rerun = {"head_grad_counts": {f"head_{h}": {"nan": 1, "inf": 0} for h in range(20)}}
    tag = diagnosis_tags(diagnoses, {}, 1)[mn.TAG_DIAGNOSIS]
    assert len(tag) <= MAX_TAG_CHARS
    kept = diagnoses_from_tag(tag)
    assert kept and all(d.rerun == {} for d in kept) and kept[0].module == "module_0"
    assert [d.module for d in kept] == [f"module_{i}" for i in range(len(kept))]


def test_skipped_counts_every_modules_minibatches():
    metrics = {"module/a/update/skipped": 2.0, "module/a/update/minibatches": 4.0}
    metrics |= {"module/b/update/skipped": 4.0, "module/b/update/minibatches": 4.0}
    assert skipped_summary(metrics) == "skipped 6/8"
    assert skipped_summary({mn.SKIPPED_UPDATES: 4.0, mn.MINIBATCH_UPDATES: 4.0}) == "skipped 4/4: did not train"
    assert skipped_summary({mn.SKIPPED_UPDATES: 0.0, mn.MINIBATCH_UPDATES: 4.0}) is None
    tags = diagnosis_tags([], {mn.SKIPPED_UPDATES: 4.0, mn.MINIBATCH_UPDATES: 4.0}, 7)
    assert tags == {mn.TAG_SKIPPED: "iteration 7: skipped 4/4: did not train"}


def test_the_progress_line_says_an_iteration_did_not_train_instead_of_a_nan_worst_head():
    base = {mn.LEARNERS_UPDATED: 1.0, mn.head_metric(mn.HEAD_GRAD_NORM, "op"): math.nan}
    line = progress_line(1, 2, {**base, mn.SKIPPED_UPDATES: 4.0, mn.MINIBATCH_UPDATES: 4.0})
    assert "skipped 4/4: did not train" in line and "worst head" not in line
    healthy = {**base, mn.head_metric(mn.HEAD_GRAD_NORM, "op"): 1.0, mn.SKIPPED_UPDATES: 1.0, mn.MINIBATCH_UPDATES: 4.0}
    assert "worst head op 1.000 (healthy) | skipped 1/4 |" in progress_line(1, 2, healthy)


def test_each_events_artifact_is_written_live_and_from_a_spill_file(tmp_path, dead_uri):
    events = {1: [_diagnosis(1)], 2: [_diagnosis(2, "p1"), _diagnosis(2, "p2")]}
    store = f"sqlite:///{tmp_path / 'live.db'}"
    live = MlflowSink(store, "diag", run_name="live")
    for step, diagnoses in events.items():  # both iterations queued before the writer's first batch
        live.log_iteration(step, {"x": float(step)}, diagnosis_tags(diagnoses, {}, step))
    assert live.close(timeout_s=30)
    spill = tmp_path / "spill.jsonl"
    dead = MlflowSink(dead_uri, "diag", run_name="spilled", retry_backoff_s=0.05, spill_path=spill)
    for step, diagnoses in events.items():
        dead.log_iteration(step, {"x": float(step)}, diagnosis_tags(diagnoses, {}, step))
    assert dead.close(timeout_s=0.5) is False
    replayed = replay_spill(spill, f"sqlite:///{tmp_path / 'replay.db'}")
    expected = [json.loads(d.to_json()) for step in events for d in events[step]]
    for uri, run_id in ((store, live.run_id), (f"sqlite:///{tmp_path / 'replay.db'}", replayed.run_id)):
        client = MlflowClient(uri)
        paths = sorted(a.path for a in client.list_artifacts(run_id, "diagnosis"))
        assert paths == ["diagnosis/iter_1_p1.json", "diagnosis/iter_2_p1.json", "diagnosis/iter_2_p2.json"]
        assert [json.loads(d.to_json()) for d in load_diagnoses(client, run_id)] == expected


def test_the_shared_cosines_tag_is_the_learners_json_and_absent_without_it():
    from gradmon_ray.tracking.diagnosis_tags import SHARED_COSINES_KEY, shared_cosine_tags

    pairs = json.dumps({"p0_vs_p1": -0.25})
    result = {"learners": {"__all_modules__": {SHARED_COSINES_KEY: [pairs, pairs]}}}
    assert shared_cosine_tags(result) == {mn.TAG_SHARED_COSINES: pairs}
    assert shared_cosine_tags({"learners": {"__all_modules__": {}}}) == {}
