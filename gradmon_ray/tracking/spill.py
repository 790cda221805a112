"""The spill file: iterations MLflow has not taken, kept on local disk, and their replay.

A JSON Lines file, appended to and fsynced, so it survives a SIGKILL or an OOM kill of the
trainer. Line 1 is a header (``"gradmon_spill": 1``, the tracking URI through ``redact_uri``,
experiment, run name, the run id when the run existed, and the params and start tags in case
it did not). Every other line is one of:

- an iteration: ``seq`` (the sink's own counter), ``step``, ``timestamp_ms``, ``run_id``,
  ``metrics``, ``tags``;
- a delivery mark, ``{"delivered": [seq, ...]}``: the sink wrote those iterations to MLflow
  after spilling them (its server came back);
- the trailer, ``"final"``: the run id and the end status known when the sink closed.

**Exactly once.** Replay writes the iterations with no delivery mark, and only those: an
iteration is either marked (MLflow has it) or replayed, never both. A mark is written only
after MLflow acknowledged the write; if the trainer dies between the two, the iteration is
replayed with its original timestamp, and MLflow's SQL stores ignore a metric point (key,
step, timestamp, value) they already hold; into any other store the replay leaves out the
points the run holds already (``spill_replay``). A torn last line (the writer killed mid-write) is
skipped. Replay into a store that does not have the run (another server, a fresh sqlite
file) creates it there from the header; the replay records that run in the file
(``replay_key``, ``replayed_into``) before it logs a metric, so a retried replay reuses it, and
after each metric batch how far it got (``replay_logged``), so a retry starts there (``spill_replay``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gradmon_ray.tracking.redact import redact_uri

SPILL_FORMAT_VERSION = 1
REPLAYED_SUFFIX = ".replayed"

SpillItem = tuple[int, int, Mapping[str, float], Mapping[str, str]]
"""``(step, timestamp_ms, metrics, tags)``: one iteration as the sink hands it over."""


def default_spill_path(directory: str | Path, run_name: str | None) -> Path:
    """``<directory>/<run name>-<UTC time>-<pid>.jsonl``, absolute (Tune changes the working dir), ``~``
    expanded (a ``--set mlflow.spill_dir=~/spill`` the shell did not expand)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in (run_name or "run"))
    return Path(directory).expanduser().absolute() / f"{safe}-{stamp}-{os.getpid()}.jsonl"


def _encode(value: float) -> float | str:
    # JSON has no NaN/Inf: keep them as strings so nothing is silently changed.
    return value if math.isfinite(value) else repr(value)


def decode_value(value: float | str) -> float:
    """A metric value as the spill file keeps it (NaN and Inf as strings) back to a float."""
    return float(value)


