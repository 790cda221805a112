"""Ray Tune sweeps over any config field, one MLflow child run per trial (``run_sweep``).

The sweep file, its validation and its search space: ``sweep.config``.  Each trial
(``trials.run_trial``) runs ``run_training`` (so the telemetry, the probe and the ``health_stop``
rules are the same as ``gradmon-ray train``), writes an MLflow run nested under the sweep's parent
run, reports every iteration to Tune and checkpoints, so that Tune's ``FailureConfig`` retries
resume it where it stopped and in the same MLflow run.  While the sweep runs, ``progress`` gets one
line per trial iteration (``TrialProgress``), then one summary line per trial.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ray.tune import Callback

from gradmon_ray import metric_names as mn
from gradmon_ray.app.ray_start import start_ray
from gradmon_ray.app.sweep.config import SweepConfig, tune_search_space
from gradmon_ray.app.sweep.progress import trial_progress_line, trial_summary_line
from gradmon_ray.app.sweep.trials import run_trial
from gradmon_ray.config import GradmonConfig, apply_overrides, config_from_dict
from gradmon_ray.telemetry.bands import DEFAULT_BANDS, BandSet
from gradmon_ray.tracking.mlflow_io import mlflow_value
from gradmon_ray.tracking.redact import redact_uri
from gradmon_ray.tracking.store_uri import absolute_tracking_uri


@dataclass
class TrialSummary:
    """One trial's outcome."""

    trial_id: str
    status: str
    run_id: str | None
    iterations: int
    metric: float | None
    stop_reason: str | None
    config: dict[str, Any]


@dataclass
class SweepOutcome:
    """What ``run_sweep`` leaves behind."""

    name: str
    parent_run_id: str
    trials: list[TrialSummary]
    best: TrialSummary | None


def run_sweep(
    sweep: SweepConfig, base: dict[str, Any], *, progress: Any = print, cfg: GradmonConfig | None = None
) -> SweepOutcome:
    """Run the sweep with Ray Tune; one nested MLflow run per trial under a parent run.

    ``progress`` (None: silent) gets a line per trial iteration as Tune receives it, then one per trial.
    ``cfg``: ``base`` already validated (the command's, loaded once); None: validated here.
    """
    import ray
    from mlflow.tracking import MlflowClient

    from gradmon_ray.rllib.config import build_ppo_config
    from gradmon_ray.rllib.preflight import preflight

    cfg = cfg if cfg is not None else config_from_dict(copy.deepcopy(base))
    preflight(cfg)  # env, model, restore_from: refused before Ray starts or any run exists
    uri = absolute_tracking_uri(cfg.mlflow.tracking_uri)
    base = _trials_base(base, cfg, uri)
    resources: list[Any] = []  # the trials' placement group, worked out once Ray runs

    def trial_request() -> dict[str, float]:
        resources.append(_trial_resources(cfg, build_ppo_config))
        return _bundle_total(resources[0].bundles)

    # a sweep whose trials a Ray started here can never place: refused before the parent run exists
    started_ray = start_ray(cfg, trial_request)
    client = MlflowClient(uri)
    name = sweep.name or "sweep"
    parent_id = _open_parent_run(client, cfg.mlflow.experiment, name, sweep.search_space)
    status = "FAILED"
    try:
        tuner = _tuner(sweep, cfg, base, uri, resources[0], name, parent_id, progress)
        with _sigint_handler_kept():
            grid = tuner.fit()
        trials = [_summary(r, sweep.metric) for r in grid]
        best = _log_best(client, parent_id, sweep, trials)
        if progress is not None:
            for t in trials:
                progress(
                    trial_summary_line(
                        t.trial_id,
                        t.status,
                        t.iterations,
                        sweep.metric,
                        t.metric,
                        run_id=t.run_id,
                        stop_reason=t.stop_reason,
                    )
                )
        status = "FINISHED" if any(t.status == "finished" for t in trials) else "FAILED"
        return SweepOutcome(name, parent_id, trials, best)
    finally:
        client.set_tag(parent_id, mn.TAG_STATUS, status.lower())
        client.set_terminated(parent_id, status=status)
        if started_ray:
            ray.shutdown()


def _trials_base(base: dict[str, Any], cfg: GradmonConfig, uri: str) -> dict[str, Any]:
    """The base config the trials start from, as Tune writes it to disk (params.json, experiment
    state): the URI with its credentials masked (the trials get the real one through the object
    store: ``run_trial``'s ``tracking_uri``), ``restore_from`` absolute (trials run elsewhere)."""
    fixed: dict[str, Any] = {"mlflow.tracking_uri": redact_uri(uri)}
    if cfg.restore_from:  # trials run in their own working directories
        fixed["restore_from"] = os.path.abspath(cfg.restore_from)
    return apply_overrides(copy.deepcopy(base), fixed)


def _open_parent_run(client: Any, experiment_name: str, name: str, search_space: dict[str, Any]) -> str:
    """The sweep's parent MLflow run (in ``experiment_name``, created if missing), its search space as params."""
    experiment = client.get_experiment_by_name(experiment_name)
    exp_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
    parent = client.create_run(exp_id, run_name=name, tags={mn.TAG_SWEEP: name, mn.TAG_STATUS: "running"})
    parent_id = parent.info.run_id
    for key, spec in search_space.items():
        client.log_param(parent_id, f"search_space.{key}", json.dumps(spec))
    return str(parent_id)


