"""An MLflow sink that never blocks or breaks training, and loses nothing a kill could take.

The training loop calls ``log_iteration`` (a ``put``); a daemon thread owns the
``MlflowClient``, creates the run, and writes with ``log_batch`` (at most 1000 metrics per
call, MLflow's limit).  A slow or dead tracking server only delays that thread: pending
iterations wait in a bounded buffer, failed writes are retried with backoff, and nothing is
ever raised into the caller.

**Spill ahead.** Whenever MLflow is behind (a failed write, an iteration or the run's creation not
taken within ``sink_spill.LAG_S``, or ``close`` still waiting after ``CLOSE_GRACE_S``),
``log_iteration`` also appends each iteration to the spill file (fsynced) before it returns, and
``close`` puts what is pending and the run's end status there.  A SIGKILL (Tune stopping a trial,
Ray's workers at the driver's exit) then loses nothing MLflow has not acknowledged, except
iterations logged less than ``LAG_S`` before it while MLflow seemed healthy.  Delivery goes on
when the server is back, each spilled iteration delivered is marked in the file, and replay
writes the rest exactly once (``spill``).
We write through ``MlflowClient`` rather than ``mlflow.log_*`` because the fluent API keeps
a process-global active run, which a background writer must not share with user code.
The writer thread itself (run creation, writes, retries, plots) is ``sink_writer.SinkWriter``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gradmon_ray.tracking.redact import install_log_redaction, redact_text, short, uri_secrets
from gradmon_ray.tracking.sink_outage import SINK_THREAD_NAME, OutageLog, quiet_mlflow_retries
from gradmon_ray.tracking.sink_spill import CLOSE_GRACE_S, SpillAhead
from gradmon_ray.tracking.sink_writer import PendingIteration, PlotFn, SinkWriter
from gradmon_ray.tracking.spill import SpillWriter
from gradmon_ray.tracking.store_uri import absolute_tracking_uri

__all__ = ["MAX_PARAM_VALUE_LEN", "MlflowSink", "PlotFn"]

logger = logging.getLogger(__name__)

MAX_PARAM_VALUE_LEN = 6000
NEVER_CREATED_CLOSE_S = 5.0
"""``close``'s last chance for a server that never took the run (seconds): one or more quick retries."""
END_PLOTS_S = 60.0
"""How long ``close`` waits for the end-of-run plots, after the run has ended (its own budget:
slow plots never turn a run whose metrics all arrived into an incomplete one)."""


