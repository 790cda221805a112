"""Gradient-health early stopping: end a run whose heads are broken (pure logic, no Ray).

The seeds' "automated system" consumer: a head that has been ``dead`` (or ``exploding``, or
``spiking``: a calm mean over a minibatch that exploded) for N consecutive iterations, or whose
NaN / Inf log-prob latch or entropy collapse latch fired, will not recover by itself; a sweep
should stop spending compute on it.  ``HealthStopMonitor.update`` reads one iteration's
flattened metrics (the names in ``metric_names``) and returns the first rule that fires, or
None.  The streak rules read each head's ``grad/head/<head>/health`` code, which the learner
judged by that head's own band edges (``telemetry.bands``); they consider only the action heads
unless ``include_value_head`` is set.  Value heads: ``metric_names.is_value_head`` with the
run's declared ``value_heads`` (``value`` and ``vf`` always).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from gradmon_ray import metric_names as mn
from gradmon_ray import metric_parsing as mp

STOP_REASON_CODES: dict[str, int] = {
    "dead": 1,
    "exploding": 2,
    "nan_latch": 3,
    "inf_latch": 4,
    "collapse": 5,
    "spiking": 6,
    "reproduced_nonfinite": 7,
}
"""``health/stop_reason`` values (MLflow metrics are numbers); 0 = not stopped."""


@dataclass(frozen=True)
class HealthStopRules:
    """Which rules are on.  ``*_iterations = 0`` turns that rule off.

    ``include_value_head``: the dead / exploding rules also watch the value heads (judged by
    their own band edges); off by default, they watch the action heads only.
    """

    dead_iterations: int = 0
    exploding_iterations: int = 0
    spiking_iterations: int = 0
    """Stop once a head was "spiking" (a calm mean over a minibatch in the exploding band) this many
    iterations in a row (``HealthBands.judge``)."""
    nan_latch: bool = False
    inf_latch: bool = False
    collapse: bool = False
    """Stop once a head's entropy collapse latch (``latch/collapse/<head>``) fired."""
    include_value_head: bool = False
    reproduced_nonfinite: bool = False
    """Stop once a non-finite event's re-run reproduced it (``diagnosis/reproduced``): the data or the
    weights are bad, so it will happen again; a transient fault (not reproduced) does not stop."""

    @property
    def any(self) -> bool:
        """Whether any rule is on."""
        streaks = self.dead_iterations or self.exploding_iterations or self.spiking_iterations
        return bool(streaks or self.nan_latch or self.inf_latch or self.collapse or self.reproduced_nonfinite)


@dataclass(frozen=True)
class StopDecision:
    """Why a run should stop."""

    rule: str
    """A key of ``STOP_REASON_CODES``."""
    head: str
    iteration: int
    message: str

    @property
    def code(self) -> int:
        """The rule as a number (``STOP_REASON_CODES``)."""
        return STOP_REASON_CODES[self.rule]


class HealthStopMonitor:
    """Counts consecutive dead / exploding iterations per head; checks the latches.

    ``value_heads``: the run's declared value heads besides ``value`` and ``vf`` (names or
    ``head_label``s, ``metric_names.is_value_head``), left alone unless ``include_value_head``.
    """

    def __init__(self, rules: HealthStopRules, value_heads: Collection[str] = ()) -> None:
        for name in ("dead_iterations", "exploding_iterations", "spiking_iterations"):
            if getattr(rules, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(rules, name)}")
        self.rules = rules
        self.value_heads = tuple(value_heads)
        self._streaks: dict[tuple[str, str], int] = {}

    def update(self, iteration: int, metrics: Mapping[str, float]) -> StopDecision | None:
        """Feed one iteration's metrics; the first rule that fires (latches first), else None.

        An iteration without a head's health value (e.g. telemetry off) breaks no streak and
        extends none.
        """
        for rule, template, enabled, what in (
            ("nan_latch", mn.HEAD_NAN_LATCH, self.rules.nan_latch, "NaN in its log-probs"),
            ("inf_latch", mn.HEAD_INF_LATCH, self.rules.inf_latch, "Inf in its log-probs"),
            ("collapse", mn.HEAD_COLLAPSE_LATCH, self.rules.collapse, "policy entropy collapsed"),
        ):
            if not enabled:
                continue
            for head in mp.heads_of(metrics, template):
                if metrics[mn.head_metric(template, head)] >= 1.0:
                    return StopDecision(rule, head, iteration, f"{mn.describe_head(head)}: {what} (latched)")
        if self.rules.reproduced_nonfinite:
            for key, value in metrics.items():
                parsed = mp.parse(key)
                if parsed is not None and parsed.template == mn.DIAGNOSIS_REPRODUCED and value >= 1.0:
                    module = parsed.parts.get("module")
                    where = f" of module {module}" if module else ""
                    message = (
                        f"a non-finite gradient{where} reproduced on re-run (data or weights: see gradmon.diagnosis)"
                    )
                    return StopDecision("reproduced_nonfinite", module or "", iteration, message)
        decision = None
        for state in _STREAK_STATES:
            needed = getattr(self.rules, f"{state}_iterations")
            code = mn.HEALTH_CODES[state]
            for head in mp.heads_of(metrics, mn.HEAD_GRAD_HEALTH):
                if mn.is_value_head(head, self.value_heads) and not self.rules.include_value_head:
                    continue
                value = metrics[mn.head_metric(mn.HEAD_GRAD_HEALTH, head)]
                if math.isnan(value):
                    continue
                key = (state, head)
                self._streaks[key] = self._streaks.get(key, 0) + 1 if int(value) == code else 0
                if needed and self._streaks[key] >= needed and decision is None:
                    norm = metrics.get(mn.head_metric(mn.HEAD_GRAD_NORM, head), math.nan)
                    decision = StopDecision(
                        state,
                        head,
                        iteration,
                        f"{mn.describe_head(head)} {state} for {self._streaks[key]} consecutive iterations "
                        f"(norm {norm:.4g})",
                    )
        return decision

    def state_dict(self) -> dict[str, int]:
        """Streak counters, ``"<state>/<head>" -> n`` (for checkpoints; this class's own format,
        not a metric name)."""
        return {_streak_key(state, head): n for (state, head), n in self._streaks.items()}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore what ``state_dict`` wrote."""
        self._streaks = {_split_streak_key(k): int(v) for k, v in state.items()}


_STREAK_STATES = ("dead", "exploding", "spiking")


def _streak_key(state: str, head: str) -> str:
    return f"{state}/{head}"


def _split_streak_key(key: str) -> tuple[str, str]:
    """``"<state>/<head>"`` -> ``(state, head)``: the state is everything before the first ``/``."""
    state, sep, head = key.partition("/")
    if not sep or state not in _STREAK_STATES or not head:
        raise ValueError(f"not a health-stop streak key (<dead|exploding|spiking>/<head>): {key!r}")
    return state, head