def _tuner(
    sweep: SweepConfig,
    cfg: GradmonConfig,
    base: dict[str, Any],
    uri: str,
    resources: Any,
    name: str,
    parent_id: str,
    progress: Any,
) -> Any:
    """Tune's ``Tuner`` for the sweep: ``run_trial`` on each sample, the progress callback, Tune's settings."""
    from ray import tune

    from gradmon_ray.app.ray_noise import quiet_wanted

    callbacks = []
    if progress is not None:
        bands = BandSet.from_dict(cfg.telemetry.bands.model_dump())
        include_value = cfg.health_stop.include_value_head
        callbacks.append(TrialProgress(progress, cfg.iterations, bands=bands, include_value_head=include_value))
    if quiet_wanted():  # Tune's new output engine prints its tables at start and end even at verbose=0
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    return tune.Tuner(
        tune.with_resources(tune.with_parameters(run_trial, tracking_uri=uri), resources),
        param_space={
            **tune_search_space(sweep.search_space),
            "__gradmon__": {
                "base": base,
                "parent_run_id": parent_id,
                "sweep": name,
                "every": sweep.checkpoint_every,
                "metric": sweep.metric,
            },
        },
        tune_config=tune.TuneConfig(
            num_samples=sweep.num_samples,
            metric=sweep.metric,
            mode=sweep.mode,
            max_concurrent_trials=sweep.max_concurrent_trials,
        ),
        run_config=tune.RunConfig(
            name=f"{name}-{parent_id[:8]}",
            storage_path=os.path.abspath(sweep.storage_path or "tune_results"),
            failure_config=tune.FailureConfig(max_failures=sweep.max_failures),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=sweep.keep_checkpoints),
            callbacks=callbacks,
            verbose=0,
        ),
    )


def _log_best(client: Any, parent_id: str, sweep: SweepConfig, trials: list[TrialSummary]) -> TrialSummary | None:
    """The best finished trial by the sweep's metric, logged on the parent run (None: no trial ranks)."""
    # A trial a health rule stopped is broken, whatever its metric said so far.
    ranked = [t for t in trials if t.metric is not None and not math.isnan(t.metric) and t.status == "finished"]
    best = (max if sweep.mode == "max" else min)(ranked, key=lambda t: t.metric) if ranked else None
    if best is not None:
        client.log_metric(parent_id, f"best/{sweep.metric}", mlflow_value(best.metric))  # the one +-Inf rule
        client.set_tag(parent_id, "gradmon.best_run_id", best.run_id or "")
    return best


@contextlib.contextmanager
def _sigint_handler_kept() -> Iterator[None]:
    """Tune's ``fit`` installs its own Ctrl-C handler and leaves it installed: the caller's (the
    CLI's, a notebook's) is put back afterwards, so a later Ctrl-C in this process is not Tune's."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    try:
        yield
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGINT, previous)


def _bundle_total(bundles: list[dict[str, float]]) -> dict[str, float]:
    """What a trial's placement group asks for in all."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            total[key] = total.get(key, 0.0) + float(amount)
    return total


def _trial_resources(cfg: GradmonConfig, build_ppo_config: Any) -> Any:
    """RLlib's own resource request for the algorithm (+ a bundle for the probe actor).

    RLlib's bundles carry ``custom_resources_per_learner`` / ``_per_env_runner``; the probe's
    carries ``probe.custom_resources``, so each actor fits only its own kind of bundle.
    """
    from ray import tune
    from ray.rllib.algorithms.ppo import PPO

    request = PPO.default_resource_request(build_ppo_config(cfg))
    bundles = [dict(b) for b in request.bundles]
    if cfg.probe.gradient_analysis_every > 0:
        bundles.append(
            {
                "CPU": cfg.probe.num_cpus,
                **({"GPU": cfg.probe.num_gpus} if cfg.probe.num_gpus else {}),
                **cfg.probe.custom_resources,
            }
        )
    return tune.PlacementGroupFactory(bundles, strategy=request.strategy)


def _summary(result: Any, metric: str) -> TrialSummary:
    metrics = result.metrics or {}
    reason = metrics.get(mn.HEALTH_STOP_REASON)
    config = {k: v for k, v in (result.config or {}).items() if k != "__gradmon__"}
    status = "failed" if result.error else ("stopped" if reason else "finished")
    return TrialSummary(
        trial_id=str(metrics.get("trial_id", result.path)),
        status=status,
        run_id=metrics.get("mlflow_run_id"),
        iterations=int(metrics.get("gradmon_iteration", 0)),
        metric=metrics.get(metric),
        stop_reason=metrics.get("stop_reason_text") or None,
        config=config,
    )


class TrialProgress(Callback):
    """One line per trial iteration (``trial_progress_line``), handed to ``out`` as Tune receives it.

    Tune calls ``on_trial_result`` on the driver for every ``tune.report`` of a trial, while the
    sweep runs; ``out`` prints and flushes (the CLI) or collects (tests).
    """

    def __init__(
        self,
        out: Callable[[str], Any],
        iterations: int,
        *,
        bands: BandSet = DEFAULT_BANDS,
        include_value_head: bool = False,
    ) -> None:
        self.out = out
        self.iterations = iterations
        self.bands = bands
        self.include_value_head = include_value_head

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        total = int((trial.config or {}).get("iterations", self.iterations))  # a sweep may vary it
        done = int(result.get("gradmon_iteration") or result.get("training_iteration") or 0)
        self.out(
            trial_progress_line(
                str(trial.trial_id),
                done,
                total,
                result,
                bands=self.bands,
                include_value_head=self.include_value_head,
                stop_reason=result.get("stop_reason_text"),
            )
        )

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.out(f"trial {trial.trial_id} failed; Tune restarts it from its last checkpoint (same MLflow run)")
