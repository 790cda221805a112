"""``gradmon-ray watch``: a terminal panel following a run in MLflow, one table per module, one
column per head.

Rows (seeds' operator panel): gradient norm with trend arrow, a log-scale mini-bar, the
health state in its band colour (each head judged by its own edges: a value head by the value
edges), the NaN and Inf log-prob latches (○ clear, ● latched, – the head has no such latch, e.g.
the value head), the noise scale when the run has one, and each head's normalised policy entropy
and collapse latch.  Heads in the ``gradmon.head_names`` tag's order, value head last.
Header: iteration, env steps, return; per module its global norm, VGS scale and skipped
updates (in a multi-module run on each module's table title).  Below: the entropy of policy
heads that have no column, the collapsed heads, and the latest probe's bucket x component norms.

Where the full table is wider than the terminal (8 heads at 80 columns), the panel switches to
a compact table: 7-character cells and unique abbreviated head names with a legend below it
(``a_targ… = alpha_target``); heads that still do not fit wrap into a further table.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.blame import blame_line
from gradmon_ray.tracking.diagnosis_tags import diagnoses_from_tag
from gradmon_ray.viz.head_table import (
    BAR_WIDTH,
    LATCH_CLEAR,
    LATCH_NONE,
    LATCH_SET,
    fmt,
    head_cells,
    mini_bar,
    module_facts,
    module_tables,
    wrap_parts,
)
from gradmon_ray.viz.layout import batch_advice, group_heads
from gradmon_ray.viz.runs import RunSnapshot, resolve_run, snapshot

__all__ = [
    "BAR_WIDTH",
    "LATCH_CLEAR",
    "LATCH_NONE",
    "LATCH_SET",
    "head_cells",
    "mini_bar",
    "policy_line",
    "render_panel",
    "watch",
]

NON_TERMINAL_WIDTH = 200
"""Columns of a piped or captured ``watch`` (no terminal width to fit)."""


def policy_line(snap: RunSnapshot, shown: Sequence[str] = ()) -> Text | None:
    """The normalised entropy of every policy head that has no column in the table (``shown``),
    then the collapsed heads (with the iteration each fired); None for a run without policy
    head health."""
    if not snap.policy_heads:
        return None
    others = [h for h in snap.policy_heads if h not in set(shown)]
    values = [f"{h} {fmt(snap.head_value(mn.HEAD_ENTROPY_NORM, h))}" for h in others]
    collapsed = [h for h in snap.policy_heads if (snap.head_value(mn.HEAD_COLLAPSE_LATCH, h) or 0.0) > 0]
    text = Text("policy entropy (entropy / log actions): " + ", ".join(values) + "  ·  " if values else "")
    text.append("collapsed: ")
    if not collapsed:
        return text.append("none", style="green")
    fired = [(h, snap.head_value(mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION, h)) for h in collapsed]
    return text.append(
        ", ".join(f"{h} (iteration {int(it)})" if it is not None and math.isfinite(it) else h for h, it in fired),
        style="bold red",
    )


def _status(snap: RunSnapshot) -> str:
    mlflow_status = snap.status.lower()
    ours = snap.tags.get(mn.TAG_STATUS)
    return mlflow_status if ours in (None, mlflow_status) else f"{mlflow_status}, {ours}"


def _header(snap: RunSnapshot, modules: Sequence[str | None], width: int | None = None) -> Text:
    m = snap.metrics
    steps = m.get(mn.ENV_STEPS_SAMPLED_LIFETIME)
    parts = [
        f"run {snap.run_name} ({_status(snap)})",
        f"iteration {snap.iteration if snap.iteration is not None else '—'}",
        f"env steps {int(steps) if steps is not None and math.isfinite(steps) else '—'}",
        f"return {fmt(m.get(mn.EPISODE_RETURN_MEAN))}",
    ]
    if list(modules) in ([], [None]):  # one module: its numbers here; several: on each module's table
        parts += module_facts(snap, None)
    text = Text(wrap_parts(parts, width), style="bold")
    reason = snap.tags.get(mn.TAG_STOP_REASON)
    if reason:
        text.append(f"\nstopped: {reason}", style="bold red")
    skipped = snap.tags.get(mn.TAG_SKIPPED)
    if skipped:
        text.append(f"\nlast skip: {skipped}", style="bold yellow")
    for module in modules:
        advice = batch_advice(snap.module_value(mn.GLOBAL_NOISE_SCALE, module), snap.params)
        if advice:
            text.append(f"\n{f'module {module}: ' if module else ''}{advice}", style="bold")
    for diagnosis in diagnoses_from_tag(snap.tags.get(mn.TAG_DIAGNOSIS)):
        text.append(f"\nlast diagnosis (iteration {diagnosis.iteration}): {blame_line(diagnosis)}", style="bold red")
    return text


def _probe_footer(snap: RunSnapshot) -> Group | Text:
    """The latest probe's bucket x component table; one per module in a multi-module run, titled by it."""
    probe = snap.probe
    if not probe.norms:
        return Text("probe: no probe results in this run", style="dim")
    parts: list[Text | Table] = []
    for module in probe.modules:
        components = probe.module_components(module)
        table = Table()
        table.add_column("bucket")
        for component in components:
            table.add_column(component, justify="right")
        for bucket in probe.module_buckets(module):
            row = [bucket]
            for component in components:
                norm, share = probe.cell(module, bucket, component)
                row.append(f"{fmt(norm, '.3g')}" + (f" ({share:+.0%})" if share is not None else ""))
            table.add_row(*row)
        title = f"latest probe ({probe.label(module)}): gradient norm (signed share)"
        parts += [Text(title, style="bold"), table]
    return Group(*parts)


def render_panel(snap: RunSnapshot, width: int | None = None) -> Group:
    """One frame: header, the heads tables, the policy heads line, the probe footer.  ``width``:
    the terminal's columns; tables wider than that become compact (None: never)."""
    modules = [m for m, _ in group_heads(snap.heads)]
    body = module_tables(snap, width) if snap.heads else [Text("no per-head telemetry in this run yet", style="dim")]
    policy = policy_line(snap, [*snap.heads, *(snap.latch_head(h) for h in snap.heads)])  # not shown twice
    return Group(_header(snap, modules, width), *body, *([policy] if policy is not None else []), _probe_footer(snap))


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
        console.print(render_panel(snap, console.width))
        return snap
    with Live(render_panel(snap, console.width), console=console, refresh_per_second=4, transient=False) as live:
        while snap.status == "RUNNING" and not should_stop():
            time.sleep(interval_s)
            snap = snapshot(client, resolve_run(client, run_id=snap.run_id))
            live.update(render_panel(snap, console.width))
    return snap
