"""The spill file: iterations MLflow could not take, kept on local disk, and their replay.

A JSON Lines file. Line 1 is a header (``"gradmon_spill": 1``, tracking URI, experiment, run
name, the run id when the run existed, and the params and start tags in case it did not).
Every other line is one iteration (``step``, ``timestamp_ms``, ``metrics``, ``tags``) or
the trailer (``"final"``: the run id and end status known when the sink closed). Replay
writes everything into that run, or creates it first, and is idempotent: MLflow ignores a
metric point (key, step, timestamp, value) it already has.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPILL_FORMAT_VERSION = 1
REPLAYED_SUFFIX = ".replayed"


def default_spill_path(directory: str | Path, run_name: str | None) -> Path:
    """``<directory>/<run name>-<UTC time>-<pid>.jsonl``, absolute (Tune changes the working dir)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in (run_name or "run"))
    return Path(directory).absolute() / f"{safe}-{stamp}-{os.getpid()}.jsonl"


def _encode(value: float) -> float | str:
    # JSON has no NaN/Inf: keep them as strings so nothing is silently changed.
    return value if math.isfinite(value) else repr(value)


def _decode(value: float | str) -> float:
    return float(value)


class SpillWriter:
    """Appends iterations to a spill file; creates it (and its header) on first use only."""

    def __init__(self, path: str | Path, header: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self._header = dict(header)
        self._lock = threading.Lock()
        self.lines_written = 0

    def _open(self) -> Any:
        new = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("a", encoding="utf-8")
        if new:
            handle.write(json.dumps({"gradmon_spill": SPILL_FORMAT_VERSION, **self._header}) + "\n")
        return handle

    def write_iterations(
        self, items: Iterable[tuple[int, int, Mapping[str, float], Mapping[str, str]]], run_id: str | None
    ) -> int:
        """Append ``(step, timestamp_ms, metrics, tags)`` items; returns how many were written."""
        lines = [
            json.dumps(
                {
                    "step": step,
                    "timestamp_ms": ts,
                    "run_id": run_id,
                    "metrics": {k: _encode(v) for k, v in metrics.items()},
                    "tags": dict(tags),
                }
            )
            for step, ts, metrics, tags in items
        ]
        if not lines:
            return 0
        with self._lock, self._open() as handle:
            handle.write("\n".join(lines) + "\n")
        self.lines_written += len(lines)
        return len(lines)

    def write_trailer(self, run_id: str | None, status: str | None) -> None:
        """Record the run id and the status the run should end with (only if the file exists)."""
        if not self.path.exists():
            return
        with self._lock, self._open() as handle:
            handle.write(json.dumps({"final": True, "run_id": run_id, "status": status}) + "\n")


@dataclass
class ReplayResult:
    """What ``replay_spill`` did."""

    run_id: str
    iterations: int
    """Training iterations replayed (distinct steps with metrics, see ``replayed_iterations``)."""
    metrics: int
    created_run: bool
    status: str | None


class SpillFormatError(ValueError):
    """The file is not a gradmon-ray spill file (or is damaged)."""


def read_spill(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """Header, iteration lines and trailer (None when the writer never closed) of a spill file."""
    p = Path(path)
    if not p.is_file():
        raise SpillFormatError(f"{p}: no such file")
    lines = p.read_text(encoding="utf-8").splitlines()
    try:
        records = [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as exc:
        raise SpillFormatError(f"{p}: line {exc.lineno}: not JSON ({exc.msg})") from None
    if not records or records[0].get("gradmon_spill") != SPILL_FORMAT_VERSION:
        raise SpillFormatError(f"{p}: not a gradmon-ray spill file (version {SPILL_FORMAT_VERSION})")
    header, body = records[0], records[1:]
    trailers = [r for r in body if r.get("final")]
    iterations = [r for r in body if not r.get("final")]
    return header, iterations, (trailers[-1] if trailers else None)


def replayed_iterations(records: Iterable[Mapping[str, Any]]) -> int:
    """How many training iterations spill records hold: the distinct steps with metrics.

    A step can have several records (an iteration, then the end-of-run record with the final
    status tag and probe counters at the last step), and a record can carry tags only; neither
    is another iteration.
    """
    return len({int(r["step"]) for r in records if r.get("metrics")})


def replay_spill(path: str | Path, tracking_uri: str | None = None, *, mark_done: bool = True) -> ReplayResult:
    """Write a spill file's iterations into MLflow (the header's URI unless ``tracking_uri``).

    Metrics go through the live sink's conversion (``mlflow_io.to_mlflow_metrics``), so they
    land exactly as the sink would have written them.
    """
    from mlflow.tracking import MlflowClient

    from gradmon_ray.tracking.mlflow_io import log_in_batches, to_mlflow_metrics

    header, iterations, trailer = read_spill(path)
    client = MlflowClient(tracking_uri=tracking_uri or header["tracking_uri"])
    known = [r.get("run_id") for r in ([*iterations, trailer] if trailer else iterations) if r and r.get("run_id")]
    run_id = (trailer or {}).get("run_id") or header.get("run_id") or (known[-1] if known else None)
    created = False
    if run_id is None:
        exp = client.get_experiment_by_name(header["experiment"])
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(header["experiment"])
        run = client.create_run(exp_id, run_name=header.get("run_name"), tags=header.get("tags") or {})
        run_id, created = run.info.run_id, True
        log_in_batches(client, run_id, params=header.get("params") or {})
    metrics = [
        metric
        for r in iterations
        for metric in to_mlflow_metrics(
            {k: _decode(v) for k, v in r["metrics"].items()}, int(r["step"]), int(r["timestamp_ms"])
        )
    ]
    tags: dict[str, str] = {}
    for r in iterations:
        tags.update(r.get("tags") or {})
    log_in_batches(client, run_id, metrics=metrics, tags=tags)
    status = (trailer or {}).get("status")
    if status:
        client.set_terminated(run_id, status=status)
    if mark_done:
        Path(path).rename(str(path) + REPLAYED_SUFFIX)
    return ReplayResult(run_id, replayed_iterations(iterations), len(metrics), created, status)
