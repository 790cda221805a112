"""``GradmonMLflowCallback``: stream a user's own RLlib algorithm to MLflow, without the gradmon CLI.

``config.callbacks(GradmonMLflowCallback.configured(tracking_uri=..., experiment=...))`` gives every
``Algorithm`` built from ``config`` one MLflow run: created in ``on_algorithm_init``, one step per
training iteration in ``on_train_result`` (gradmon's telemetry and RLlib's main results, through
``result_to_metrics``, the same names and values ``gradmon-ray train`` logs), ended by
``algo.stop()``.  Everything goes through the CLI's asynchronous ``MlflowSink``, so a slow or dead
tracking server never blocks or breaks training (iterations it cannot take are spilled to a file
for ``gradmon-ray replay``).  Under ``ray.tune`` the algorithm is the trial's trainable actor, so the
callback runs in that actor: one run per trial, named after the trial.  Relative store and spill
paths are resolved against the DRIVER's working directory (where the user runs ``gradmon-ray watch``),
never the trial's (Tune moves a trial into a temporary directory); a store the CLI would refuse is
refused by ``configured`` on the driver, before Ray or MLflow start.

The settings and their pinning live in ``callback_settings``, what is read off the algorithm in
``algorithm_info``: import their names from there.
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import importlib
import logging
import threading
import weakref
from typing import Any, ClassVar

from ray.rllib.callbacks.callbacks import RLlibCallback

from gradmon_ray import metric_names as mn
from gradmon_ray.tracking.algorithm_info import (
    TAG_TRIAL_DIR,
    config_params,
    module_head_order,
    tune_trial_dir_name,
)
from gradmon_ray.tracking.callback_settings import (
    CallbackSettings,
    pinned_settings,
)
from gradmon_ray.tracking.diagnosis_tags import diagnoses_in, diagnosis_tags, shared_cosine_tags
from gradmon_ray.tracking.mlflow_sink import END_PLOTS_S, MlflowSink
from gradmon_ray.tracking.redact import install_log_redaction, redact_text, redact_uri
from gradmon_ray.tracking.result_metrics import heads_in, latch_tags, order_heads, result_to_metrics, run_value_heads
from gradmon_ray.tracking.spill import default_spill_path
from gradmon_ray.tracking.store_check import local_store_problem
from gradmon_ray.tracking.uri_credentials import uri_for_this_process

__all__ = ["GradmonMLflowCallback"]

logger = logging.getLogger(__name__)

TUNE_CLOSE_S = 5.0
TUNE_END_PLOTS_S = 3.0
"""In a Tune trial, ``close``'s budget for MLflow and for the end-of-run plots (seconds): Tune kills
a trial's actor 10 s after asking it to stop at the end of an experiment (its
``_actor_force_cleanup_timeout``), and what MLflow has not taken by then must already be on disk."""


def _subclass(
    cls: type[GradmonMLflowCallback], settings: CallbackSettings, *, store_checked: bool
) -> type[GradmonMLflowCallback]:
    attrs = {"settings": settings, "store_checked": store_checked, "__module__": cls.__module__}
    return type(cls)(cls.__name__, (cls,), attrs)


class _PinnedWhenShipped(type(RLlibCallback)):  # type: ignore[misc]
    """Metaclass of ``GradmonMLflowCallback``; its only job is ``_reduce_callback_class``."""


def _reduce_callback_class(cls: type[GradmonMLflowCallback]) -> Any:
    """How ``pickle`` ships a callback class (``copyreg`` hook for ``_PinnedWhenShipped`` classes only).

    ``config.callbacks(GradmonMLflowCallback)`` runs no code of ours on the driver, and Tune runs
    the trial in an actor whose cwd is a temporary trial directory: a default resolved there
    would hide the run under Ray's temp dir.  So a class whose ``tracking_uri`` is None or relative
    (or whose spill dir is relative) is pinned where it is pickled, i.e. where the config is handed
    to Tune or RLlib: the driver.  Resolved classes pickle by reference, as any class (cloudpickle
    ships the classes ``configured`` makes by value before this hook is asked).

    Pinning creates nothing: this hook also runs for ``GradmonMLflowCallback`` as the base class of
    a ``configured`` one (an ``http://`` store, say), and when RLlib ships a config whose build then
    fails; the store is made with the run (the sink serialises a new sqlite store's creation across
    processes: ``store_lock``).
    """
    pinned = pinned_settings(cls.settings)
    if pinned == cls.settings:
        return cls.__qualname__  # a str: pickle's own lookup by module and name
    return _pinned_class, (cls.__module__, cls.__qualname__, pinned.tracking_uri, pinned.spill_dir)


@functools.cache
def _pinned_class(module: str, qualname: str, tracking_uri: str, spill_dir: str | None) -> type:
    """The class ``module.qualname`` pinned to the driver's store (one class per store, however often unpickled)."""
    cls: Any = importlib.import_module(module)
    for name in qualname.split("."):
        cls = getattr(cls, name)
    pinned = dataclasses.replace(cls.settings, tracking_uri=tracking_uri, spill_dir=spill_dir)
    return _subclass(cls, pinned, store_checked=False)


copyreg.pickle(_PinnedWhenShipped, _reduce_callback_class)


class GradmonMLflowCallback(RLlibCallback, metaclass=_PinnedWhenShipped):
    """One MLflow run per algorithm: gradmon's telemetry and RLlib's main results at step = iteration.

    ``config.callbacks(GradmonMLflowCallback)`` uses the defaults (``CallbackSettings``);
    ``GradmonMLflowCallback.configured(tracking_uri=..., experiment=..., ...)`` returns a
    subclass carrying other settings (RLlib instantiates callback classes without arguments,
    on the algorithm and on every EnvRunner: construction is cheap, only the algorithm's
    instance opens a run).  The run ends FINISHED on ``algo.stop()``, FAILED when a training
    step raised; an algorithm that is never stopped is ended when it is garbage-collected or
    the process exits.
    """

    settings: ClassVar[CallbackSettings] = CallbackSettings()
    store_checked: ClassVar[bool] = False
    """True on ``configured`` classes (checked on the driver); others check when the algorithm starts."""

    @classmethod
    def configured(cls, **settings: Any) -> type[GradmonMLflowCallback]:
        """A subclass with ``settings`` (the fields of ``CallbackSettings``) for ``config.callbacks(...)``.

        Runs on the driver: relative paths are resolved against its working directory, and a store
        the CLI would refuse (its directory missing, an unknown URI scheme) is a one-line
        ``ValueError`` here.  Nothing is created: the store is made with the first run.
        """
        resolved = pinned_settings(dataclasses.replace(cls.settings, **settings))  # unknown names: TypeError
        problem = local_store_problem(str(resolved.tracking_uri), must_exist=False)
        if problem:
            raise ValueError(f"GradmonMLflowCallback.configured: {problem}")
        return _subclass(cls, resolved, store_checked=True)

    def __init__(self) -> None:
        super().__init__()
        install_log_redaction()  # in a Tune trial's actor no CLI has masked its log output
        self.sink: MlflowSink | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._announced = False
        self._failed = False
        self._in_tune_trial = False
        self._last_step = 0
        self._tagged_heads: tuple[str, ...] = ()  # the gradmon.head_names tag as last written
        self._modules_seen: set[str | None] = set()
        self._head_order: tuple[str, ...] = ()
        self._value_heads: tuple[str, ...] = ()

    # --- RLlib hooks (on the algorithm: the driver, or the Tune trial's actor) --------------
    def on_algorithm_init(self, *, algorithm: Any, metrics_logger: Any = None, **kwargs: Any) -> None:
        try:
            self._head_order = module_head_order(algorithm, self.settings.module_id)
            self._value_heads = run_value_heads(algorithm, self.settings.module_id)
            self._hook_stop(algorithm)  # close() is a no-op until the sink exists
            self.sink = self._open_sink(algorithm)  # last: nothing after it can leave a run open
            self._announce_run(self.sink)
        except Exception as exc:  # an observer: training goes on without it
            logger.warning("gradmon callback: MLflow logging off (%s: %s)", type(exc).__name__, redact_text(str(exc)))
            self.sink = None

    def on_train_result(self, *, algorithm: Any, metrics_logger: Any = None, result: dict, **kwargs: Any) -> None:
        if self.sink is None or self._closed:
            return
        try:
            step = int(result.get("training_iteration") or algorithm.iteration)
            metrics = result_to_metrics(result, self.settings.module_id)
            tags = self._head_tags(algorithm, metrics)
            tags.update(diagnosis_tags(diagnoses_in(result), metrics, step))
            tags.update(shared_cosine_tags(result))
            self.sink.log_iteration(step, metrics, tags)  # non-blocking
            self._last_step = step
        except Exception as exc:
            logger.warning("gradmon callback: iteration not logged (%s: %s)", type(exc).__name__, redact_text(str(exc)))

    def _head_tags(self, algorithm: Any, metrics: dict[str, float]) -> dict[str, str]:
        """The latched-heads tags, and the head-names (and value-heads) tags whenever the heads reported
        so far change: a module added mid-run (``algo.add_module``) joins them with its first reported
        iteration, its heads in its place in the algorithm's order; a removed one's stay (its history
        is still in the run).  Written only when they change (read from the learner results each time)."""
        reported = heads_in(metrics)
        modules = {mn.split_head_label(h)[0] for h in reported}
        if not modules <= self._modules_seen:  # a module joined: the algorithm's order and value heads again
            self._modules_seen |= modules
            self._head_order = module_head_order(algorithm, self.settings.module_id)
            self._value_heads = run_value_heads(algorithm, self.settings.module_id)
        tags = latch_tags(metrics, True, self._head_order, self._value_heads)  # the latched heads only
        heads = tuple(order_heads([*self._tagged_heads, *reported], self._head_order, self._value_heads))
        if heads != self._tagged_heads:
            self._tagged_heads = heads
            tags[mn.TAG_HEAD_NAMES] = ",".join(heads)
            if self._value_heads:  # none declared: no tag, and readers take value and vf, as the learner did
                tags[mn.TAG_VALUE_HEADS] = mn.format_value_heads(mn.value_heads_among(heads, self._value_heads))
        return tags

    # --- the run's end ----------------------------------------------------------------------
    def close(self) -> bool:
        """End the run (FINISHED, or FAILED after a failed step); True if MLflow got everything. Idempotent."""
        with self._lock:
            if self._closed or self.sink is None:
                return self._closed
            self._closed = True
        status = "FAILED" if self._failed else "FINISHED"
        self.sink.log_iteration(self._last_step, {}, {mn.TAG_STATUS: status.lower()})
        timeout_s, plots_s = self.settings.close_timeout_s, END_PLOTS_S
        if self._in_tune_trial:
            timeout_s, plots_s = min(timeout_s, TUNE_CLOSE_S), TUNE_END_PLOTS_S
        complete = self.sink.close(status=status, timeout_s=timeout_s, plots_timeout_s=plots_s)
        self._announce()  # a short run can end before MLflow has created its run
        if not complete:
            logger.warning("gradmon callback: %s", self.sink.undelivered_summary())
        return complete

    def _open_sink(self, algorithm: Any) -> MlflowSink:
        s = pinned_settings(self.settings)  # unchanged unless never pickled: then this process is the driver
        problem = None if self.store_checked else local_store_problem(str(s.tracking_uri), must_exist=False)
        if problem:
            raise ValueError(problem)  # on_algorithm_init logs it: training goes on without MLflow
        uri = uri_for_this_process(str(s.tracking_uri))
        trial = tune_trial_dir_name(algorithm)
        self._in_tune_trial = trial is not None
        run_name = s.run_name or trial
        tags = {mn.TAG_STATUS: "running", **({TAG_TRIAL_DIR: trial} if trial else {}), **s.tags}
        params = {**(config_params(algorithm.config) if s.log_config else {}), **s.params}
        return MlflowSink(
            uri,
            s.experiment,
            run_name=run_name,
            params=params,
            tags=tags,
            max_pending=s.max_pending,
            plots_every=s.plots_every,
            plot_fn=s.plot_fn,
            spill_path=default_spill_path(s.spill_dir, run_name) if s.spill_dir else None,
        )

    def _announce_run(self, sink: MlflowSink) -> None:
        """Print the run id and its store once, as soon as the sink has created the run (under Tune: in
        the trial's output, which Tune shows on the driver); ``close`` prints it if the run came later."""

        def announce_when_created() -> None:
            while not self._closed:
                if sink.wait_for_run(1.0):
                    self._announce()
                    return

        threading.Thread(target=announce_when_created, name="gradmon-announce-run", daemon=True).start()

    def _announce(self) -> None:
        with self._lock:
            sink = self.sink
            if self._announced or sink is None or sink.run_id is None:
                return
            self._announced = True
        uri = redact_uri(sink.tracking_uri)
        print(
            f"gradmon: MLflow run {sink.run_id} (experiment {sink.experiment!r}) in {uri}; "
            f"follow it: gradmon-ray watch --tracking-uri '{uri}' --run-id {sink.run_id}",
            flush=True,
        )

    def _hook_stop(self, algorithm: Any) -> None:
        # RLlib 2.60 has no on_algorithm_stop and no on-error hook: wrap this instance's step (a raise
        # means FAILED) and cleanup (Algorithm.stop() calls it, in a plain loop and in a Tune trial's
        # actor); the finalizer ends the run of an algorithm never stopped (at gc or interpreter exit).
        step, cleanup = algorithm.step, algorithm.cleanup

        def failing_step(*args: Any, **kwargs: Any) -> Any:
            try:
                return step(*args, **kwargs)
            except BaseException:
                self._failed = True
                raise

        def closing_cleanup(*args: Any, **kwargs: Any) -> Any:
            try:
                return cleanup(*args, **kwargs)
            finally:
                self.close()

        algorithm.step = failing_step
        algorithm.cleanup = closing_cleanup
        weakref.finalize(algorithm, self.close)
