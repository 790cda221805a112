"""The MLflow sink's writer thread: creates the run, writes what is pending, retries with backoff.

``SinkWriter`` is ``MlflowSink``'s consumer half (a mixin: it runs on the sink's daemon thread and
shares the sink's state, declared below, under the sink's ``_cond``); ``mlflow_sink`` holds the
producer half, the buffer and the spill file.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gradmon_ray.tracking.diagnosis_tags import log_diagnosis_artifacts
from gradmon_ray.tracking.mlflow_io import log_in_batches, to_mlflow_metrics
from gradmon_ray.tracking.redact import redact_text, uri_secrets
from gradmon_ray.tracking.sink_outage import OutageLog, outage_cause
from gradmon_ray.tracking.spill import SpillWriter
from gradmon_ray.tracking.store_lock import create_store_once

logger = logging.getLogger("gradmon_ray.tracking.mlflow_sink")  # one logger for the whole sink


def iterations_among(items: Iterable[PendingIteration]) -> int:
    """Training iterations among ``items`` (an end-of-run record, the status tag at the last step, is none)."""
    return len({item.step for item in items if item.metrics})


PlotFn = Callable[[Any, str], list[str]]
"""``plot_fn(client, run_id) -> artifact paths``: draws the run's plots into MLflow (viz.report.log_plots)."""


@dataclass
class PendingIteration:
    """One logged iteration on its way to MLflow (``spilled``: also in the spill file)."""

    seq: int
    step: int
    timestamp_ms: int
    metrics: dict[str, float]
    tags: dict[str, str] = field(default_factory=dict)
    spilled: bool = False


