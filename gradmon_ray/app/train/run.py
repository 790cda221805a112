"""The main job: train PPO with the gradmon learner and stream telemetry to MLflow (``run_training``).

A run goes through its stages in order: Ray started and the request checked against the cluster
(``ray_start.start_ray``), the MLflow run opened (``mlflow_run.open_run_sink``), the algorithm
built or restored (``_TrainingRun.build``), the iterations (``_TrainingRun.iterate``), and its
end, whatever happened (``_TrainingRun.end``: probe flushed, algorithm stopped, sink closed).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray.app.head_order import head_order
from gradmon_ray.app.ray_noise import discard_rllib_logdir, quiet_actor_creation
from gradmon_ray.app.ray_start import start_ray
from gradmon_ray.app.resource_wait import ResourceWait, requested_resources
from gradmon_ray.app.train.checkpoints import (
    RUN_ID_WAIT_S,
    CheckpointReporter,
    learner_state_digest,
    verify_restored_state,
)
from gradmon_ray.app.train.final_checkpoint import publish_final_checkpoint, stage_final_checkpoint
from gradmon_ray.app.train.interrupts import EndingGuard, GracefulInterrupt, TrainingInterrupted
from gradmon_ray.app.train.mlflow_run import RunStarted, named, open_run_sink, warn_undelivered
from gradmon_ray.app.train.resume import ResumePoint
from gradmon_ray.config import GradmonConfig
from gradmon_ray.probe.lifecycle import flush_probe, start_probe, stop_probe
from gradmon_ray.telemetry.bands import BandSet
from gradmon_ray.telemetry.blame import blame_line
from gradmon_ray.telemetry.health_stop import HealthStopMonitor, HealthStopRules, StopDecision
from gradmon_ray.tracking import MlflowSink, progress_line, result_to_metrics
from gradmon_ray.tracking.diagnosis_tags import diagnoses_in, diagnosis_tags, shared_cosine_tags
from gradmon_ray.tracking.redact import install_log_redaction
from gradmon_ray.tracking.result_metrics import latch_tags

logger = logging.getLogger(__name__)


@dataclass
class TrainingOutcome:
    """What a finished (or failed) run leaves behind."""

    run_id: str | None
    iterations_done: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_path: str | None = None
    mlflow_complete: bool = False
    """True when every iteration reached MLflow before the sink was closed."""
    probe_actor: str | None = None
    """Name of the GradientProbe actor of this run (None: probe off or not started)."""
    stop_reason: str | None = None
    """Set when a ``health_stop`` rule ended the run early (it still counts as FINISHED)."""
    spill_path: str | None = None
    """Iterations MLflow could not take, kept locally (``gradmon-ray replay``); None when nothing was."""
    checkpoint_root: str | None = None
    """Where this run's resumable checkpoints go (``<root>/<run id>``); None: checkpoints off."""
    checkpointed_iteration: int | None = None
    """The iteration of the newest resumable checkpoint this attempt saved (None: none)."""


IterationReporter = Callable[[int, dict[str, float], Any, "HealthStopMonitor | None", "str | None"], None]
"""``reporter(iteration, metrics, algo, health_monitor, stop_reason)``, after every iteration (Tune uses it)."""


