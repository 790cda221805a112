"""The heads tables of ``gradmon-ray watch``: one per module, a column per head, a row per measurement.

Each head is judged by its own edges (``RunSnapshot.bands.for_head``: a value head by the value
edges); a latch the head does not have (nothing logged, e.g. the value head's) shows ``–``.  Where
the full table is wider than the terminal, a compact table with 7-character cells and unique
abbreviated head names (legend below) takes its place, wrapped into further tables as needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich import box
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from gradmon_ray import metric_names as mn
from gradmon_ray.viz.layout import abbreviate, group_heads, legend, short_head
from gradmon_ray.viz.runs import RunSnapshot, head_band

ENTROPY_LOW = 0.2
"""Normalised entropy shown in red below this (a head close to collapse)."""

BAND_STYLES: dict[str, str] = {
    "dead": "bold white on red",
    "weak": "yellow",
    "healthy": "green",
    "elevated": "dark_orange",
    "exploding": "bold white on red",
    "spiking": "bold red",
    "missing": "dim",
}
"""Rich style of each health band (dead and exploding are the two alarms; spiking: one minibatch was)."""

BAR_WIDTH = 10
BAR_LOG10_RANGE = (-4.0, 2.0)
"""The mini-bar spans 1e-4 .. 1e2 on a log scale: dead heads get a sliver, exploding ones a full bar."""

TREND_ARROWS: dict[int, str] = {code: arrow for arrow, code in mn.TREND_CODES.items()}
LATCH_CLEAR, LATCH_SET, LATCH_NONE = "○", "●", "–"
"""A latch cell: clear, latched, or the head has no such latch (nothing logged for it, e.g. the value head)."""

COMPACT_CELL = 7
"""Characters per head column in the compact table: ``0.354↗``, ``healthy``, ``a_speed``."""
COMPACT_STATES: dict[str, str] = {"elevated": "elev.", "exploding": "explod.", "spiking": "spike"}
"""Band names longer than ``COMPACT_CELL``, as the compact table writes them."""
COMPACT_LABELS: dict[str, str] = {
    "grad norm": "norm",
    "max norm": "max",
    "log bar": "bar",
    "NaN latch": "NaN",
    "Inf latch": "Inf",
    "noise scale": "noise",
    "entropy norm": "entropy",
}
"""Row labels of the compact table (the rest keep their name): the label column is 8 wide."""


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


def fmt(value: float | None, spec: str = ".3f") -> str:
    """``value`` in ``spec``; ``—`` for None, ``nan`` for NaN."""
    if value is None:
        return "—"
    if math.isnan(value):
        return "nan"
    return format(value, spec)


def short_number(value: float | None) -> str:
    """At most 5 characters: ``0.354``, ``12.35``, ``123.4``, ``5e-03``, ``2e+04``; ``—`` for None."""
    if value is None:
        return "—"
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    size = abs(value)
    if size == 0:
        return "0"
    if size < 0.01 or size >= 999.95:  # the thresholds are where rounding would add a digit
        return format(value, ".0e")
    return format(value, ".3f" if size < 9.9995 else ".2f" if size < 99.995 else ".1f")


def trend_arrow_of(trend: float | None) -> str:
    """The arrow of a logged trend by its sign: exactly -1/0/+1 for one telemetry step, RLlib's mean
    of several steps' codes where an iteration holds several (the IMPALA family, docs/metrics.md);
    blank when not logged."""
    if trend is None or not math.isfinite(trend):
        return " "
    return TREND_ARROWS[int(math.copysign(1, trend)) if trend else 0]


def _latch(value: float | None) -> Text:
    if value is None:
        return Text(LATCH_NONE, style="dim")
    return Text(LATCH_SET, style="bold red") if value > 0 else Text(LATCH_CLEAR, style="dim")


_UPDATE_BAND_STYLES = {-1.0: "yellow", 0.0: "", 1.0: "bold red"}
"""The update ratio's cell by its band (``telemetry.bands.update_ratio``): below it, inside, above."""