class SinkWriter:
    """The writer thread's side of ``MlflowSink`` (see ``MlflowSink`` for the state's meaning)."""

    tracking_uri: str
    experiment: str
    run_name: str | None
    run_id: str | None
    last_error: str | None
    failed_writes: int
    written_iterations: int
    plot_failures: int
    plotted_artifacts: list[str]
    _cond: threading.Condition
    _pending: deque[PendingIteration]
    _closing: bool
    _abandoned: bool
    _terminated: bool
    _final_status: str
    _owns_run: bool
    _creates_run: bool
    _store_uri: str
    _run_ready: threading.Event
    _run_attempted: threading.Event
    _ended: threading.Event
    _backoff0: float
    _params: dict[str, str]
    _start_tags: dict[str, str]
    _plots_every: int
    _plot_fn: PlotFn | None
    _spill: SpillWriter | None
    _delivered_seqs: set[int]
    _outage: OutageLog

    def _start_spilling_ahead(self) -> None:  # the producer half's (MlflowSink)
        raise NotImplementedError

    @property
    def spilled_iterations(self) -> int:  # the spill half's (SpillAhead)
        raise NotImplementedError

    def _worker(self) -> None:
        backoff = self._backoff0
        client = None
        while True:
            try:
                if client is None:
                    client = self._create_run()
                    self._run_ready.set()
                    self._run_attempted.set()
                    backoff = self._backoff0
                    if not self._pending:  # else the outage ends with the write of what waited
                        self._outage_over(0)
                with self._cond:
                    while not self._pending and not self._closing:
                        self._cond.wait()
                    if self._abandoned:
                        return
                    batch = list(self._pending)
                    closing = self._closing
                if batch:
                    self._write(client, batch)
                    with self._cond:
                        # By identity: the producer may have pushed some of these out (and spilled
                        # them) while we wrote, so "the first len(batch)" would drop newer ones.
                        written = {id(item) for item in batch}
                        remaining = [item for item in self._pending if id(item) not in written]
                        self._pending.clear()
                        self._pending.extend(remaining)
                        self.written_iterations += len(batch)
                        self._mark_delivered([item.seq for item in batch if item.spilled])
                    self._outage_over(iterations_among(batch))
                    backoff = self._backoff0
                    if self._plots_every and any(item.step % self._plots_every == 0 for item in batch):
                        self._draw_plots(client)
                    continue
                if closing:
                    if self._owns_run:
                        client.set_terminated(self.run_id, status=self._final_status)
                        self._terminated = True
                    self._outage_over(0)
                    self._ended.set()
                    if self._plots_every:  # after the run's end: slow plots never cost it its status
                        self._draw_plots(client)
                    return
            except Exception as exc:  # never let the writer die; training must not notice
                self.failed_writes += 1
                # MLflow's messages quote the request URL: never let a password reach a log line.
                self.last_error = redact_text(f"{type(exc).__name__}: {exc}", uri_secrets(self.tracking_uri))
                self._run_attempted.set()  # after last_error: a caller woken by it reads why
                self._start_spilling_ahead()
                with self._cond:
                    closing, waiting = self._closing, iterations_among(self._pending)
                kept_in = str(self._spill.path) if self._spill is not None else None
                cause = outage_cause(exc, uri_secrets(self.tracking_uri))
                self._outage.failed(cause, closing=closing, waiting=waiting, kept_in=kept_in)  # not one line per try
                # While closing we keep retrying until close()'s timeout gives up on us.
                if not self._sleep_before_retry(backoff):
                    return
                backoff = min(backoff * 2, 30.0)

    def _outage_over(self, delivered: int) -> None:
        """MLflow took a write: the outage's closing line, if there was one (``sink_outage``)."""
        if self._outage.active:
            spill = str(self._spill.path) if self._spill is not None else None
            self._outage.delivered(delivered, only_in_spill=self.spilled_iterations, spill=spill)

    def _mark_delivered(self, seqs: list[int]) -> None:
        """Record in the spill file that MLflow took these spilled iterations (caller holds ``_cond``).

        If the mark cannot be written they stay replayable: a replay into the run's own store
        then writes points MLflow already holds, which its SQL stores ignore.
        """
        if seqs and self._spill is not None:
            try:
                self._spill.mark_delivered(seqs)
                self._delivered_seqs.update(seqs)
            except OSError as exc:
                logger.warning("gradmon MLflow sink: cannot mark delivered in %s (%s)", self._spill.path, exc)

    def _sleep_before_retry(self, backoff_s: float) -> bool:
        """Wait out the backoff; False when ``close`` has abandoned the worker.

        New iterations do not cut the wait short (they only join the buffer): otherwise every
        iteration of an outage would cost a failed request, and the retries would compete with
        training for the CPU. ``close`` does: from then on we retry every second, so a server
        that comes back in time gets everything.
        """
        start = time.monotonic()
        with self._cond:
            while not self._abandoned:
                wait_s = min(backoff_s, 1.0) if self._closing else backoff_s
                remaining = start + wait_s - time.monotonic()
                if remaining <= 0:
                    return True
                self._cond.wait(remaining)
            return False

    def _draw_plots(self, client: Any) -> None:
        # Outside the write-retry loop: a plot that cannot be drawn is counted, never retried.
        try:
            self.plotted_artifacts = self._plot_fn(client, self.run_id)
        except Exception as exc:
            self.plot_failures += 1
            if self.plot_failures == 1:
                # Unredacted here: the sink's CredentialFilter masks message and traceback alike.
                logger.warning(
                    "gradmon MLflow sink: plots not written (%s: %s)", type(exc).__name__, exc, exc_info=True
                )

    def _create_run(self) -> Any:
        from mlflow.tracking import MlflowClient

        create_store_once(self._store_uri)  # a new sqlite store: one process at a time (store_lock)
        client = MlflowClient(tracking_uri=self._store_uri)
        if not self._creates_run:
            if self._owns_run:  # a resumed run: RUNNING again while it trains (watch follows RUNNING runs)
                client.update_run(self.run_id, status="RUNNING")
                log_in_batches(client, self.run_id, tags=self._start_tags)
            return client
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
        if self.run_id is None:
            run = client.create_run(exp_id, run_name=self.run_name, tags=self._start_tags)
            self.run_id = run.info.run_id
        log_in_batches(client, self.run_id, params=self._params)
        self._params = {}
        return client

    def _write(self, client: Any, batch: list[PendingIteration]) -> None:
        latest_tags: dict[str, str] = {}
        for item in batch:
            latest_tags.update(item.tags)
        metrics = [m for item in batch for m in to_mlflow_metrics(item.metrics, item.step, item.timestamp_ms)]
        log_in_batches(client, self.run_id, metrics=metrics, tags=latest_tags)
        for item in batch:  # each event's artifacts (``latest_tags`` keeps only the last event's)
            log_diagnosis_artifacts(client, self.run_id, item.tags)
