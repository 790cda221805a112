"""The MLflow sink's spill side: which iterations go to the spill file, and when.

``SpillAhead`` is ``MlflowSink``'s third part (a mixin sharing the sink's state under its
``_cond``, as ``sink_writer.SinkWriter`` is its writer thread).  An iteration goes to the spill
file, fsynced, before ``log_iteration`` returns whenever MLflow is behind:

- after a failed write (``_start_spilling_ahead``), to the end of the run;
- while MLflow lags: the run not created, or the oldest iteration not taken, ``LAG_S`` after it
  was asked for (a server that hangs fails no write for minutes: MLflow's own HTTP retries);
- when ``close`` has waited ``CLOSE_GRACE_S`` and MLflow still has not taken everything: what is
  pending, and the status the run should end with (``_keep_on_disk_while_closing``).

So a process killed at any point (Tune kills a trial's actor 10 s after asking it to stop, Ray
kills its workers when the driver exits) leaves every iteration MLflow has not acknowledged in the
file, for ``gradmon-ray replay``; with a healthy server nothing is written and no file is made.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path

from gradmon_ray.tracking.redact import redact_uri
from gradmon_ray.tracking.sink_outage import OutageLog
from gradmon_ray.tracking.sink_writer import PendingIteration, iterations_among
from gradmon_ray.tracking.spill import SpillWriter

logger = logging.getLogger("gradmon_ray.tracking.mlflow_sink")  # one logger for the whole sink

LAG_S = 5.0
"""How long MLflow may take an iteration (or the run's creation) before iterations are spilled as
they come: several seconds of a loaded server's latency, well inside Tune's 10 s stop budget."""
CLOSE_GRACE_S = 0.5
"""How long ``close`` waits before it puts what MLflow has not taken on disk (a healthy server
takes the last iteration and the run's end in less)."""


class SpillAhead:
    """The spill half of ``MlflowSink`` (see ``MlflowSink`` for the state's meaning)."""

    tracking_uri: str
    run_id: str | None
    _cond: threading.Condition
    _pending: deque[PendingIteration]
    _spill: SpillWriter | None
    _spill_ahead: bool
    _creates_run: bool
    _owns_run: bool
    _opened_at: float
    _lag_noticed: bool
    _spilled_steps: dict[int, int]
    _delivered_seqs: set[int]
    _dropped_steps: set[int]
    _dropped_records: int
    _final_status: str
    _outage: OutageLog
    last_error: str | None

    @property
    def spilled_iterations(self) -> int:
        """Training iterations in the spill file that MLflow has not taken: what ``gradmon-ray replay``
        writes, counted as it counts them (``spill.replayed_iterations``: the distinct steps with metrics
        among the undelivered records, so the run's end record at the last step is not one more)."""
        with self._cond:
            return len({step for seq, step in self._spilled_steps.items() if seq not in self._delivered_seqs})

    @property
    def dropped_iterations(self) -> int:
        """Training iterations lost (no spill file, or the disk refused it), counted as
        ``spilled_iterations`` is: the distinct steps with metrics among the dropped records."""
        with self._cond:
            return len(self._dropped_steps)

    @property
    def spilling_ahead(self) -> bool:
        """True once an MLflow write failed: from then on every iteration is spilled as it is logged."""
        return self._spill_ahead

    @property
    def spill_path(self) -> Path | None:
        """The spill file, if it holds anything (None also when MLflow got all of it in the end)."""
        return self._spill.path if self._spill is not None and self._spill.lines_written else None

    def undelivered_summary(self) -> str:
        """After a ``close`` that returned False: what MLflow lacks and where it is, in real figures."""
        kept, lost, spill = self.spilled_iterations, self.dropped_iterations, self.spill_path
        parts = [f"{kept} iterations kept in {spill}"] if kept else []
        parts += [f"{lost} iterations lost"] if lost else []
        if not parts:
            where = f", kept in {spill}" if spill else ""
            parts.append(f"every iteration arrived, the run's end (status {self._final_status}) not confirmed{where}")
        if self._outage.cause or self.last_error:
            parts.append(f"last error: {self._outage.cause or self.last_error}")  # a few words, not urllib3's 400
        hint = f"; replay with: gradmon-ray replay {spill}" if spill else ""
        return f"MLflow at {redact_uri(self.tracking_uri)} did not receive everything ({'; '.join(parts)}){hint}"

    def _must_spill_now(self) -> bool:
        """Whether an iteration logged now goes to disk at once (caller holds ``_cond``)."""
        if self._spill is None:
            return False
        if self._spill_ahead:
            return True
        now = time.time()
        waiting_since = self._pending[0].timestamp_ms / 1000 if self._pending else None
        if self._creates_run and self.run_id is None:
            waiting_since = self._opened_at
        if waiting_since is None or now - waiting_since <= LAG_S:
            return False
        if not self._lag_noticed:
            self._lag_noticed = True
            what = "created the run" if self.run_id is None else "taken the last iteration"
            logger.warning(
                "gradmon MLflow sink: MLflow at %s has not %s after %.0f s; iterations are also kept in %s "
                "until it does (if this process is stopped first: gradmon-ray replay %s)",
                redact_uri(self.tracking_uri),
                what,
                now - waiting_since,
                self._spill.path,
                self._spill.path,
            )
        return True

    def _spill_or_drop(self, items: list[PendingIteration], *, leaving: bool = True) -> None:
        """Append ``items`` to the spill file (caller holds ``_cond``); without one, or when the
        disk refuses, items ``leaving`` memory are dropped and counted (the others stay queued)."""
        if not items:
            return
        if self._spill is not None:
            try:
                self._spill.write_iterations(
                    ((i.step, i.timestamp_ms, i.metrics, i.tags) for i in items), self.run_id, [i.seq for i in items]
                )
                for item in items:
                    item.spilled = True
                self._spilled_steps.update((i.seq, i.step) for i in items if i.metrics)
                return
            except OSError as exc:
                logger.warning("gradmon MLflow sink: cannot write spill file %s (%s)", self._spill.path, exc)
        if leaving:
            self._dropped_records += len(items)
            self._dropped_steps.update(i.step for i in items if i.metrics)

    def _start_spilling_ahead(self) -> None:
        """After a failed write: spill everything pending now, and every later iteration as it comes
        (the outage's first line says where: ``sink_outage``)."""
        with self._cond:
            if self._spill_ahead or self._spill is None:
                return
            self._spill_ahead = True
            self._spill_or_drop([i for i in self._pending if not i.spilled], leaving=False)

    def _keep_on_disk_while_closing(self, status: str, wait_s: float) -> None:
        """``close`` is waiting on MLflow: put what it has not taken, and the status the run should
        end with, in the spill file now, so that being killed while waiting loses neither; and say,
        in the one line of the wait, what it waits for (the retries inside it say nothing)."""
        with self._cond:
            if self._spill is not None:
                self._spill_or_drop([i for i in self._pending if not i.spilled], leaving=False)
            waiting = iterations_among(self._pending)
        kept = ""
        if self._spill is not None:
            try:
                self._spill.write_trailer(self.run_id, status if self._owns_run else None)
                if self._spill.lines_written:
                    kept = (
                        f"; they are kept in {self._spill.path} meanwhile (if this process is stopped first: "
                        f"gradmon-ray replay {self._spill.path})"
                    )
            except OSError as exc:
                logger.warning("gradmon MLflow sink: cannot write spill file %s (%s)", self._spill.path, exc)
        down = f" (unavailable: {self._outage.cause})" if self._outage.active else ""
        logger.warning(
            "gradmon MLflow sink: waiting up to %.0f s for MLflow at %s%s to take %sthe run's end%s",
            wait_s,
            redact_uri(self.tracking_uri),
            down,
            f"{waiting} iterations and " if waiting else "",
            kept,
        )