def _fsync_directory(directory: Path) -> None:
    """Make a new directory entry durable (a file fsynced in a directory that is not can vanish)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems cannot open a directory: the file's own fsync is all we get
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    """One ``os.write`` of whole lines to an ``O_APPEND`` descriptor, then ``fsync``: a record is
    on disk before this returns, and a kill can tear at most the last line."""
    data = "".join(json.dumps(r) + "\n" for r in records).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # metrics are the user's
    try:
        view = memoryview(data)
        while view:  # a regular file takes it in one write; loop for the rare partial one
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


class SpillWriter:
    """Appends records to a spill file, each call one ``write`` and one ``fsync``; creates the file
    (and its header) on first use only; keeps count of what it holds and what MLflow has since
    taken. Thread-safe."""

    def __init__(self, path: str | Path, header: Mapping[str, Any]) -> None:
        """``header``: the run's description; its ``tracking_uri`` is stored through ``redact_uri``."""
        self.path = Path(path)
        self._header = dict(header)
        if self._header.get("tracking_uri"):
            self._header["tracking_uri"] = redact_uri(str(self._header["tracking_uri"]))
        self._lock = threading.Lock()
        self._made_directory = False  # this writer created the spill directory (removed again if left empty)
        self.lines_written = 0
        """Iteration records written (delivery marks and the trailer not counted)."""
        self._spilled: set[int] = set()
        self._delivered: set[int] = set()

    @property
    def undelivered(self) -> int:
        """Iteration records in the file without a delivery mark: what a replay writes."""
        return len(self._spilled - self._delivered)

    def _append(self, records: list[dict[str, Any]]) -> None:
        """``append_records``; the first call creates the file with its header."""
        with self._lock:
            new = not self.path.exists()
            if new:
                self._made_directory = self._made_directory or not self.path.parent.exists()
                self.path.parent.mkdir(parents=True, exist_ok=True)
                records = [{"gradmon_spill": SPILL_FORMAT_VERSION, **self._header}, *records]
            append_records(self.path, records)
            if new:
                _fsync_directory(self.path.parent)

    def write_iterations(
        self, items: Iterable[SpillItem], run_id: str | None, seqs: Iterable[int] | None = None
    ) -> int:
        """Append ``(step, timestamp_ms, metrics, tags)`` items; returns how many were written.

        ``seqs``: the sink's number for each item, which ``mark_delivered`` refers to later."""
        records = [
            {
                "step": step,
                "timestamp_ms": ts,
                "run_id": run_id,
                "metrics": {k: _encode(v) for k, v in metrics.items()},
                "tags": dict(tags),
            }
            for step, ts, metrics, tags in items
        ]
        if seqs is not None:
            for record, seq in zip(records, seqs, strict=True):
                record["seq"] = seq
        if not records:
            return 0
        self._append(records)
        # Without a seq a record can never be marked delivered: a key of its own (negative) counts it.
        self._spilled.update(r.get("seq", -(self.lines_written + i + 1)) for i, r in enumerate(records))
        self.lines_written += len(records)
        return len(records)

    def mark_delivered(self, seqs: Iterable[int]) -> None:
        """Record that the iterations ``seqs`` (already in the file) reached MLflow: replay skips them."""
        marked = sorted(set(seqs))
        if marked:
            self._append([{"delivered": marked}])
            self._delivered.update(marked)

    def finish(self, run_id: str | None, status: str | None, *, run_done: bool) -> None:
        """At the sink's close: delete the file when MLflow has everything in it and ``run_done``
        (its status is set, or the run is not ours to end); else append the trailer (the run id
        and the status the run should end with) for the replay."""
        if not self.lines_written:
            return
        if self.undelivered == 0 and run_done:
            with self._lock:
                self.path.unlink(missing_ok=True)
                if self._made_directory:  # a run MLflow took in the end leaves no trace (another run's file stays)
                    with contextlib.suppress(OSError):
                        self.path.parent.rmdir()
            self.lines_written = 0
            return
        self.write_trailer(run_id, status)

    def write_trailer(self, run_id: str | None, status: str | None) -> None:
        """Record the run id and the status the run should end with (only if the file exists)."""
        if self.path.exists():
            self._append([{"final": True, "run_id": run_id, "status": status}])


class SpillFormatError(ValueError):
    """The file is not a gradmon-ray spill file (or is damaged), or cannot be replayed as given."""


def spill_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a spill file, header first (``SpillFormatError`` when it is not one); a torn
    last line is left out."""
    p = Path(path)
    if not p.is_file():
        done = p.with_name(p.name + REPLAYED_SUFFIX)
        raise SpillFormatError(f"{p}: no such file" + (f" ({done} exists: it was replayed)" if done.exists() else ""))
    text = p.read_text(encoding="utf-8")
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n") and number > 1:
                break  # a torn last line: the writer was killed mid-write, and fsynced the lines before
            raise SpillFormatError(f"{p}: line {number}: not JSON ({exc.msg})") from None
    if not records or records[0].get("gradmon_spill") != SPILL_FORMAT_VERSION:
        raise SpillFormatError(f"{p}: not a gradmon-ray spill file (version {SPILL_FORMAT_VERSION})")
    return records


def read_spill(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """Header, the iteration records still to replay (those without a delivery mark, in the
    order the sink counted them) and the trailer (None when the writer never closed)."""
    records = spill_records(path)
    header, body = records[0], records[1:]
    trailers = [r for r in body if r.get("final")]
    delivered = {int(seq) for r in body if "delivered" in r for seq in r["delivered"]}
    iterations = [r for r in body if "step" in r and not r.get("final") and r.get("seq") not in delivered]
    iterations.sort(key=lambda r: r.get("seq", -1))  # tags fold in the order they were logged
    return header, iterations, (trailers[-1] if trailers else None)


def replayed_iterations(records: Iterable[Mapping[str, Any]]) -> int:
    """How many training iterations spill records hold: the distinct steps with metrics.

    A step can have several records (an iteration, then the end-of-run record with the final
    status tag and probe counters at the last step), and a record can carry tags only; neither
    is another iteration.
    """
    return len({int(r["step"]) for r in records if r.get("metrics")})
