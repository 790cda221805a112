"""Host-side, once-per-iteration view of the telemetry: means, prev values, bands, latches.

``TelemetryTracker`` turns the drained lanes of one iteration into an
``IterationTelemetry`` and carries what must persist across iterations (previous norms,
latches, collapse streaks, the skipped-update total, the iteration clock) through ``state_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.bands import BandSet, HealthBands, worst_head
from gradmon_ray.telemetry.head_entropy import head_health_lane_count, normalised_entropy
from gradmon_ray.telemetry.lane_layout import TelemetryLayout
from gradmon_ray.telemetry.latches import CollapseLatches, HeadLatches
from gradmon_ray.telemetry.minibatch_spread import MinibatchSpread, minibatch_spread
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
    """The edges ``health`` was judged by (the value heads by theirs; ``bands.value_heads`` names every
    reported head that is not an action head)."""
    head_entropy: dict[str, float] = field(default_factory=dict)
    """Per latch head, the policy entropy of the step's last minibatch (empty: not measured)."""
    head_entropy_norm: dict[str, float] = field(default_factory=dict)
    """``head_entropy / log(actions)``; heads with one action are left out."""
    head_kl: dict[str, float] = field(default_factory=dict)
    """Per latch head, KL(sampling policy || current policy) of the same minibatch (empty: not measured)."""
    collapse_latched: dict[str, bool] = field(default_factory=dict)
    """Per latch head, the collapse latch (empty when the heads' sizes are unknown)."""
    collapse_first_iteration: dict[str, int] = field(default_factory=dict)
    spread: MinibatchSpread | None = None
    """Per head the largest and p95 minibatch norm and where the largest was, the clip's binding
    fraction (None: the minibatch norms were not handed over)."""

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
        for template, values in (
            (mn.HEAD_ENTROPY, self.head_entropy),
            (mn.HEAD_ENTROPY_NORM, self.head_entropy_norm),
            (mn.HEAD_KL, self.head_kl),
            (mn.HEAD_COLLAPSE_LATCH, {h: float(v) for h, v in self.collapse_latched.items()}),
            (mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION, {h: float(v) for h, v in self.collapse_first_iteration.items()}),
        ):
            for head, value in values.items():
                out[mn.head_metric(template, head)] = value
        if not math.isnan(self.head_norm_cv):  # undefined (fewer than two action heads): left out, never NaN
            out[mn.HEAD_GRAD_NORM_CV] = self.head_norm_cv
        out[mn.GLOBAL_GRAD_NORM] = self.global_norm
        out[mn.NAN_GRAD_COUNT] = self.nan_grad_count
        out[mn.INF_GRAD_COUNT] = self.inf_grad_count
        out[mn.MINIBATCH_UPDATES] = float(self.minibatches)
        out[mn.SKIPPED_UPDATES] = float(self.skipped)
        out[mn.SKIPPED_UPDATES_TOTAL] = float(self.skipped_total)
        out[mn.TELEMETRY_ITERATION] = float(self.iteration)
        if self.spread is not None:
            out.update(self.spread.to_metrics())
        return out