class MlflowSink(SpillAhead, SinkWriter):
    """Asynchronous, batched MLflow writer for one run.

    Args:
        tracking_uri: e.g. ``sqlite:///mlflow.db`` (embedded) or ``http://127.0.0.1:5000``.
        experiment: experiment name, created when missing.
        run_name: MLflow run name (None: MLflow picks one).
        params: run params, written once at start (values are stringified).
        tags: run tags written at start (into the run a resumed sink is given, too).
        max_pending: iterations buffered in memory while the server is unreachable; beyond
            this the oldest leave memory: into the spill file (then replayed later), or, without
            one, dropped (``dropped_iterations`` counts the iterations among them).
        retry_backoff_s: first retry delay after a failed write (doubles up to 30 s).
        run_id: write into this existing run instead of creating one (the probe actor does
            this); ``experiment`` and ``params`` are then ignored and ``close`` leaves the
            run's status alone, because the run belongs to someone else.
        end_run: whether ``close`` ends the run (default: only a run this sink created); a
            resumed Tune trial passes True for its own earlier run, which is then set back to
            ``RUNNING`` (with ``tags``) as soon as the writer reaches MLflow.
        plots_every: every this many iterations, and once more when the sink closes, call
            ``plot_fn(client, run_id)`` to draw the run's plots from what MLflow holds and log
            them as artifacts; on this sink's thread, never the caller's. 0: no plots.
        plot_fn: the plotter (``gradmon_ray.viz.report.log_plots``), passed in by the caller:
            tracking sits below viz and never imports it. Required when ``plots_every > 0``.
        spill_path: where iterations go once MLflow has failed a write (spill ahead, see the
            module docstring), and those still pending when ``close`` gives up. Created only
            when needed; ``gradmon-ray replay`` writes what MLflow did not get. None: nothing is
            spilled, a full buffer drops the oldest.
    """

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        *,
        run_name: str | None = None,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
        max_pending: int = 1000,
        retry_backoff_s: float = 0.5,
        run_id: str | None = None,
        end_run: bool | None = None,
        plots_every: int = 0,
        plot_fn: PlotFn | None = None,
        spill_path: str | Path | None = None,
    ) -> None:
        if plots_every > 0 and plot_fn is None:
            raise ValueError("MlflowSink: plots_every > 0 needs plot_fn (e.g. gradmon_ray.viz.report.log_plots)")
        self.tracking_uri = tracking_uri
        self._store_uri = absolute_tracking_uri(tracking_uri)  # resolved here: the writer may outlive this cwd
        self.experiment = experiment
        self.run_name = run_name
        # Masked before the cut (redact.short): a password cut in half is no longer recognisable.
        self._params = {str(k): short(str(v), MAX_PARAM_VALUE_LEN) for k, v in (params or {}).items()}
        self._start_tags = {str(k): redact_text(str(v)) for k, v in (tags or {}).items()}  # create_run's own
        self._pending: deque[PendingIteration] = deque()
        self._max_pending = max_pending
        self._backoff0 = retry_backoff_s
        self._cond = threading.Condition()
        self._closing = False
        self._abandoned = False  # close() timed out: the worker must stop, leftovers were spilled
        self._terminated = False
        self._seq = 0
        self._spill_ahead = False  # an MLflow write has failed: every iteration goes to the spill too
        self._opened_at = time.time()
        self._lag_noticed = False  # the one warning that MLflow lags (sink_spill.LAG_S) was given
        self._spill = (
            SpillWriter(
                spill_path,
                {
                    "tracking_uri": tracking_uri,
                    "experiment": experiment,
                    "run_name": run_name,
                    "run_id": run_id,
                    "params": dict(self._params),
                    "tags": dict(self._start_tags),
                },
            )
            if spill_path is not None
            else None
        )
        self._plots_every = plots_every
        self._plot_fn = plot_fn
        self.plot_failures = 0
        self.plotted_artifacts: list[str] = []
        self._final_status: str = "FINISHED"
        # What went where, by record (``close``'s "MLflow got everything") and by iteration (what the
        # warnings report): a step's end-of-run record, the status tag at the last step, is no iteration.
        self._spilled_steps: dict[int, int] = {}  # seq -> step of each spilled record with metrics
        self._delivered_seqs: set[int] = set()  # spilled records marked delivered in the file
        self._dropped_steps: set[int] = set()
        self._dropped_records = 0
        self.failed_writes = 0
        self.written_iterations = 0
        self.last_error: str | None = None
        self.run_id: str | None = run_id
        self._owns_run = run_id is None if end_run is None else end_run
        self._creates_run = run_id is None
        self._run_ready = threading.Event()
        self._run_attempted = threading.Event()  # the writer's first try at the run ended (either way)
        self._ended = threading.Event()  # closing: everything written and the run ended (plots may follow)
        self._waited_for_run = False  # run_id_waiting_once has waited already
        install_log_redaction()  # before the writer logs: MLflow's errors quote the URL, password and all
        quiet_mlflow_retries()  # urllib3's and MLflow's notice per failed try: the outage lines say it once
        self._outage = OutageLog(tracking_uri, logger)
        if uri_secrets(tracking_uri):  # MLflow's set_terminated prints the run's URL, login and all, to stdout
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        self._thread = threading.Thread(target=self._worker, name=SINK_THREAD_NAME, daemon=True)
        self._thread.start()

    # --- producer side (training thread) -----------------------------------------------
    def log_iteration(self, step: int, metrics: Mapping[str, float], tags: Mapping[str, str] | None = None) -> None:
        """Queue one iteration's metrics (and tags).

        Returns at once; after a failed MLflow write, once the iteration is also in the spill
        file (an append and an fsync, milliseconds).
        """
        metrics_ = {k: float(v) for k, v in metrics.items()}
        with self._cond:
            self._seq += 1
            item = PendingIteration(self._seq, int(step), int(time.time() * 1000), metrics_, dict(tags or {}))
            # Under the lock: the worker cannot take the item before it is spilled, nor switch to
            # spilling ahead between this check and the append (it spills what is pending then).
            if self._must_spill_now():  # after a failure, or while MLflow lags: on disk before we return
                self._spill_or_drop([*(i for i in self._pending if not i.spilled), item], leaving=False)
            self._pending.append(item)
            overflow = []
            while len(self._pending) > self._max_pending:
                overflow.append(self._pending.popleft())
            self._spill_or_drop([i for i in overflow if not i.spilled])  # spilled ones wait there
            self._cond.notify()

    def wait_for_run(self, timeout_s: float) -> str | None:
        """The run id once the run exists (None if it could not be created in time)."""
        self._run_ready.wait(timeout_s)
        return self.run_id

    def run_id_waiting_once(self, timeout_s: float) -> str | None:
        """The first call waits (at most ``timeout_s``) until the writer's first try at creating the
        run has ended; every call returns the run id as it stands (None: not created yet).

        For callers that ask every iteration (checkpoints, Tune reports, the CLI's start line):
        once MLflow has refused the first try, waiting longer would only hold training up while
        the writer backs off, and later asks get the id once a retry creates the run.
        """
        if not self._waited_for_run:
            self._waited_for_run = True
            self._run_attempted.wait(timeout_s)
        return self.run_id

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait (at most ``timeout_s``) until everything queued so far is written; keeps the sink open."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending and self._thread.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.05))
            return not self._pending

    def close(self, *, status: str = "FINISHED", timeout_s: float = 30.0, plots_timeout_s: float = END_PLOTS_S) -> bool:
        """Flush what is pending, end the run with ``status``; True if everything was written.

        Waits at most ``timeout_s`` for the metrics and the run's end: a dead server cannot hold the
        process hostage.  After ``CLOSE_GRACE_S`` of waiting, what MLflow has not taken (and the
        status) is put in the spill file, so a kill while waiting loses nothing.  A server that never
        took the run (every try failed) gets ``NEVER_CREATED_CLOSE_S`` at most: what it would have
        held is in the spill file already.  The end-of-run plots come after the run's end, within
        ``plots_timeout_s`` of their own, and never make a complete run incomplete.
        """
        if self.run_id is None and self._run_attempted.is_set():
            timeout_s = min(timeout_s, NEVER_CREATED_CLOSE_S)
        with self._cond:
            self._closing = True
            self._final_status = status
            self._cond.notify()
        deadline = time.monotonic() + timeout_s
        if not self._ended.wait(min(CLOSE_GRACE_S, timeout_s)):
            self._keep_on_disk_while_closing(status, timeout_s)
            self._ended.wait(max(0.0, deadline - time.monotonic()))
        with self._cond:
            ended = self._ended.is_set()
            leftover = [] if ended else list(self._pending)
            if not ended:  # the writer is given up on; what it held goes to the spill file below
                self._abandoned = True
                self._pending.clear()
                self._cond.notify()
            self._spill_or_drop([i for i in leftover if not i.spilled])
        if ended and self._plots_every:
            self._thread.join(plots_timeout_s)
            if self._thread.is_alive():
                logger.warning("gradmon MLflow sink: end-of-run plots not done after %.0f s", plots_timeout_s)
        if self._spill is not None:
            try:
                end = None if self._terminated or not self._owns_run else status
                self._spill.finish(self.run_id, end, run_done=self._terminated_or_attached())
            except OSError as exc:
                logger.warning("gradmon MLflow sink: cannot finish spill file %s (%s)", self._spill.path, exc)
        return ended and (self._spill is None or self._spill.undelivered == 0) and not self._dropped_records

    def _terminated_or_attached(self) -> bool:
        return self.run_id is not None and (self._terminated or not self._owns_run)
