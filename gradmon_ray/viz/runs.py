"""Reading a gradmon-ray run back from MLflow: which run, its latest values, its histories.

Everything the panel, the plots and the report show comes from here, so they all agree with
what MLflow stores.  Lookup problems become ``RunLookupError`` with a one-line message
(unknown run, unknown experiment, unreachable server) instead of MLflow's tracebacks.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray import metric_parsing as mp
from gradmon_ray.head_labels import POLICY_LATCH
from gradmon_ray.telemetry.bands import DEFAULT_BANDS, BandSet
from gradmon_ray.viz.layout import modules_of, run_bands
from gradmon_ray.viz.probe_view import ProbeView
from gradmon_ray.viz.run_names import candidates, runs_named


class RunLookupError(Exception):
    """A run or experiment that does not exist (``unreachable`` False), or a tracking server
    that does not answer (``unreachable`` True); ``ambiguous``: a run name that several runs have."""

    def __init__(self, message: str, *, unreachable: bool = False, ambiguous: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable
        self.ambiguous = ambiguous


def _unreachable(tracking_uri: str, exc: Exception) -> RunLookupError:
    # The innermost cause: MLflow's own message cut at 200 characters ended mid-URL ("/api/2.0").
    from gradmon_ray.tracking.redact import redact_uri
    from gradmon_ray.tracking.store_check import last_cause

    return RunLookupError(f"cannot read MLflow at {redact_uri(tracking_uri)}: {last_cause(exc)}", unreachable=True)


def run_by_id_or_name(client: Any, ref: str, uri: str) -> Any:
    """The run whose id is ``ref``, else the one run named ``ref`` (``RunLookupError`` when none is,
    or several are: the error lists them)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(ref)
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
    named = runs_named(client, ref)
    if len(named) == 1:
        return named[0]
    if not named:
        raise RunLookupError(f"no run with id or name {ref!r} at {uri}")
    listed = candidates(named)
    # no store in this line: three ids and times fill most of the 300 characters an error line has
    raise RunLookupError(f"{len(named)} runs are named {ref!r}, started: {listed}; give the run id", ambiguous=True)


def resolve_run(client: Any, *, run_id: str | None = None, experiment: str | None = None) -> Any:
    """The MLflow run to show: ``run_id`` (a run id, or a name only one run has), else the newest
    run of ``experiment``."""
    uri = client.tracking_uri if hasattr(client, "tracking_uri") else "the tracking server"
    try:
        if run_id is not None:
            return run_by_id_or_name(client, run_id, uri)
        name = experiment or "gradmon-ray"
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise RunLookupError(f"no experiment named {name!r} at {uri}")
        runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            raise RunLookupError(f"experiment {name!r} at {uri} has no runs yet")
        return runs[0]
    except RunLookupError:
        raise
    except Exception as exc:
        raise _unreachable(uri, exc) from None


def run_heads(metrics: Mapping[str, float], tags: Mapping[str, str]) -> list[str]:
    """Reported heads in the ``gradmon.head_names`` tag's order, each module's value heads
    (``metric_names.is_value_head`` with the ``gradmon.value_heads`` tag's) last; then the heads the
    run's metrics hold and the tag does not (a module added mid-run, in a run whose tag was written
    before it joined), sorted by module.

    A run without the tag gets sorted action heads, then the value heads: never the order of the
    metric keys, which MLflow and RLlib do not keep stable.
    """
    from gradmon_ray.tracking.result_metrics import heads_in, order_heads  # imports torch: not at CLI start-up

    tagged = [h for h in tags.get(mn.TAG_HEAD_NAMES, "").split(",") if h]
    value_heads = mn.parse_value_heads(tags.get(mn.TAG_VALUE_HEADS))
    return order_heads([*tagged, *heads_in(metrics, value_heads=value_heads)], tagged, value_heads)


_BAND_OF_CODE = {code: band for band, code in mn.HEALTH_CODES.items()}


def head_band(code: float | None, norm: float | None, head: str, bands: BandSet = DEFAULT_BANDS) -> str:
    """A head's health band as the learner logged it (``grad/head/<h>/health``: judged by the
    run's configured edges, a value head by its own); a run without the code judges the norm by
    ``bands.for_head(head)`` (a value head, ``BandSet.is_value_head``: ``value``, ``vf`` and the
    run's ``gradmon.value_heads``, by the value edges)."""
    if code is not None and math.isfinite(code) and int(code) in _BAND_OF_CODE:
        return _BAND_OF_CODE[int(code)]
    if norm is None:
        return "missing"
    return bands.for_head(head).classify(norm)


