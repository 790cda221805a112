"""Health bands of a gradient norm: the edges, one set for the action heads and one for the value heads.

Pure Python (no torch): a band is a function of one float and four edges; ``worst_head``
ranks heads by their bands.  Which heads are value heads is ``metric_names.is_value_head``'s
answer for the run's declared value heads, which a ``BandSet`` carries (``value_heads``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from gradmon_ray import metric_names as mn

# Action-head edges from the TELE-320 record: 10 x the clip norm of 0.5 is "exploding".
DEAD_BELOW = 0.01
WEAK_BELOW = 0.1
HEALTHY_MAX = 2.0
ELEVATED_MAX = 5.0

HEALTH_BANDS: tuple[str, ...] = ("missing", "dead", "weak", "healthy", "elevated", "exploding", "spiking")
"""Every health state; "spiking" is judged from the mean AND the largest minibatch norm (``HealthBands.judge``)."""
SPIKE_MEAN_BANDS = frozenset({"weak", "healthy", "elevated"})
"""Mean bands a spike can hide behind: with a dead, exploding or missing mean the alarm is already up."""


@dataclass(frozen=True)
class HealthBands:
    """Band edges: dead < ``dead_below`` <= weak < ``weak_below`` <= healthy <= ``healthy_max``
    < elevated <= ``elevated_max`` < exploding (+Inf included); NaN is "missing".

    The edges must be finite, positive and strictly increasing (``ValueError`` otherwise).
    """

    dead_below: float = DEAD_BELOW
    weak_below: float = WEAK_BELOW
    healthy_max: float = HEALTHY_MAX
    elevated_max: float = ELEVATED_MAX

    def __post_init__(self) -> None:
        edges = self.edges
        if not all(isinstance(e, (int, float)) and not isinstance(e, bool) and math.isfinite(e) for e in edges):
            raise ValueError(f"band edges must be finite numbers, got {edges}")
        if not 0 < edges[0] < edges[1] < edges[2] < edges[3]:
            raise ValueError(f"band edges must be positive and strictly increasing, got {edges}")

    @property
    def edges(self) -> tuple[float, float, float, float]:
        """``(dead_below, weak_below, healthy_max, elevated_max)``."""
        return (self.dead_below, self.weak_below, self.healthy_max, self.elevated_max)

    @property
    def healthy_centre(self) -> float:
        """Natural log of the healthy band's geometric centre, ``sqrt(weak_below * healthy_max)``."""
        return math.log(math.sqrt(self.weak_below * self.healthy_max))

    def classify(self, x: float) -> str:
        """The band of ``x``: dead, weak, healthy, elevated, exploding or missing (NaN)."""
        if math.isnan(x):
            return "missing"
        if x < self.dead_below:
            return "dead"
        if x < self.weak_below:
            return "weak"
        if x <= self.healthy_max:
            return "healthy"
        if x <= self.elevated_max:
            return "elevated"
        return "exploding"

    def judge(self, mean: float, peak: float) -> str:
        """The band of the iteration's ``mean`` norm, or "spiking" where the mean is weak, healthy or
        elevated but the largest minibatch norm ``peak`` is in the exploding band (a NaN ``peak``,
        not measured: the mean's band)."""
        band = self.classify(mean)
        if band in SPIKE_MEAN_BANDS and not math.isnan(peak) and peak > self.elevated_max:
            return "spiking"
        return band


ACTION_BANDS = HealthBands()
"""The action heads' edges (and ``classify_grad_norm``'s default)."""

# Value head: its loss is a squared return error, so a healthy critic's gradient runs ~5-10x a policy head's.
VALUE_BANDS = HealthBands(dead_below=0.01, weak_below=0.1, healthy_max=10.0, elevated_max=50.0)
"""The value head's default edges."""


COLLAPSE_THRESHOLD = 0.05
COLLAPSE_ITERATIONS = 5


@dataclass(frozen=True)
class CollapseBand:
    """A head has collapsed once its normalised entropy (entropy / log(number of actions)) stayed
    below ``threshold`` for ``iterations`` consecutive telemetry steps; ``threshold`` 0 never fires."""

    threshold: float = COLLAPSE_THRESHOLD
    iterations: int = COLLAPSE_ITERATIONS

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not (isinstance(self.threshold, (int, float)) and self.threshold >= 0):
            raise ValueError(f"collapse threshold must be a number >= 0, got {self.threshold!r}")
        if isinstance(self.iterations, bool) or not (isinstance(self.iterations, int) and self.iterations >= 1):
            raise ValueError(f"collapse iterations must be an integer >= 1, got {self.iterations!r}")