def _update_ratio(snap: RunSnapshot, head: str, compact: bool) -> Text:
    ratio, band = snap.head_value(mn.HEAD_UPDATE_RATIO, head), snap.head_value(mn.HEAD_UPDATE_BAND, head)
    return Text(short_number(ratio) if compact else fmt(ratio, ".2g"), style=_UPDATE_BAND_STYLES.get(band, ""))


def head_cells(snap: RunSnapshot, head: str, *, compact: bool = False) -> dict[str, Text]:
    """The panel's cells for one head, keyed by row name (``ROWS``); ``compact``: at most
    ``COMPACT_CELL`` characters each."""
    norm = snap.head_value(mn.HEAD_GRAD_NORM, head)
    trend = snap.head_value(mn.HEAD_GRAD_TREND, head)
    band = head_band(snap.head_value(mn.HEAD_GRAD_HEALTH, head), norm, head, snap.bands)
    arrow = trend_arrow_of(trend)
    noise = snap.head_value(mn.HEAD_NOISE_SCALE, head)
    latch = snap.latch_head(head)  # its own latches, or its module's ``policy`` latch
    entropy_norm = snap.head_value(mn.HEAD_ENTROPY_NORM, latch)
    low = entropy_norm is not None and entropy_norm < ENTROPY_LOW
    number = (short_number(norm) + arrow).rstrip() if compact else f"{fmt(norm)} {arrow}"
    peak, at = snap.head_value(mn.HEAD_GRAD_NORM_MAX, head), snap.head_value(mn.HEAD_GRAD_NORM_ARGMAX, head)
    peak_text = short_number(peak) if compact or at is None or math.isnan(at) else f"{fmt(peak)} @{int(at)}"
    return {
        "grad norm": Text(number),
        "max norm": Text(peak_text, style=BAND_STYLES["spiking"] if band == "spiking" else ""),
        "log bar": Text(mini_bar(norm, COMPACT_CELL if compact else BAR_WIDTH), style=BAND_STYLES[band]),
        "state": Text(COMPACT_STATES.get(band, band) if compact else band, style=BAND_STYLES[band]),
        "NaN latch": _latch(snap.head_value(mn.HEAD_NAN_LATCH, latch)),
        "Inf latch": _latch(snap.head_value(mn.HEAD_INF_LATCH, latch)),
        "noise scale": Text(short_number(noise) if compact else fmt(noise, ".3g")),
        "update ratio": _update_ratio(snap, head, compact),
        "entropy norm": Text(fmt(entropy_norm), style="bold red" if low else ""),
        "collapse": _latch(snap.head_value(mn.HEAD_COLLAPSE_LATCH, latch)),
    }


def module_facts(snap: RunSnapshot, module: str | None) -> list[str]:
    """One module's numbers for the header: global gradient norm, VGS scale, skipped updates
    (``—`` where the run logged none)."""
    skipped = snap.module_value(mn.SKIPPED_UPDATES_TOTAL, module)
    return [
        f"global norm {fmt(snap.module_value(mn.GLOBAL_GRAD_NORM, module))}",
        f"VGS scale {fmt(snap.module_value(mn.VGS_SCALING_FACTOR, module), '.4g')}",
        f"skipped updates {int(skipped) if skipped is not None and math.isfinite(skipped) else '—'}",
    ]


def wrap_parts(parts: Sequence[str], width: int | None, sep: str = "  ·  ") -> str:
    """``parts`` joined by ``sep``, broken into lines of at most ``width`` between parts (never
    inside one); one line for ``width`` None."""
    lines: list[str] = []
    for part in parts:
        if lines and (width is None or len(lines[-1]) + len(sep) + len(part) <= width):
            lines[-1] += sep + part
        else:
            lines.append(part)
    return "\n".join(lines)


