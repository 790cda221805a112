"""``gradmon-ray watch``: a terminal panel, one column per head, following a run in MLflow.

Rows (seeds' operator panel): gradient norm with trend arrow, a log-scale mini-bar, the
health state in its band colour, the NaN and Inf log-prob latches (○ clear, ● latched), the
noise scale when the run has one, and each head's normalised policy entropy and collapse latch.
Below the table: every policy head's normalised entropy and which heads collapsed (the action
distribution's heads need not be the gradient heads, e.g. ``pi``/``vf`` with ``head_0``, ``head_1``).
Header: iteration, env steps, return, VGS scale, skipped updates.  Footer: the latest probe's
bucket x component norms when a probe ran.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gradmon_ray import metric_names as mn
from gradmon_ray.viz.runs import RunSnapshot, head_band, resolve_run, snapshot

ENTROPY_LOW = 0.2
"""Normalised entropy shown in red below this (a head close to collapse)."""

BAND_STYLES: dict[str, str] = {
    "dead": "bold white on red",
    "weak": "yellow",
    "healthy": "green",
    "elevated": "dark_orange",
    "exploding": "bold white on red",
    "missing": "dim",
}
"""Rich style of each health band (dead and exploding are the two alarms)."""

BAR_WIDTH = 10
BAR_LOG10_RANGE = (-4.0, 2.0)
"""The mini-bar spans 1e-4 .. 1e2 on a log scale: dead heads get a sliver, exploding ones a full bar."""

NON_TERMINAL_WIDTH = 200
TREND_ARROWS: dict[int, str] = {code: arrow for arrow, code in mn.TREND_CODES.items()}
LATCH_CLEAR, LATCH_SET = "○", "●"


def mini_bar(norm: float | None, width: int = BAR_WIDTH) -> str:
    """``width`` cells, filled in proportion to log10(norm) over ``BAR_LOG10_RANGE``."""
    if norm is None or math.isnan(norm):
        return "·" * width
    if norm <= 0:
        return "░" * width
    low, high = BAR_LOG10_RANGE
    position = (math.log10(norm) - low) / (high - low) if math.isfinite(norm) else 1.0
    filled = max(1, min(width, round(position * width)))
    return "█" * filled + "░" * (width - filled)


def _fmt(value: float | None, spec: str = ".3f") -> str:
    if value is None:
        return "—"
    if math.isnan(value):
        return "nan"
    return format(value, spec)


def head_cells(snap: RunSnapshot, head: str) -> dict[str, Text]:
    """The panel's cells for one head, keyed by row name."""
    norm = snap.head_value(mn.HEAD_GRAD_NORM, head)
    trend = snap.head_value(mn.HEAD_GRAD_TREND, head)
    band = head_band(snap.head_value(mn.HEAD_GRAD_HEALTH, head), norm, head)
    arrow = TREND_ARROWS.get(int(trend), "→") if trend is not None and math.isfinite(trend) else " "
    nan_latched = (snap.head_value(mn.HEAD_NAN_LATCH, head) or 0.0) > 0
    inf_latched = (snap.head_value(mn.HEAD_INF_LATCH, head) or 0.0) > 0
    noise = snap.head_value(mn.HEAD_NOISE_SCALE, head)
    entropy_norm = snap.head_value(mn.HEAD_ENTROPY_NORM, head)
    collapsed = (snap.head_value(mn.HEAD_COLLAPSE_LATCH, head) or 0.0) > 0
    low = entropy_norm is not None and entropy_norm < ENTROPY_LOW
    return {
        "grad norm": Text(f"{_fmt(norm)} {arrow}"),
        "log bar": Text(mini_bar(norm), style=BAND_STYLES[band]),
        "state": Text(band, style=BAND_STYLES[band]),
        "NaN latch": Text(LATCH_SET if nan_latched else LATCH_CLEAR, style="bold red" if nan_latched else "dim"),
        "Inf latch": Text(LATCH_SET if inf_latched else LATCH_CLEAR, style="bold red" if inf_latched else "dim"),
        "noise scale": Text(_fmt(noise, ".3g")),
        "entropy norm": Text(_fmt(entropy_norm), style="bold red" if low else ""),
        "collapse": Text(LATCH_SET if collapsed else LATCH_CLEAR, style="bold red" if collapsed else "dim"),
    }


