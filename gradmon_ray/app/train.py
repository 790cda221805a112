"""The main job: train PPO with the gradmon learner and stream telemetry to MLflow."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray.app.checkpointing import (
    RUN_ID_WAIT_S,
    CheckpointReporter,
    CheckpointStateMismatchError,  # noqa: F401  (re-exported: callers catch it from train)
    final_checkpoint_dir,
    learner_state_digest,
    verify_restored_state,
)
from gradmon_ray.app.head_order import declared_head_names, reported_head_order  # noqa: F401  (re-exported)
from gradmon_ray.app.head_order import head_order as _head_order
from gradmon_ray.app.interrupts import GracefulInterrupt, TrainingInterrupted
from gradmon_ray.app.mlflow_run import (  # noqa: F401  (re-exported: sweep and resume import them from here)
    RunStarted,
    last_logged_iteration,
    mlflow_params,
    named,
    open_run_sink,
    plotter,
    warn_undelivered,
)
from gradmon_ray.app.ray_noise import discard_rllib_logdir, quiet_actor_creation
from gradmon_ray.app.resource_wait import ResourceWait, check_fits, ray_address_problem, requested_resources
from gradmon_ray.config import ConfigError, GradmonConfig
from gradmon_ray.envs.tune_registry import tune_registry_follows_this_job
from gradmon_ray.probe.lifecycle import flush_probe, start_probe, stop_probe
from gradmon_ray.telemetry.bands import BandSet
from gradmon_ray.telemetry.health_stop import HealthStopMonitor, HealthStopRules
from gradmon_ray.tracking import MlflowSink, progress_line, result_to_metrics
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


@dataclass
class ResumePoint:
    """Where a resumed run starts: an RLlib checkpoint and the iterations already done."""

    checkpoint_path: str
    iterations_done: int
    health_state: dict[str, int] = field(default_factory=dict)
    state_digest: str | None = None
    """``learner_state_digest`` when the checkpoint was written: the restore is checked against it."""
    logged_through: int = 0
    """Last iteration the failed attempt logged to MLflow: iterations up to it are not logged again."""
    checkpoint_root: str | None = None
    """Where the interrupted run kept its resumable checkpoint (``train --resume``): the resumed run
    renews it there, wherever it is started from. None: ``checkpoint_root(cfg)``."""


IterationReporter = Callable[[int, dict[str, float], Any, "HealthStopMonitor | None", "str | None"], None]
"""``reporter(iteration, metrics, algo, health_monitor, stop_reason)``, after every iteration (Tune uses it)."""


def ray_address_of(cfg: GradmonConfig) -> str | None:
    """The Ray cluster this run connects to (config, then ``RAY_ADDRESS``); None: a local Ray."""
    return cfg.resources.ray_address or os.environ.get("RAY_ADDRESS")


def ensure_ray(cfg: GradmonConfig) -> bool:
    """Start (or connect to) Ray; True if this call started it (so it should shut it down)."""
    import ray

    tune_registry_follows_this_job()  # Ray Tune's registry would keep an earlier job's id: see compat
    if ray.is_initialized():
        return False
    address = ray_address_of(cfg)
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if address:
        problem = ray_address_problem(address)  # ray.init would retry silently until Ctrl-C
        if problem:
            raise ConfigError("resources.ray_address" if cfg.resources.ray_address else "RAY_ADDRESS", problem)
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=cfg.resources.num_cpus, **kwargs)
    return True


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
    import ray

    from gradmon_ray.rllib.config import build_ppo_config, probe_actor_name_of

    install_log_redaction()  # called as a library, no CLI has masked its log output

    if sink is None and not checked:  # the CLI and a sweep check before they create anything
        from gradmon_ray.rllib.preflight import preflight

        preflight(cfg)  # env, model and restore_from: a bad input fails before Ray or MLflow start
    started_ray = ensure_ray(cfg)
    try:  # before the sink: a run that can never be placed leaves no MLflow run or store behind
        here = started_ray and not ray_address_of(cfg)
        check_fits(requested_resources(cfg), ray_started_here=here, wait_s=cfg.resources.wait_for_resources_s)
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    if sink is None:
        cfg = named(cfg)
        sink = open_run_sink(cfg)
    outcome = TrainingOutcome(run_id=None, iterations_done=resume.iterations_done if resume else 0)
    checkpoints = None
    if reporter is None and cfg.checkpoint_every > 0:  # the CLI's own runs: resumable with --resume
        root = resume.checkpoint_root if resume is not None else None
        reporter = checkpoints = CheckpointReporter(cfg, sink.run_id_waiting_once, root=root)
        outcome.checkpoint_root = str(checkpoints.root)
    interrupt = GracefulInterrupt(graceful=checkpoints is not None)  # Ctrl-C or SIGTERM: see interrupts
    signals = ExitStack()
    rules = HealthStopRules(**cfg.health_stop.model_dump())
    monitor = HealthStopMonitor(rules) if rules.any else None
    bands = BandSet.from_dict(cfg.telemetry.bands.model_dump())  # the progress line judges heads by these
    if monitor is not None and resume is not None:
        monitor.load_state_dict(resume.health_state)
    status = "FAILED"
    algo = None
    probe = None
    # Resume/restore tags go with the first iteration MLflow has not seen, or at the end if there is none.
    resumed_tags: dict[str, str] = {}
    try:
        signals.enter_context(interrupt)  # from here on a SIGTERM ends the run KILLED, never RUNNING
        ppo_config = build_ppo_config(cfg)
        outcome.probe_actor = probe_actor_name_of(ppo_config)
        if outcome.probe_actor is not None:
            probe = start_probe(cfg, outcome.probe_actor, sink)
        # ResourceWait: a request the cluster cannot place is reported, then given up on;
        # quiet_actor_creation: Ray's actor-restart notice, which asks nothing of the user, is dropped.
        with ResourceWait(cfg), quiet_actor_creation():
            algo = ppo_config.build_algo()
        head_order = _head_order(algo, cfg)
        named_heads = resume is not None  # the head-names tag is set once, by the first trained iteration
        if resume is not None:
            algo.restore_from_path(resume.checkpoint_path)  # learner state: weights, optimizer, telemetry
            restored = learner_state_digest(algo)
            verify_restored_state(resume.state_digest, restored, resume.checkpoint_path)
            resumed_tags[mn.TAG_RESUMED_FROM] = str(resume.iterations_done)
            resumed_tags[mn.TAG_RESUMED_STATE_DIGEST] = restored
            if resume.logged_through > resume.iterations_done:
                resumed_tags[mn.TAG_RECOMPUTED_ITERATIONS] = f"{resume.iterations_done + 1}-{resume.logged_through}"
        elif cfg.restore_from:
            algo.restore_from_path(os.path.abspath(cfg.restore_from))
            resumed_tags[mn.TAG_RESTORED_FROM] = os.path.abspath(cfg.restore_from)
        announce = getattr(progress, "run_started", None)
        if announce is not None:  # the CLI: the run id and where it is, before the first iteration
            run_id = sink.run_id_waiting_once(RUN_ID_WAIT_S)
            announce(RunStarted(run_id, sink.run_name, sink.experiment, sink.tracking_uri))
        logged_through = resume.logged_through if resume is not None else 0
        for iteration in range(outcome.iterations_done + 1, cfg.iterations + 1):
            result = algo.train()
            metrics = result_to_metrics(result)
            tags = latch_tags(metrics, named_heads, head_order)
            named_heads = named_heads or mn.TAG_HEAD_NAMES in tags
            if iteration > logged_through:  # the first iteration MLflow has not seen carries the resume tags
                tags.update(resumed_tags)
                resumed_tags = {}
            trained = metrics[mn.LEARNERS_UPDATED] > 0  # no update: no telemetry to judge the heads by
            decision = monitor.update(iteration, metrics) if monitor is not None and trained else None
            if decision is not None:
                metrics[mn.HEALTH_STOP_REASON] = float(decision.code)
                tags[mn.TAG_STOP_REASON] = f"iteration {iteration}: {decision.message}"
                outcome.stop_reason = tags[mn.TAG_STOP_REASON]
            if iteration > logged_through:
                sink.log_iteration(iteration, metrics, tags)
            elif decision is not None:  # recomputed and already logged, but the stop must be recorded
                sink.log_iteration(iteration, {mn.HEALTH_STOP_REASON: metrics[mn.HEALTH_STOP_REASON]}, tags)
            outcome.iterations_done = iteration
            outcome.last_metrics = metrics
            if reporter is not None:
                reporter(iteration, metrics, algo, monitor, tags.get(mn.TAG_STOP_REASON))
            if progress is not None:
                value_head = cfg.health_stop.include_value_head
                progress(progress_line(iteration, cfg.iterations, metrics, bands=bands, include_value_head=value_head))
            if decision is not None:
                logger.warning("gradmon: stopping early: %s", outcome.stop_reason)
                if progress is not None:
                    progress(f"stopped by health rule: {outcome.stop_reason}")
                break
            if interrupt.requested:  # Ctrl-C or SIGTERM: this iteration checkpointed, then stop
                if checkpoints is not None and checkpoints.last_iteration != iteration:
                    checkpoints.save(iteration, algo, monitor)
                raise KeyboardInterrupt
        if cfg.checkpoint_dir:
            final = final_checkpoint_dir(cfg.checkpoint_dir, sink.run_id, sink.run_name)  # the run's own directory
            outcome.checkpoint_path = str(algo.save_to_path(str(final)))
        status = "FINISHED"
        return outcome
    except KeyboardInterrupt:
        status = "KILLED"  # MLflow's status for a run stopped by its user (Ctrl-C, SIGTERM), not a failure
        raise TrainingInterrupted(outcome) from None
    finally:
        signals.close()  # the cleanup below runs with the signals as they were (a second Ctrl-C stops it)
        # The last probe usually finishes after the last iteration's metrics were logged:
        # wait for it (the learner's client, before the learner stops) and log the final
        # probe counters at the last step, so the run's probe/* values are what happened.
        probe_counters = flush_probe(algo) if algo is not None and outcome.probe_actor is not None else {}
        if algo is not None:
            algo.stop()
            discard_rllib_logdir(algo)  # RLlib's empty ~/ray_results/<run> directory
        if probe is not None:
            stop_probe(probe)
        final = "stopped" if status == "FINISHED" and outcome.stop_reason else status.lower()
        sink.log_iteration(outcome.iterations_done, probe_counters, {**resumed_tags, mn.TAG_STATUS: final})
        outcome.mlflow_complete = sink.close(status=status)
        outcome.run_id = sink.run_id
        if checkpoints is not None:
            checkpoints.stamp_run_id(outcome.run_id)
            outcome.checkpointed_iteration = checkpoints.last_iteration
        outcome.spill_path = str(sink.spill_path) if sink.spill_path is not None else None
        if not outcome.mlflow_complete:
            warn_undelivered(sink)
        if started_ray:
            ray.shutdown()