def latch_head(head: str, names: Container[str], bands: BandSet = DEFAULT_BANDS) -> str:
    """The label whose latches, entropy and collapse ``head``'s rows show: its own; for an action head
    without latches of its own in a module whose action distribution latches as a whole, that
    module's ``policy`` latch (``head_labels.POLICY_LATCH``; ``names``: the run's metric names)."""
    if mn.head_metric(mn.HEAD_NAN_LATCH, head) in names or bands.is_value_head(head):
        return head
    policy = mn.head_label(mn.split_head_label(head)[0], POLICY_LATCH)
    return policy if mn.head_metric(mn.HEAD_NAN_LATCH, policy) in names else head


def policy_heads(metrics: Mapping[str, float], order: Iterable[str] = ()) -> list[str]:
    """Heads with a policy entropy or a collapse latch (the action distribution's components, which
    need not be the gradient heads), in ``order`` first, then sorted."""
    found = set(mp.heads_of(metrics, mn.HEAD_ENTROPY_NORM)) | set(mp.heads_of(metrics, mn.HEAD_COLLAPSE_LATCH))
    named = [h for h in order if h in found]
    return named + sorted(found.difference(named))


def probe_view(metrics: Mapping[str, float], step: int | None = None) -> ProbeView:
    """Module x bucket x component norms and shares from a run's latest metrics (empty when no
    probe ran); module None for a one-module run's plain names.

    Norms are the ``PROBE_COMPONENT_NORM`` names, shares the ``PROBE_SHARE`` ones; a bucket's
    other scalars (``PROBE_REWARD_STD_MEAN``, ``PROBE_NUM_STEPS``, ...) parse as their own names.
    """
    view = ProbeView(step=step)
    tables = {mn.PROBE_COMPONENT_NORM: view.norms, mn.PROBE_SHARE: view.shares}
    for key, value in metrics.items():
        parsed = mp.parse(key)
        if parsed is not None and parsed.template in tables:
            module = parsed.parts.get("module")  # each module its own table: never one overwriting another
            table = tables[parsed.template].setdefault(module, {})
            table.setdefault(parsed["bucket"], {})[parsed["component"]] = value
    return view


def latest_probe(client: Any, run_id: str, metrics: Mapping[str, float]) -> ProbeView:
    """The latest probe's view, with the iteration each module's was taken at (``step``: the latest)."""
    probe = probe_view(metrics)
    for module in probe.modules:
        bucket = probe.module_buckets(module)[0]
        component = next(iter(probe.norms[module][bucket]))
        name = mn.module_metric(module, mn.probe_metric(mn.PROBE_COMPONENT_NORM, bucket, component=component))
        try:
            probe.steps[module] = max((m.step for m in client.get_metric_history(run_id, name)), default=None)
        except Exception as exc:
            raise _unreachable(getattr(client, "tracking_uri", "MLflow"), exc) from None
    probe.step = max((s for s in probe.steps.values() if s is not None), default=None)
    return probe


@dataclass
class RunSnapshot:
    """A run's latest values: what one frame of ``gradmon-ray watch`` shows."""

    run_id: str
    run_name: str
    status: str
    metrics: dict[str, float]
    tags: dict[str, str]
    heads: list[str]
    iteration: int | None
    probe: ProbeView
    policy_heads: list[str] = field(default_factory=list)
    """Heads with a policy entropy or collapse latch (``policy_heads``)."""
    bands: BandSet = DEFAULT_BANDS
    """The edges the run judged its heads by, and its value heads (``layout.run_bands``)."""
    params: dict[str, str] = field(default_factory=dict)

    def head_value(self, template: str, head: str) -> float | None:
        """The latest value of the per-head ``template`` for ``head`` (a label), None if never logged."""
        return self.metrics.get(mn.head_metric(template, head))

    def latch_head(self, head: str) -> str:
        """Whose latches, entropy and collapse ``head``'s rows show (``latch_head``)."""
        return latch_head(head, self.metrics, self.bands)

    def module_value(self, name: str, module: str | None) -> float | None:
        """The latest value of ``module``'s ``name`` (``module/<id>/<name>``; plain for None)."""
        return self.metrics.get(mn.module_metric(module, name))