def policy_line(snap: RunSnapshot) -> Text | None:
    """Every policy head's normalised entropy, then the collapsed heads (with the iteration each
    fired); None for a run without policy head health."""
    if not snap.policy_heads:
        return None
    values = [f"{h} {_fmt(snap.head_value(mn.HEAD_ENTROPY_NORM, h))}" for h in snap.policy_heads]
    collapsed = [h for h in snap.policy_heads if (snap.head_value(mn.HEAD_COLLAPSE_LATCH, h) or 0.0) > 0]
    text = Text("policy entropy (entropy / log actions): " + ", ".join(values) + "  ·  collapsed: ")
    if not collapsed:
        return text.append("none", style="green")
    fired = [(h, snap.head_value(mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION, h)) for h in collapsed]
    return text.append(
        ", ".join(f"{h} (iteration {int(it)})" if it is not None else h for h, it in fired), style="bold red"
    )


def _status(snap: RunSnapshot) -> str:
    mlflow_status = snap.status.lower()
    ours = snap.tags.get(mn.TAG_STATUS)
    return mlflow_status if ours in (None, mlflow_status) else f"{mlflow_status}, {ours}"


def _header(snap: RunSnapshot) -> Text:
    m = snap.metrics
    steps = m.get(mn.ENV_STEPS_SAMPLED_LIFETIME)
    parts = [
        f"run {snap.run_name} ({_status(snap)})",
        f"iteration {snap.iteration if snap.iteration is not None else '—'}",
        f"env steps {int(steps) if steps is not None else '—'}",
        f"return {_fmt(m.get(mn.EPISODE_RETURN_MEAN))}",
        f"VGS scale {_fmt(m.get(mn.VGS_SCALING_FACTOR), '.4g')}",
        f"skipped updates {int(m.get(mn.SKIPPED_UPDATES_TOTAL, 0.0))}",
    ]
    text = Text("  ·  ".join(parts), style="bold")
    reason = snap.tags.get(mn.TAG_STOP_REASON)
    if reason:
        text.append(f"\nstopped: {reason}", style="bold red")
    return text


def _probe_footer(snap: RunSnapshot) -> Group | Text:
    probe = snap.probe
    if not probe.norms:
        return Text("probe: no probe results in this run", style="dim")
    table = Table()
    table.add_column("bucket")
    for component in probe.components:
        table.add_column(component, justify="right")
    for bucket in probe.buckets:
        row = [bucket]
        for component in probe.components:
            norm = probe.norms[bucket].get(component)
            share = probe.shares.get(bucket, {}).get(component)
            row.append(f"{_fmt(norm, '.3g')}" + (f" ({share:+.0%})" if share is not None else ""))
        table.add_row(*row)
    return Group(Text(f"latest probe (iteration {probe.step}): gradient norm (signed share)", style="bold"), table)


ROWS: tuple[str, ...] = (
    "grad norm",
    "log bar",
    "state",
    "NaN latch",
    "Inf latch",
    "noise scale",
    "entropy norm",
    "collapse",
)
_OPTIONAL_ROWS = {
    "noise scale": mn.HEAD_NOISE_SCALE,
    "entropy norm": mn.HEAD_ENTROPY_NORM,
    "collapse": mn.HEAD_COLLAPSE_LATCH,
}
"""Rows shown only when some column has the metric."""


def render_panel(snap: RunSnapshot) -> Group:
    """One frame: header, the heads table, the probe footer."""
    table = Table(show_lines=False, header_style="bold cyan")
    table.add_column("", style="bold")
    for head in snap.heads:
        table.add_column(head, justify="center")
    cells = {head: head_cells(snap, head) for head in snap.heads}
    for row in ROWS:
        template = _OPTIONAL_ROWS.get(row)
        if template is not None and all(snap.head_value(template, h) is None for h in snap.heads):
            continue
        table.add_row(row, *(cells[h][row] for h in snap.heads))
    policy = policy_line(snap)
    body = [table] if snap.heads else [Text("no per-head telemetry in this run yet", style="dim")]
    return Group(_header(snap), *body, *([policy] if policy is not None else []), _probe_footer(snap))


def watch(
    client: Any,
    *,
    run_id: str | None = None,
    experiment: str | None = None,
    interval_s: float = 3.0,
    once: bool = False,
    console: Console | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> RunSnapshot:
    """Show the run's panel; refresh every ``interval_s`` until it ends (or once). Returns the last frame."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: no width to fit, so don't truncate 9+ columns
            console = Console(width=max(console.width, NON_TERMINAL_WIDTH))
    run = resolve_run(client, run_id=run_id, experiment=experiment)
    snap = snapshot(client, run)
    if once:
        console.print(render_panel(snap))
        return snap
    with Live(render_panel(snap), console=console, refresh_per_second=4, transient=False) as live:
        while snap.status == "RUNNING" and not should_stop():
            time.sleep(interval_s)
            snap = snapshot(client, resolve_run(client, run_id=snap.run_id))
            live.update(render_panel(snap))
    return snap
