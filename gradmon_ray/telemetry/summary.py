"""Host-side, once-per-iteration view of the telemetry: means, prev values, bands, latches.

``TelemetryTracker`` turns the drained lanes of one iteration into an
``IterationTelemetry`` and carries what must persist across iterations (previous norms,
latches, the skipped-update total, the iteration clock) through ``state_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.accumulator import TelemetryLayout
from gradmon_ray.telemetry.bands import BandSet, HealthBands, classify_grad_norm, worst_head
from gradmon_ray.telemetry.latches import HeadLatches
from gradmon_ray.telemetry.trends import coefficient_of_variation, trend_arrow


@dataclass
class IterationTelemetry:
    """Everything the learner reports for one training iteration (plain Python values)."""

    iteration: int
    head_norms: dict[str, float]
    head_norms_prev: dict[str, float]
    trends: dict[str, str]
    health: dict[str, str]
    head_norm_cv: float
    global_norm: float
    nan_grad_count: float
    inf_grad_count: float
    minibatches: int
    skipped: int
    skipped_total: int
    nan_latched: dict[str, bool]
    inf_latched: dict[str, bool]
    nan_first_iteration: dict[str, int] = field(default_factory=dict)
    inf_first_iteration: dict[str, int] = field(default_factory=dict)
    bands: BandSet = field(default_factory=BandSet)
    """The edges ``health`` was judged by (the value head by its own)."""

    def worst_head(self) -> tuple[str, str]:
        """See ``gradmon_ray.telemetry.worst_head`` (every head judged by its own edges)."""
        return worst_head(self.head_norms, bands=self.bands)

    def to_metrics(self) -> dict[str, float]:
        """Flat ``{metric name: float}`` using the names in ``gradmon_ray.metric_names``."""
        out: dict[str, float] = {}
        for head, value in self.head_norms.items():
            out[mn.head_metric(mn.HEAD_GRAD_NORM, head)] = value
            out[mn.head_metric(mn.HEAD_GRAD_NORM_PREV, head)] = self.head_norms_prev[head]
            out[mn.head_metric(mn.HEAD_GRAD_TREND, head)] = float(mn.TREND_CODES[self.trends[head]])
            out[mn.head_metric(mn.HEAD_GRAD_HEALTH, head)] = float(mn.HEALTH_CODES[self.health[head]])
        for head, latched in self.nan_latched.items():
            out[mn.head_metric(mn.HEAD_NAN_LATCH, head)] = float(latched)
        for head, latched in self.inf_latched.items():
            out[mn.head_metric(mn.HEAD_INF_LATCH, head)] = float(latched)
        for head, it in self.nan_first_iteration.items():
            out[mn.head_metric(mn.HEAD_NAN_LATCH_FIRST_ITERATION, head)] = float(it)
        for head, it in self.inf_first_iteration.items():
            out[mn.head_metric(mn.HEAD_INF_LATCH_FIRST_ITERATION, head)] = float(it)
        out[mn.HEAD_GRAD_NORM_CV] = self.head_norm_cv
        out[mn.GLOBAL_GRAD_NORM] = self.global_norm
        out[mn.NAN_GRAD_COUNT] = self.nan_grad_count
        out[mn.INF_GRAD_COUNT] = self.inf_grad_count
        out[mn.MINIBATCH_UPDATES] = float(self.minibatches)
        out[mn.SKIPPED_UPDATES] = float(self.skipped)
        out[mn.SKIPPED_UPDATES_TOTAL] = float(self.skipped_total)
        out[mn.TELEMETRY_ITERATION] = float(self.iteration)
        return out


class TelemetryTracker:
    """Persistent host state of the learner's telemetry across training iterations.

    ``reported_heads`` are the heads that get gradient norms (e.g. the action heads then the
    value head); ``action_heads`` (a subset of them) are judged by the action bands and enter
    the norm CV.  ``latch_heads`` (default: ``action_heads``) get log-prob NaN/Inf latches: the
    components of the action distribution, which need not be parameter groups (a module
    without per-head log-probs latches one ``"policy"`` entry).  Before the first
    iteration every ``prev`` value is NaN, so the first trend is "→".  ``bands`` holds the
    health band edges: ``bands.action`` judge the action heads, ``bands.value`` every other
    reported head (the value head); default ``BandSet()``.
    """

    def __init__(
        self,
        reported_heads: Sequence[str],
        action_heads: Sequence[str],
        *,
        bands: BandSet | None = None,
        latch_heads: Sequence[str] | None = None,
    ) -> None:
        self.reported_heads = tuple(reported_heads)
        self.action_heads = tuple(action_heads)
        self.latch_heads = tuple(self.action_heads if latch_heads is None else latch_heads)
        self.bands = bands or BandSet()
        if not set(self.action_heads) <= set(self.reported_heads):
            raise ValueError("action_heads must be a subset of reported_heads")
        self.layout = TelemetryLayout(len(self.reported_heads), len(self.latch_heads))
        self.latches = HeadLatches(self.latch_heads)
        self.prev_norms: dict[str, float] = {h: float("nan") for h in self.reported_heads}
        self.skipped_total = 0
        self.iteration = 0

    def finish_iteration(self, lanes: np.ndarray) -> IterationTelemetry:
        """Consume one iteration's drained (and, with several learners, reduced) lanes."""
        lay = self.layout
        if lanes.shape != (lay.size,):
            raise ValueError(f"expected {lay.size} lanes, got shape {lanes.shape}")
        self.iteration += 1
        sums, counts = lanes[lay.norm_sum], lanes[lay.norm_count]
        with np.errstate(invalid="ignore", divide="ignore"):
            means = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        head_norms = {h: float(v) for h, v in zip(self.reported_heads, means, strict=True)}
        g_count = lanes[lay.global_norm_count]
        global_norm = float(lanes[lay.global_norm_sum] / g_count) if g_count > 0 else float("nan")
        prev = dict(self.prev_norms)
        trends = {h: trend_arrow(prev[h], head_norms[h]) for h in self.reported_heads}
        health = {h: classify_grad_norm(head_norms[h], bands=self._bands_of(h)) for h in self.reported_heads}
        cv = coefficient_of_variation([head_norms[h] for h in self.action_heads])
        self.latches.update(lanes[lay.logp_nan], lanes[lay.logp_inf], self.iteration)
        skipped = round(lanes[lay.skipped])
        self.skipped_total += skipped
        # A missing (NaN) norm does not overwrite the last known value.
        for h in self.reported_heads:
            if not math.isnan(head_norms[h]):
                self.prev_norms[h] = head_norms[h]
        return IterationTelemetry(
            iteration=self.iteration,
            head_norms=head_norms,
            head_norms_prev=prev,
            trends=trends,
            health=health,
            head_norm_cv=cv,
            global_norm=global_norm,
            nan_grad_count=float(lanes[lay.nan_grad_count]),
            inf_grad_count=float(lanes[lay.inf_grad_count]),
            minibatches=round(lanes[lay.minibatches]),
            skipped=skipped,
            skipped_total=self.skipped_total,
            nan_latched=dict(self.latches.nan),
            inf_latched=dict(self.latches.inf),
            nan_first_iteration=dict(self.latches.nan_first_iteration),
            inf_first_iteration=dict(self.latches.inf_first_iteration),
            bands=self.bands,
        )

    def skip_iteration(self) -> None:
        """Advance the iteration clock for an iteration without telemetry lanes (telemetry off)."""
        self.iteration += 1

    def _bands_of(self, head: str) -> HealthBands:
        return self.bands.action if head in self.action_heads else self.bands.value

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (goes into the learner's checkpoint)."""
        return {
            "reported_heads": list(self.reported_heads),
            "action_heads": list(self.action_heads),
            "prev_norms": dict(self.prev_norms),
            "skipped_total": self.skipped_total,
            "iteration": self.iteration,
            "latches": self.latches.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``; heads must match exactly."""
        if tuple(state["reported_heads"]) != self.reported_heads:
            raise ValueError(
                f"checkpointed telemetry is for heads {state['reported_heads']}, "
                f"this learner has {list(self.reported_heads)}"
            )
        self.prev_norms = {h: float(state["prev_norms"][h]) for h in self.reported_heads}
        self.skipped_total = int(state["skipped_total"])
        self.iteration = int(state["iteration"])
        self.latches = HeadLatches.from_state_dict(state["latches"], self.latch_heads)