class TelemetryTracker:
    """Persistent host state of the learner's telemetry across training iterations.

    ``reported_heads`` are the heads that get gradient norms (e.g. the action heads then the
    value heads); ``action_heads`` (a subset of them) are judged by the action bands and enter
    the norm CV; every other reported head is a value head (the iteration's ``bands.value_heads``
    name them, so that its ``worst_head`` agrees with the health codes).  ``latch_heads``
    (default: ``action_heads``) get log-prob NaN/Inf latches: the components of the action
    distribution, which need not be parameter groups (a module without per-head log-probs
    latches one ``"policy"`` entry).  Before the first iteration every ``prev`` value is NaN, so
    the first trend is "→".  ``bands`` holds the health band edges: ``bands.action`` judge the
    action heads, ``bands.value`` every other reported head (the value heads); default
    ``BandSet()``.  An action head that ``bands.is_value_head`` calls a value head is an error.
    ``head_sizes`` (one per latch head: its number of actions) turns on the policy head health
    (entropy, KL, collapse latch by ``bands.collapse``); None when the action distribution is not
    categorical per head.
    """

    def __init__(
        self,
        reported_heads: Sequence[str],
        action_heads: Sequence[str],
        *,
        bands: BandSet | None = None,
        latch_heads: Sequence[str] | None = None,
        head_sizes: Sequence[int] | None = None,
    ) -> None:
        self.reported_heads = tuple(reported_heads)
        self.action_heads = tuple(action_heads)
        self.latch_heads = tuple(self.action_heads if latch_heads is None else latch_heads)
        if not set(self.action_heads) <= set(self.reported_heads):
            raise ValueError("action_heads must be a subset of reported_heads")
        self.bands = bands or BandSet()
        if clash := [h for h in self.action_heads if self.bands.is_value_head(h)]:
            raise ValueError(f"heads {clash} are value heads (metric_names.is_value_head), not action heads")
        # What the iteration's worst_head judges by: every non-action head a value head, as ``health``.
        self._judged_by = self.bands.with_value_heads(h for h in self.reported_heads if h not in self.action_heads)
        self.layout = TelemetryLayout(len(self.reported_heads), len(self.latch_heads))
        self.latches = HeadLatches(self.latch_heads)
        self.head_sizes = None if head_sizes is None else tuple(int(n) for n in head_sizes)
        if self.head_sizes is not None and len(self.head_sizes) != len(self.latch_heads):
            raise ValueError(f"head_sizes {self.head_sizes} needs one size per latch head {self.latch_heads}")
        collapse = self.bands.collapse
        self.collapse = CollapseLatches(self.latch_heads, collapse.threshold, collapse.iterations)
        self.prev_norms: dict[str, float] = {h: float("nan") for h in self.reported_heads}
        self.skipped_total = 0
        self.iteration = 0

    @property
    def head_health_size(self) -> int:
        """Length of the head-health lanes ``finish_iteration`` takes (0: head health off)."""
        return 0 if self.head_sizes is None else head_health_lane_count(len(self.latch_heads))

    def finish_iteration(
        self,
        lanes: np.ndarray,
        head_health: np.ndarray | None = None,
        *,
        minibatch_norms: np.ndarray | None = None,
        grad_clip: float | None = None,
    ) -> IterationTelemetry:
        """Consume one iteration's drained (and, with several learners, reduced) lanes, and the
        SUM over learners of their ``telemetry.head_entropy.head_health_lanes`` (None: not measured).

        ``minibatch_norms``: ``[minibatches, reported heads + 1]`` (each minibatch's head norms and
        global norm) for ``spread`` (``telemetry.minibatch_spread``); ``grad_clip``: the
        module's global-norm clip, for the clip's binding fraction."""
        lay = self.layout
        if lanes.shape != (lay.size,):
            raise ValueError(f"expected {lay.size} lanes, got shape {lanes.shape}")
        self.iteration += 1
        # Python floats from here on: the rest is per-head bookkeeping, and numpy scalars cost
        # ~10x a float in every comparison and dict (~60 us a step inside a learner).
        values = lanes.tolist()
        sums, counts = values[lay.norm_sum], values[lay.norm_count]
        heads = zip(self.reported_heads, sums, counts, strict=True)
        head_norms = {h: s / c if c > 0 else math.nan for h, s, c in heads}
        g_count = values[lay.global_norm_count]
        global_norm = values[lay.global_norm_sum] / g_count if g_count > 0 else math.nan
        prev = dict(self.prev_norms)
        trends = {h: trend_arrow(prev[h], head_norms[h]) for h in self.reported_heads}
        spread = None if minibatch_norms is None else minibatch_spread(minibatch_norms, self.reported_heads, grad_clip)
        peaks = spread.norm_max if spread is not None else {}
        health = {h: self._bands_of(h).judge(head_norms[h], peaks.get(h, math.nan)) for h in self.reported_heads}
        cv = coefficient_of_variation([head_norms[h] for h in self.action_heads])
        self.latches.update(values[lay.logp_nan], values[lay.logp_inf], self.iteration)
        skipped = round(values[lay.skipped])
        self.skipped_total += skipped
        # A missing (NaN) norm does not overwrite the last known value.
        for h in self.reported_heads:
            if not math.isnan(head_norms[h]):
                self.prev_norms[h] = head_norms[h]
        entropy, kl = self._head_health(head_health)
        sizes = dict(zip(self.latch_heads, self.head_sizes or (), strict=False))
        entropy_norm = {h: normalised_entropy(v, sizes[h]) for h, v in entropy.items() if sizes[h] > 1}
        self.collapse.update(entropy_norm, self.iteration)
        on = self.head_sizes is not None
        return IterationTelemetry(
            iteration=self.iteration,
            head_norms=head_norms,
            head_norms_prev=prev,
            trends=trends,
            health=health,
            head_norm_cv=cv,
            global_norm=global_norm,
            nan_grad_count=float(values[lay.nan_grad_count]),  # float also for integer lanes
            inf_grad_count=float(values[lay.inf_grad_count]),
            minibatches=round(values[lay.minibatches]),
            skipped=skipped,
            skipped_total=self.skipped_total,
            nan_latched=dict(self.latches.nan),
            inf_latched=dict(self.latches.inf),
            nan_first_iteration=dict(self.latches.nan_first_iteration),
            inf_first_iteration=dict(self.latches.inf_first_iteration),
            bands=self._judged_by,
            head_entropy=entropy,
            head_entropy_norm=entropy_norm,
            head_kl=kl,
            collapse_latched=dict(self.collapse.latched) if on else {},
            collapse_first_iteration=dict(self.collapse.first_iteration) if on else {},
            spread=spread,
        )

    def _head_health(self, lanes: np.ndarray | None) -> tuple[dict[str, float], dict[str, float]]:
        """Per-head entropy and KL from the summed lanes: each sum / the learners that measured it."""
        if self.head_sizes is None or lanes is None:
            return {}, {}
        k = len(self.latch_heads)
        if lanes.shape != (self.head_health_size,):
            raise ValueError(f"expected {self.head_health_size} head-health lanes, got shape {lanes.shape}")
        values = lanes.tolist()
        n_entropy, n_kl = values[2 * k], values[2 * k + 1]
        entropy = {h: v / n_entropy for h, v in zip(self.latch_heads, values[:k], strict=True)} if n_entropy else {}
        kl = {h: v / n_kl for h, v in zip(self.latch_heads, values[k : 2 * k], strict=True)} if n_kl else {}
        return entropy, kl

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
            "collapse": self.collapse.state_dict(),
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
        if "collapse" in state:  # absent from checkpoints written before the collapse latch existed
            self.collapse.load_state_dict(state["collapse"])