def run_training(
    cfg: GradmonConfig,
    *,
    progress: Callable[[str], None] | None = print,
    sink: MlflowSink | None = None,
    reporter: IterationReporter | None = None,
    resume: ResumePoint | None = None,
    checked: bool = False,
) -> TrainingOutcome:
    """Train ``cfg.iterations`` iterations; every iteration's telemetry goes to MLflow.

    Ray is started locally unless already running or ``resources.ray_address`` /
    ``RAY_ADDRESS`` name a cluster.  A ``health_stop`` rule that fires ends the run early
    (``outcome.stop_reason``, the MLflow tag ``gradmon.stop_reason`` and the metric
    ``health/stop_reason``).  ``resume`` continues from a checkpoint (Tune's trial restarts).
    The sink is closed (flushed, run ended as FINISHED, FAILED, or KILLED on Ctrl-C) on the way
    out, whatever happens.  Without a ``sink`` the run is named ``default_run_name`` unless
    ``mlflow.run_name`` is set.  ``progress`` gets each iteration's line; if it also has a
    ``run_started(RunStarted)`` method, that is called once the MLflow run exists, before the
    first iteration.  With resumable checkpoints (``checkpoint_every``), Ctrl-C finishes the
    iteration and checkpoints it first (``interrupts``); it ends as ``TrainingInterrupted``.
    """
    install_log_redaction()  # called as a library, no CLI has masked its log output
    if sink is None and not checked:  # the CLI and a sweep check before they create anything
        from gradmon_ray.rllib.preflight import preflight

        preflight(cfg)  # env, model and restore_from: a bad input fails before Ray or MLflow start
    # before the sink: a run that can never be placed leaves no MLflow run or store behind
    started_ray = start_ray(cfg, lambda: requested_resources(cfg))
    if sink is None:
        cfg = named(cfg)
        sink = open_run_sink(cfg)
    run = _TrainingRun(cfg, sink, progress, reporter, resume, started_ray)
    try:
        run.signals.enter_context(run.interrupt)  # from here on a SIGTERM ends the run KILLED, never RUNNING
        run.build()
        run.announce()
        run.iterate()
        run.save_final()
        run.status = "FINISHED"
    except KeyboardInterrupt:
        run.status = "KILLED"  # MLflow's status for a run stopped by its user (Ctrl-C, SIGTERM), not a failure
    finally:
        run.end()  # a signal while it ends: KILLED too (interrupts.EndingGuard)
    if run.status == "KILLED":
        raise TrainingInterrupted(run.outcome) from None
    return run.outcome