@dataclass(frozen=True)
class UpdateRatioBand:
    """The update-to-weight ratio per update (``|delta theta| / |theta|`` of an iteration over its minibatch
    updates) expected of a learning head: CS231n's rule of thumb is about 1e-3 (Karpathy, "Neural Networks
    Part 3: Learning and Evaluation", "Ratio of weights:updates"); a decade either side by default."""

    low: float = 1e-4
    high: float = 1e-2

    def __post_init__(self) -> None:
        if not (
            isinstance(self.low, (int, float)) and isinstance(self.high, (int, float)) and 0 <= self.low < self.high
        ):
            raise ValueError(f"update_ratio band needs 0 <= low < high, got low={self.low!r} high={self.high!r}")


@dataclass(frozen=True)
class BandSet:
    """The edges for every reported head: ``action`` for the action heads, ``value`` for the value
    heads; ``collapse``: the entropy collapse latch of each action-distribution head.

    ``value_heads``: the run's declared value heads (names or ``head_label``s) besides the built-in
    ``value`` and ``vf``: the learner's from the module and its settings, a reader's from the run's
    ``gradmon.value_heads`` tag.  Not part of the config's ``telemetry.bands`` shape (``to_dict``)."""

    action: HealthBands = ACTION_BANDS
    value: HealthBands = VALUE_BANDS
    collapse: CollapseBand = CollapseBand()
    update_ratio: UpdateRatioBand = UpdateRatioBand()
    value_heads: tuple[str, ...] = ()

    def is_value_head(self, head: str) -> bool:
        """``metric_names.is_value_head`` with this run's ``value_heads``: THE test, asked by every reader."""
        return mn.is_value_head(head, self.value_heads)

    def for_head(self, head: str) -> HealthBands:
        """The value edges for a value head (``is_value_head``: ``value``, ``vf`` and the declared ones,
        also as a module's label ``p1/vf``), the action heads' for any other name."""
        return self.value if self.is_value_head(head) else self.action

    def with_value_heads(self, value_heads: Iterable[str]) -> BandSet:
        """The same edges with ``value_heads`` declared too (added to this set's own)."""
        return replace(self, value_heads=tuple(dict.fromkeys((*self.value_heads, *value_heads))))

    def to_dict(self) -> dict[str, dict[str, float]]:
        """``{"action": {...}, "value": {...}, "collapse": {...}}`` (the config's ``telemetry.bands`` shape)."""
        return {
            "action": asdict(self.action),
            "value": asdict(self.value),
            "collapse": asdict(self.collapse),
            "update_ratio": asdict(self.update_ratio),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> BandSet:
        """From ``to_dict()``'s shape (the config's ``telemetry.bands``); a missing edge keeps its default."""
        data = data or {}
        action = HealthBands(**{**asdict(ACTION_BANDS), **dict(data.get("action") or {})})
        value = HealthBands(**{**asdict(VALUE_BANDS), **dict(data.get("value") or {})})
        collapse = CollapseBand(**{**asdict(CollapseBand()), **dict(data.get("collapse") or {})})
        ratio = UpdateRatioBand(**{**asdict(UpdateRatioBand()), **dict(data.get("update_ratio") or {})})
        return cls(action=action, value=value, collapse=collapse, update_ratio=ratio)


DEFAULT_BANDS = BandSet()


def classify_grad_norm(x: float, *, bands: HealthBands | None = None) -> str:
    """Health band of a gradient norm: dead, weak, healthy, elevated, exploding or missing.

    Default edges (the action heads', TELE-320): dead < 0.01 <= weak < 0.1 <= healthy <= 2.0
    < elevated <= 5.0 < exploding (+Inf included); NaN is "missing" (no gradient data).
    ``bands`` gives other edges, e.g. ``VALUE_BANDS`` for the value head.
    """
    return (bands or ACTION_BANDS).classify(x)


_SEVERITY = {"healthy": 0, "weak": 1, "elevated": 1, "missing": 2, "spiking": 2, "dead": 3, "exploding": 3}


def worst_head(norms: Mapping[str, float], *, bands: BandSet | HealthBands | None = None) -> tuple[str, str]:
    """The head furthest from health and its band.

    Ordered by band severity (dead/exploding, then missing, then weak/elevated, then
    healthy); ties go to the norm furthest, on a log scale, from the centre of the head's
    healthy band (sqrt(0.1 * 2.0) for the action edges), so a healthy run still names the
    head nearest an edge.  ``bands``: one ``HealthBands`` for every head (default: the
    action heads' edges), or a ``BandSet``, which judges its value heads (``BandSet.is_value_head``)
    by the value edges.  Every head given competes: leave value heads out to rank action heads only.
    """
    if not norms:
        raise ValueError("no heads")

    def edges(head: str) -> HealthBands:
        if isinstance(bands, BandSet):
            return bands.for_head(head)
        return bands or ACTION_BANDS

    def key(head: str) -> tuple[int, float]:
        x, b = norms[head], edges(head)
        distance = abs(math.log(x) - b.healthy_centre) if math.isfinite(x) and x > 0 else math.inf
        return _SEVERITY[b.classify(x)], distance

    head = max(norms, key=key)
    return head, edges(head).classify(norms[head])