def snapshot(client: Any, run: Any) -> RunSnapshot:
    """One ``get_run`` worth of data (MLflow keeps each metric's value at its highest step)."""
    metrics = dict(run.data.metrics)
    tags = dict(run.data.tags)
    heads = run_heads(metrics, tags)
    iteration = None
    if heads:
        try:
            history = client.get_metric_history(run.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, heads[0]))
            iteration = max((m.step for m in history), default=None)
        except Exception as exc:
            raise _unreachable(getattr(client, "tracking_uri", "MLflow"), exc) from None
    probe = latest_probe(client, run.info.run_id, metrics)
    return RunSnapshot(
        run_id=run.info.run_id,
        run_name=run.info.run_name or run.info.run_id,
        status=run.info.status,
        metrics=metrics,
        tags=tags,
        heads=heads,
        iteration=iteration,
        probe=probe,
        policy_heads=policy_heads(metrics, heads),
        bands=run_bands(run.data.params, tags),
        params=dict(run.data.params),
    )


@dataclass
class RunHistory:
    """Metric histories of one run: ``series[name][step] = value``."""

    run_id: str
    heads: list[str]
    series: dict[str, dict[int, float]]
    latest: dict[str, float]
    tags: dict[str, str]
    policy_heads: list[str] = field(default_factory=list)
    """Heads with a policy entropy or collapse latch, whose series are loaded too."""
    bands: BandSet = DEFAULT_BANDS
    """The edges the run judged its heads by, and its value heads (``layout.run_bands``)."""
    params: dict[str, str] = field(default_factory=dict)

    def steps(self, name: str) -> list[int]:
        """The steps at which ``name`` was logged, ascending."""
        return sorted(self.series.get(name, {}))

    def module_series(self, name: str, module: str | None) -> dict[int, float]:
        """``module``'s history of ``name`` (``module/<id>/<name>``; plain for None)."""
        return self.series.get(mn.module_metric(module, name), {})

    def latch_head(self, head: str) -> str:
        """Whose latches ``head``'s rows show (``latch_head``)."""
        return latch_head(head, self.latest, self.bands)

    def head_steps(self) -> list[int]:
        """Every iteration at which any head's norm was logged."""
        steps: set[int] = set()
        for head in self.heads:
            steps.update(self.series.get(mn.head_metric(mn.HEAD_GRAD_NORM, head), {}))
        return sorted(steps)


# fmt: off
MODULE_SCALARS: tuple[str, ...] = (mn.VGS_SCALING_FACTOR, mn.GLOBAL_NOISE_SCALE, mn.SKIPPED_UPDATES_TOTAL,
    mn.GLOBAL_GRAD_NORM, mn.UPDATE_RATIO, mn.SHARED_GRAD_NORM, mn.SHARED_GRAD_COSINE_MIN)
# fmt: on
"""Per-module series (``module/<id>/<name>`` in a multi-module run) the panel, plots and report read."""
HISTORY_SCALARS: tuple[str, ...] = (*MODULE_SCALARS, mn.EPISODE_RETURN_MEAN)
"""Run-level series the plots and the report read besides the per-head ones (a one-module run's names)."""


def load_history(client: Any, run_id: str, extra: Iterable[str] = ()) -> RunHistory:
    """Per-head norms, health codes, latches and noise scales, plus ``HISTORY_SCALARS`` and ``extra``."""
    run = resolve_run(client, run_id=run_id)
    try:
        latest = dict(run.data.metrics)
        tags = dict(run.data.tags)
        heads = run_heads(latest, tags)
        bands = run_bands(run.data.params, tags)
        names = [
            mn.head_metric(t, h) for h in heads for t in (mn.HEAD_GRAD_NORM, mn.HEAD_GRAD_HEALTH, mn.HEAD_NOISE_SCALE)
        ]
        latches = dict.fromkeys(latch_head(h, latest, bands) for h in heads)
        names += [mn.head_metric(t, h) for h in latches for t in (mn.HEAD_NAN_LATCH, mn.HEAD_INF_LATCH)]
        policy = policy_heads(latest, heads)
        names += [mn.head_metric(t, h) for h in policy for t in (mn.HEAD_ENTROPY_NORM, mn.HEAD_COLLAPSE_LATCH)]
        names += [mn.module_metric(m, name) for m in modules_of(heads) for name in MODULE_SCALARS]
        names += [*HISTORY_SCALARS, *extra]
        series = {}
        for name in dict.fromkeys(names):
            if name in latest:
                series[name] = {m.step: m.value for m in client.get_metric_history(run_id, name)}
    except Exception as exc:
        raise _unreachable(getattr(client, "tracking_uri", "MLflow"), exc) from None
    return RunHistory(
        run_id=run_id,
        heads=heads,
        series=series,
        latest=latest,
        tags=tags,
        policy_heads=policy,
        bands=bands,
        params=dict(run.data.params),
    )
