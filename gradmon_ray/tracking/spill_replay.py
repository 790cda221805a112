"""``gradmon-ray replay``: a spill file's undelivered iterations into MLflow, once, however often
the replay is killed and run again.

**Into which run.** The run the file names when the store has it; else the run an earlier replay
of this file created in that store; else a new run from the header.  A new run is recorded in the
file before it is created and again after, both fsynced, before any metric is logged: first a
``{"replay_key": ...}`` line, whose value also tags the run (``REPLAY_KEY_TAG``), then
``{"replayed_into": run_id}``.  A replay killed between creating the run and recording its id
finds the run again by the tag; killed later, by the id.  Either way one run, never a second.

**Each point once.** The file's metric points, in the file's order, are the list a replay works
through.  After each metric batch MLflow acknowledged, the replay records in the file how far into
that list the run holds every point (``{"replay_logged": n, "into": run_id, "points": digest}``,
fsynced; ``digest`` is the whole list's, so a list that changed since is not trusted, nor is a count
the run's latest points contradict).  A retry into that run starts there.  The rest (a batch the
store may have done unacknowledged, points the sink delivered before its delivery mark) is checked
against the run: MLflow's SQL stores keep one row per (key, step, timestamp, value) and ignore the
same point logged again, so they are not read (``tests/tracking/test_spill_replay.py`` checks it
against a real ``mlflow server``).  Any other store (a file store, ``file:./mlruns``, appends every
point it is given; a tracking server's own store is unknown from here) tells its latest point of
each key in one ``get_run``: a point past it in step and in time is not there (MLflow's stores call
latest the highest step, then time; its docs, the latest time), and only the keys with a point not
past it have their history read.  Params logged again with their value are accepted, tags and the
end status are set, not added.  The file is renamed to ``<file>.replayed`` last.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray.tracking.redact import MASK
from gradmon_ray.tracking.spill import (
    REPLAYED_SUFFIX,
    SpillFormatError,
    append_records,
    decode_value,
    read_spill,
    replayed_iterations,
    spill_records,
)
from gradmon_ray.tracking.store_check import DATABASE_SCHEMES, tracking_scheme

REPLAY_KEY_TAG = "gradmon.replay_key"
"""Tag of a run a replay created: the ``replay_key`` recorded in the spill file beforehand."""
LOGGED = "replay_logged"
"""Key of the line a replay appends after each metric batch MLflow acknowledged (module docstring)."""


@dataclass
class ReplayResult:
    """What ``replay_spill`` did."""

    run_id: str
    iterations: int
    """Training iterations replayed (distinct steps with metrics, see ``replayed_iterations``)."""
    metrics: int
    created_run: bool
    """The run was created by a replay of this file (this one, or an earlier one that was cut short)."""
    status: str | None


def _replay_uri(path: Path, header: dict[str, Any], tracking_uri: str | None) -> str:
    if tracking_uri:
        return tracking_uri
    uri = str(header.get("tracking_uri") or "")
    if MASK in uri:  # the header never keeps a password: it cannot log in with what it holds
        raise SpillFormatError(
            f"{path}: its tracking URI {uri} had credentials, which spill files never keep; give --tracking-uri"
        )
    if not uri:
        raise SpillFormatError(f"{path}: the header names no tracking URI; give --tracking-uri")
    return uri


def _existing_run(client: Any, run_id: str | None) -> str | None:
    """``run_id`` if the store has that run (not deleted), else None (another store than the run's own)."""
    if run_id is None:
        return None
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise
    return run_id if run.info.lifecycle_stage == "active" else None


def _append(path: Path, record: dict[str, Any]) -> None:
    """Append one bookkeeping line, fsynced; a torn last line (the trainer killed mid-write) is cut
    off first, or it would sit in the middle of the file, where it is damage, not a torn tail."""
    try:
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            os.truncate(path, data.rfind(b"\n") + 1)
        append_records(path, [record])
    except OSError as exc:
        raise SpillFormatError(f"{path}: the replay must record its run in the file, and cannot ({exc})") from None


def _run_by_key(client: Any, experiment_id: str, key: str) -> str | None:
    filter_string = f"tags.`{REPLAY_KEY_TAG}` = '{key}'"
    runs = client.search_runs([experiment_id], filter_string=filter_string, max_results=1)
    return runs[0].info.run_id if runs else None


def _replay_run(client: Any, path: Path, header: dict[str, Any], records: list[dict[str, Any]]) -> tuple[str, bool]:
    """The run a replay of ``path`` created in this store before (its ``replayed_into`` lines, then
    its ``replay_key`` tag), else a new one (``True``: created now, so empty); its id is on disk
    before this returns."""
    for recorded in reversed([r["replayed_into"] for r in records if r.get("replayed_into")]):
        if _existing_run(client, recorded):
            return recorded, False
    keys = [str(r["replay_key"]) for r in records if r.get("replay_key")]
    exp = client.get_experiment_by_name(header["experiment"])
    run_id = _run_by_key(client, exp.experiment_id, keys[-1]) if keys and exp is not None else None
    new = run_id is None
    if run_id is None:
        key = keys[-1] if keys else uuid.uuid4().hex
        if not keys:
            _append(path, {"replay_key": key})
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(header["experiment"])
        tags = {**(header.get("tags") or {}), REPLAY_KEY_TAG: key}
        run_id = client.create_run(exp_id, run_name=header.get("run_name"), tags=tags).info.run_id
    _append(path, {"replayed_into": run_id})
    return run_id, new


def _point(key: str, step: int, timestamp: int, value: float) -> tuple[str, int, int, float | str]:
    return key, step, timestamp, "nan" if math.isnan(value) else value  # NaN != NaN: compared as a word


def _digest(metrics: list[Any]) -> str:
    """The file's metric list, point by point and in order: what a ``replay_logged`` count is into."""
    points = [_point(m.key, m.step, m.timestamp, m.value) for m in metrics]
    return hashlib.sha256(json.dumps(points).encode()).hexdigest()


def _latest(client: Any, run_id: str) -> dict[str, tuple[int, int]]:
    """Key -> (step, timestamp) of the run's latest point of each key (MLflow's latest metrics)."""
    return {m.key: (m.step, m.timestamp) for m in client.get_run(run_id).data.to_proto().metrics}


def _past(metric: Any, latest: dict[str, tuple[int, int]]) -> bool:
    """Past the run's latest point of its key in step and in time: not in the run, whichever of the
    two its store calls latest by."""
    step, timestamp = latest.get(metric.key, (-math.inf, -math.inf))
    return metric.step > step and metric.timestamp > timestamp


def _to_log(
    client: Any, uri: str, run_id: str, metrics: list[Any], digest: str, records: list[dict[str, Any]]
) -> tuple[int, list[tuple[int, Any]]]:
    """How many of ``metrics`` (from the front) an earlier replay recorded as in run ``run_id``, and
    (index, point) of each later point the run may not hold (module docstring)."""
    latest = _latest(client, run_id)
    counts = [int(r[LOGGED]) for r in records if LOGGED in r and (r.get("into"), r.get("points")) == (run_id, digest)]
    done = max(counts, default=0)
    if any(_past(m, latest) for m in metrics[:done]):  # the run lacks what was recorded (a store restored since)
        done = 0
    rest = list(enumerate(metrics))[done:]
    if tracking_scheme(uri) in DATABASE_SCHEMES:  # it ignores a point it holds
        return done, rest
    unsure = sorted({m.key for _, m in rest if not _past(m, latest)})
    held = {_point(key, p.step, p.timestamp, p.value) for key in unsure for p in client.get_metric_history(run_id, key)}
    return done, [(i, m) for i, m in rest if _point(m.key, m.step, m.timestamp, m.value) not in held]


def _log_recorded(
    client: Any, path: Path, run_id: str, total: int, digest: str, pending: list[tuple[int, Any]]
) -> None:
    """Log ``pending`` in batches; after each, record how far into the file's ``total`` points the run
    now holds every one (the points between two pending ones are held already)."""
    from gradmon_ray.tracking.mlflow_io import MAX_METRICS_PER_BATCH, log_in_batches

    for start in range(0, len(pending), MAX_METRICS_PER_BATCH):
        log_in_batches(client, run_id, metrics=[m for _, m in pending[start : start + MAX_METRICS_PER_BATCH]])
        after = start + MAX_METRICS_PER_BATCH
        _append(path, {LOGGED: pending[after][0] if after < len(pending) else total, "into": run_id, "points": digest})


def replay_spill(path: str | Path, tracking_uri: str | None = None, *, mark_done: bool = True) -> ReplayResult:
    """Write a spill file's undelivered iterations into MLflow (the header's URI unless ``tracking_uri``).

    Into the run they belong to when that store has it, else into the run a replay of this file
    created there (see the module docstring).  Metrics go through the live sink's conversion
    (``mlflow_io.to_mlflow_metrics``), so they land exactly as the sink would have written them.
    ``mark_done`` renames the file to ``<file>.replayed`` afterwards.
    """
    from mlflow.tracking import MlflowClient

    from gradmon_ray.tracking.mlflow_io import log_in_batches, to_mlflow_metrics
    from gradmon_ray.tracking.store_uri import absolute_tracking_uri

    path = Path(path)
    header, iterations, trailer = read_spill(path)
    uri = absolute_tracking_uri(_replay_uri(path, header, tracking_uri))
    client = MlflowClient(tracking_uri=uri)
    known = [r.get("run_id") for r in ([*iterations, trailer] if trailer else iterations) if r and r.get("run_id")]
    named = (trailer or {}).get("run_id") or header.get("run_id") or (known[-1] if known else None)
    run_id = _existing_run(client, named)
    created, empty = run_id is None, False
    if run_id is None:
        run_id, empty = _replay_run(client, path, header, spill_records(path))
        log_in_batches(client, run_id, params=header.get("params") or {})  # again on a retry: the same values
    metrics = [
        metric
        for r in iterations
        for metric in to_mlflow_metrics(
            {k: decode_value(v) for k, v in r["metrics"].items()}, int(r["step"]), int(r["timestamp_ms"])
        )
    ]
    digest = _digest(metrics)
    done, pending = (
        (0, list(enumerate(metrics))) if empty else _to_log(client, uri, run_id, metrics, digest, spill_records(path))
    )
    _log_recorded(client, path, run_id, len(metrics), digest, pending)
    if not pending and metrics and done < len(metrics):  # every point held already: a retry need not read them
        _append(path, {LOGGED: len(metrics), "into": run_id, "points": digest})
    tags: dict[str, str] = {}
    for r in iterations:
        tags.update(r.get("tags") or {})
    log_in_batches(client, run_id, tags=tags)
    if any(mn.TAG_DIAGNOSIS in (r.get("tags") or {}) for r in iterations):  # its import is torch's: only when needed
        from gradmon_ray.tracking.diagnosis_tags import log_diagnosis_artifacts

        for r in iterations:  # each event's artifacts (the merged tags keep only the last event's)
            log_diagnosis_artifacts(client, run_id, r.get("tags") or {})
    status = (trailer or {}).get("status")
    if status:
        client.set_terminated(run_id, status=status)
    if mark_done:
        path.rename(path.with_name(path.name + REPLAYED_SUFFIX))
    return ReplayResult(run_id, replayed_iterations(iterations), len(metrics), created, status)