ROWS: tuple[str, ...] = (
    "grad norm",
    "max norm",
    "log bar",
    "state",
    "NaN latch",
    "Inf latch",
    "noise scale",
    "update ratio",
    "entropy norm",
    "collapse",
)
_OPTIONAL_ROWS = {
    "max norm": mn.HEAD_GRAD_NORM_MAX,
    "noise scale": mn.HEAD_NOISE_SCALE,
    "update ratio": mn.HEAD_UPDATE_RATIO,
    "entropy norm": mn.HEAD_ENTROPY_NORM,
    "collapse": mn.HEAD_COLLAPSE_LATCH,
}
"""Rows shown only when some column has the metric."""


def table_rows(snap: RunSnapshot, heads: Sequence[str]) -> list[str]:
    """``ROWS`` without the optional rows that none of ``heads`` has."""
    return [
        row
        for row in ROWS
        if (template := _OPTIONAL_ROWS.get(row)) is None
        or any(snap.head_value(template, snap.latch_head(h)) is not None for h in heads)
    ]


def heads_table(
    snap: RunSnapshot,
    heads: Sequence[str],
    names: dict[str, str],
    *,
    compact: bool,
    title: str | None = None,
    rows: Sequence[str] | None = None,
) -> Table:
    """One table: a column per head (headed ``names[head]``), a row per ``rows`` entry (default:
    ``table_rows``)."""
    if compact:  # no borders or padding, one blank divider between columns: 9 heads fit in 80
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=0, header_style="bold cyan")
        table.add_column("", style="bold", min_width=8, no_wrap=True)
    else:
        table = Table(show_lines=False, header_style="bold cyan")
        table.add_column("", style="bold")
    if title is not None:
        table.title, table.title_justify, table.title_style = title, "left", "bold"
    width = {"min_width": COMPACT_CELL, "max_width": COMPACT_CELL, "no_wrap": True} if compact else {}
    for head in heads:
        table.add_column(names[head], justify="center", **width)
    cells = {head: head_cells(snap, head, compact=compact) for head in heads}
    for row in rows if rows is not None else table_rows(snap, heads):
        table.add_row(COMPACT_LABELS.get(row, row) if compact else row, *(cells[h][row] for h in heads))
    return table


def _fits(table: Table, width: int) -> bool:
    return Console(width=10_000).measure(table).maximum <= width


def module_tables(snap: RunSnapshot, width: int | None = None) -> list[RenderableType]:
    """The heads tables, module by module (each titled with its module and that module's global
    norm, VGS scale and skipped updates when the run has several), wide where they fit in
    ``width`` (None: always), else compact with a legend of the abbreviated head names (once
    when every module's is the same)."""
    groups = group_heads(snap.heads)
    several = len(groups) > 1
    tables: list[list[RenderableType]] = []
    keys: list[str] = []
    for module, heads in groups:
        title = wrap_parts([f"module {module}", *module_facts(snap, module)], width) if several else None
        names = {h: short_head(h) for h in heads}
        wide = heads_table(snap, heads, names, compact=False, title=title)
        if width is None or _fits(wide, width):
            tables.append([wide])
            keys.append("")
            continue
        names = dict(zip(heads, abbreviate([names[h] for h in heads], COMPACT_CELL).values(), strict=True))
        per_table = max(1, (width - 8) // (COMPACT_CELL + 1))  # label column 8, a divider per column
        rows = table_rows(snap, heads)  # the same rows in every chunk
        chunks = [heads[i : i + per_table] for i in range(0, len(heads), per_table)]
        first = [title] + [None] * (len(chunks) - 1)  # the module's title above its first table only
        tables.append(
            [heads_table(snap, c, names, compact=True, title=t, rows=rows) for c, t in zip(chunks, first, strict=True)]
        )
        keys.append(legend({short_head(h): names[h] for h in heads}))
    once = len(set(keys)) == 1
    out: list[RenderableType] = []
    for module_tables_, key in zip(tables, keys, strict=True):
        out += module_tables_
        if key and not once:
            out.append(Text(f"heads: {key}", style="dim"))
    if once and keys[0]:
        out.append(Text(f"heads: {keys[0]}", style="dim"))
    return out