class _TrainingRun:
    """One ``run_training`` call's state from its MLflow run's opening to its end."""

    def __init__(
        self,
        cfg: GradmonConfig,
        sink: MlflowSink,
        progress: Callable[[str], None] | None,
        reporter: IterationReporter | None,
        resume: ResumePoint | None,
        started_ray: bool,
    ) -> None:
        self.cfg, self.sink, self.progress, self.resume, self.started_ray = cfg, sink, progress, resume, started_ray
        self.outcome = TrainingOutcome(run_id=None, iterations_done=resume.iterations_done if resume else 0)
        self.checkpoints: CheckpointReporter | None = None
        if reporter is None and cfg.checkpoint_every > 0:  # the CLI's own runs: resumable with --resume
            root = resume.checkpoint_root if resume is not None else None
            reporter = self.checkpoints = CheckpointReporter(cfg, sink.run_id_waiting_once, root=root)
            self.outcome.checkpoint_root = str(self.checkpoints.root)
        self.reporter = reporter
        self.final_staging: Path | None = None  # RLlib's end-of-run checkpoint until the run id is known
        graceful = self.checkpoints is not None
        self.interrupt = GracefulInterrupt(graceful=graceful)  # Ctrl-C or SIGTERM: see interrupts
        self.signals = ExitStack()
        rules = HealthStopRules(**cfg.health_stop.model_dump())
        self.monitor = HealthStopMonitor(rules) if rules.any else None
        self.bands = BandSet.from_dict(cfg.telemetry.bands.model_dump())  # the progress line judges heads by these
        if self.monitor is not None and resume is not None:
            self.monitor.load_state_dict(resume.health_state)
        self.status = "FAILED"
        self.algo: Any = None
        self.probe: Any = None
        # Resume/restore tags go with the first iteration MLflow has not seen, or at the end if there is none.
        self.resumed_tags: dict[str, str] = {}
        self.head_order: list[str] = []
        self.named_heads = resume is not None  # the head-names tag is set once, by the first trained iteration

    def build(self) -> None:
        """The algorithm (and the probe actor), built; restored from the resume point or ``restore_from``."""
        from gradmon_ray.rllib.config import build_ppo_config, probe_actor_name_of

        cfg, resume = self.cfg, self.resume
        ppo_config = build_ppo_config(cfg)
        self.outcome.probe_actor = probe_actor_name_of(ppo_config)
        if self.outcome.probe_actor is not None:
            logged = resume.logged_through if resume is not None else 0  # recomputed: probed, not logged twice
            self.probe = start_probe(cfg, self.outcome.probe_actor, self.sink, skip_through=logged)
        # ResourceWait: a request the cluster cannot place is reported, then given up on;
        # quiet_actor_creation: Ray's actor-restart notice, which asks nothing of the user, is dropped.
        with ResourceWait(cfg), quiet_actor_creation():
            self.algo = algo = ppo_config.build_algo()
        self.head_order = head_order(algo, cfg)
        if resume is not None:
            algo.restore_from_path(resume.checkpoint_path)  # learner state: weights, optimizer, telemetry
            restored = learner_state_digest(algo)
            verify_restored_state(resume.state_digest, restored, resume.checkpoint_path)
            self.resumed_tags[mn.TAG_RESUMED_FROM] = str(resume.iterations_done)
            self.resumed_tags[mn.TAG_RESUMED_STATE_DIGEST] = restored
            if resume.logged_through > resume.iterations_done:
                recomputed = f"{resume.iterations_done + 1}-{resume.logged_through}"
                self.resumed_tags[mn.TAG_RECOMPUTED_ITERATIONS] = recomputed
        elif cfg.restore_from:
            algo.restore_from_path(os.path.abspath(cfg.restore_from))
            self.resumed_tags[mn.TAG_RESTORED_FROM] = os.path.abspath(cfg.restore_from)

    def announce(self) -> None:
        """The CLI's ``progress.run_started``: the run id and where it is, before the first iteration; a
        resumed run waits (at most ``RUN_ID_WAIT_S``) for the sink's first try too: RUNNING again by then."""
        sink, announce = self.sink, getattr(self.progress, "run_started", None)
        if announce is None and self.resume is None:
            return
        run_id = sink.run_id_waiting_once(RUN_ID_WAIT_S)
        if announce is not None:
            announce(RunStarted(run_id, sink.run_name, sink.experiment, sink.tracking_uri))

    def iterate(self) -> None:
        """The iterations left, each logged, reported and printed; ends early on a health rule, and
        after checkpointing the iteration on Ctrl-C or SIGTERM (``KeyboardInterrupt``)."""
        logged_through = self.resume.logged_through if self.resume is not None else 0
        for iteration in range(self.outcome.iterations_done + 1, self.cfg.iterations + 1):
            decision = self._iteration(iteration, logged_through)
            if decision is not None:
                logger.warning("gradmon: stopping early: %s", self.outcome.stop_reason)
                if self.progress is not None:
                    self.progress(f"stopped by health rule: {self.outcome.stop_reason}")
                break
            if self.interrupt.requested:  # Ctrl-C or SIGTERM: this iteration checkpointed, then stop
                if self.checkpoints is not None and self.checkpoints.last_iteration != iteration:
                    self.checkpoints.save(iteration, self.algo, self.monitor)
                raise KeyboardInterrupt

    def _iteration(self, iteration: int, logged_through: int) -> StopDecision | None:
        """One iteration trained, judged, logged (unless MLflow has it), reported and printed."""
        result = self.algo.train()
        metrics = result_to_metrics(result)
        diagnoses = diagnoses_in(result)
        tags = latch_tags(metrics, self.named_heads, self.head_order)
        tags.update(diagnosis_tags(diagnoses, metrics, iteration))
        tags.update(shared_cosine_tags(result))
        self.named_heads = self.named_heads or mn.TAG_HEAD_NAMES in tags
        if iteration > logged_through:  # the first iteration MLflow has not seen carries the resume tags
            tags.update(self.resumed_tags)
            self.resumed_tags = {}
        trained = metrics[mn.LEARNERS_UPDATED] > 0  # no update: no telemetry to judge the heads by
        decision = self.monitor.update(iteration, metrics) if self.monitor is not None and trained else None
        if decision is not None:
            metrics[mn.HEALTH_STOP_REASON] = float(decision.code)
            tags[mn.TAG_STOP_REASON] = f"iteration {iteration}: {decision.message}"
            self.outcome.stop_reason = tags[mn.TAG_STOP_REASON]
        if iteration > logged_through:
            self.sink.log_iteration(iteration, metrics, tags)
        elif decision is not None:  # recomputed and already logged, but the stop must be recorded
            self.sink.log_iteration(iteration, {mn.HEALTH_STOP_REASON: metrics[mn.HEALTH_STOP_REASON]}, tags)
        self.outcome.iterations_done = iteration
        self.outcome.last_metrics = metrics
        if self.reporter is not None:
            self.reporter(iteration, metrics, self.algo, self.monitor, tags.get(mn.TAG_STOP_REASON))
        if self.progress is not None:
            value_head = self.cfg.health_stop.include_value_head
            total = self.cfg.iterations
            self.progress(progress_line(iteration, total, metrics, bands=self.bands, include_value_head=value_head))
            for diagnosis in diagnoses:
                self.progress(f"  diagnosis: {blame_line(diagnosis)}")
        return decision

    def save_final(self) -> None:
        """RLlib's end-of-run checkpoint when ``checkpoint_dir`` is set: staged now, moved into the run's
        own directory by ``end`` once the run id is known (``final_checkpoint``)."""
        if self.cfg.checkpoint_dir:
            self.final_staging = stage_final_checkpoint(self.cfg.checkpoint_dir, self.algo)

    def end(self) -> None:
        """Whatever happened: the probe flushed, the algorithm stopped, the sink closed with the status.
        A Ctrl-C or SIGTERM meanwhile cuts the steps before the close short and ends the run KILLED."""
        self.signals.close()  # training's handlers off: the ending's own below
        with EndingGuard() as ending:
            self._end(ending)

    def _end(self, ending: EndingGuard) -> None:
        import ray

        outcome, sink, algo = self.outcome, self.sink, self.algo
        # The last probe usually finishes after the last iteration's metrics were logged:
        # wait for it (the learner's client, before the learner stops) and log the final
        # probe counters at the last step, so the run's probe/* values are what happened.
        probed = algo is not None and outcome.probe_actor is not None
        probe_counters = ending.cut_short(lambda: flush_probe(algo), {}) if probed else {}
        if algo is not None:
            ending.cut_short(lambda: (algo.stop(), discard_rllib_logdir(algo)), None)  # + RLlib's empty logdir
        if self.probe is not None:
            ending.cut_short(lambda: stop_probe(self.probe), None)
        if ending.signalled is not None and self.status == "FINISHED":
            self.status = "KILLED"  # stopped while it ended: not everything a finished run leaves is there
        final = "stopped" if self.status == "FINISHED" and outcome.stop_reason else self.status.lower()
        sink.log_iteration(outcome.iterations_done, probe_counters, {**self.resumed_tags, mn.TAG_STATUS: final})
        outcome.mlflow_complete = sink.close(status=self.status)
        outcome.run_id = sink.run_id
        if self.checkpoints is not None:
            self.checkpoints.stamp_run_id(outcome.run_id)
            outcome.checkpointed_iteration = self.checkpoints.last_iteration
        if self.final_staging is not None and self.cfg.checkpoint_dir:
            try:
                final = publish_final_checkpoint(
                    self.final_staging, self.cfg.checkpoint_dir, sink.run_id, sink.run_name
                )
                outcome.checkpoint_path = str(final)
            except OSError as exc:  # on the way out of a finished run: say where it is, never fail the run
                logger.warning("end-of-run checkpoint left in %s (%s)", self.final_staging, exc)
                outcome.checkpoint_path = str(self.final_staging)
        outcome.spill_path = str(sink.spill_path) if sink.spill_path is not None else None
        if not outcome.mlflow_complete:
            warn_undelivered(sink)
        if self.started_ray:
            ray.shutdown()  # never cut: it ends the actors a cut-short stop left
