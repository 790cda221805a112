"""Plots of a run's gradient health, as PNG files (MLflow artifacts and ``gradmon-ray report``).

Every head is drawn against its own band edges (``RunHistory.bands.for_head``, a value head, the
run's ``gradmon.value_heads`` included, by the value edges): the lines plot puts each module's
action heads and its value heads on separate axes, each shaded with its own
bands; the heatmap draws each row's own edges.  A multi-module run gets one row of axes per
module (heatmap rows labelled ``<module>/<head>``, modules set apart by a black line).

Built on ``matplotlib.figure.Figure`` with the Agg canvas, never ``pyplot``: pyplot keeps
global state and a GUI backend, and these figures are drawn on the MLflow sink's
background thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.bands import HealthBands
from gradmon_ray.viz.layout import band_edges_text, group_heads, short_head
from gradmon_ray.viz.probe_view import ProbeView
from gradmon_ray.viz.runs import RunHistory

HEATMAP_FILE = "head_grad_norm_heatmap.png"
LINES_FILE = "head_grad_norm_lines.png"
PROBE_FILE = "probe_components.png"
ENTROPY_FILE = "head_entropy_norm.png"

BAND_COLOURS: dict[str, str] = {
    "dead": "#d62728",
    "weak": "#ffbf00",
    "healthy": "#2ca02c",
    "elevated": "#ff7f0e",
    "exploding": "#d62728",
}
"""Shading of each health band in the lines plot (dead and exploding are the two alarms)."""
BAND_ALPHA = 0.12
"""Opacity of the band shading over the white axes."""
MISSING_COLOUR = "#d9d9d9"
"""Heatmap cells where a head logged nothing (white is taken by the band-edge lines)."""
_FLOOR = 1e-6  # a zero norm drawn on a log scale


def band_shades(bands: HealthBands) -> list[tuple[str, float, float]]:
    """``(band, low, high)`` for the five bands of ``bands``, dead to exploding."""
    dead, weak, healthy, elevated = bands.edges
    return [
        ("dead", 0.0, dead),
        ("weak", dead, weak),
        ("healthy", weak, healthy),
        ("elevated", healthy, elevated),
        ("exploding", elevated, math.inf),
    ]


def norm_matrix(history: RunHistory) -> tuple[list[str], list[int], np.ndarray]:
    """Heads x iterations matrix of gradient norms (NaN where a head logged nothing)."""
    steps = history.head_steps()
    matrix = np.full((len(history.heads), len(steps)), np.nan)
    column = {step: j for j, step in enumerate(steps)}
    for i, head in enumerate(history.heads):
        for step, value in history.series.get(mn.head_metric(mn.HEAD_GRAD_NORM, head), {}).items():
            matrix[i, column[step]] = value
    return list(history.heads), steps, matrix


def _new_figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def heatmap_figure(history: RunHistory) -> Figure:
    """Per-head norm heatmap: heads x iterations, log colour scale, each row's own band edges as
    white contours (a value head's at its value edges)."""
    heads, steps, matrix = norm_matrix(history)
    per_row = 0.45 if len(heads) <= 10 else 0.3  # two modules' 18 rows still fit a browser window
    figure = _new_figure(max(6.0, min(16.0, 0.25 * len(steps) + 4)), max(3.0, per_row * len(heads) + 1.8))
    ax = figure.add_subplot()
    ax.set_facecolor(MISSING_COLOUR)
    shown = np.where(np.isfinite(matrix), np.clip(matrix, _FLOOR, None), np.nan)
    finite = shown[np.isfinite(shown)]
    action = history.bands.action
    vmax = max(float(finite.max()) if finite.size else 10.0, action.elevated_max * 2)
    vmin = min(action.dead_below / 10, float(finite.min()) if finite.size else 1.0)
    image = ax.imshow(
        np.ma.masked_invalid(shown), aspect="auto", interpolation="nearest", cmap="viridis", norm=LogNorm(vmin, vmax)
    )
    # Band-edge contours row by row, at that head's own edges: interpolating *between* heads would
    # draw edges that no head crossed, and one set of edges for all rows misjudges the value head.
    for i, head in enumerate(heads):
        row = shown[i]
        ok = np.isfinite(row)
        levels = np.log10(history.bands.for_head(head).edges)
        if ok.sum() < 2:
            continue
        z = np.log10(np.vstack([row[ok], row[ok]]))
        if z.min() < levels.max() and z.max() > levels.min():
            ax.contour(
                np.arange(len(steps))[ok],
                [i - 0.5, i + 0.5],
                z,
                levels=levels,
                colors="white",
                linewidths=1.2,
                negative_linestyles="solid",
            )
    start = 0
    for _module, members in group_heads(heads)[:-1]:  # a black line between modules
        start += len(members)
        ax.axhline(start - 0.5, color="black", linewidth=2)
    ax.set_yticks(range(len(heads)), heads)
    ticks = range(0, len(steps), max(1, math.ceil(len(steps) / 10)))  # evenly spaced, at most 10
    ax.set_xticks(list(ticks), [str(steps[t]) for t in ticks])
    ax.set_xlabel("training iteration")
    ax.set_title(
        "gradient L2 norm per head (before clipping)\nwhite lines: each head's band edges "
        f"(action heads {band_edges_text(action)},\nvalue heads {band_edges_text(history.bands.value)}); "
        "grey: not logged",
        fontsize=10,
    )
    figure.colorbar(image, ax=ax, label="gradient norm (log)")
    return figure


def _series(history: RunHistory, template: str, head: str) -> tuple[list[int], list[float]]:
    series = history.series.get(mn.head_metric(template, head), {})
    steps = sorted(series)
    return steps, [series[s] for s in steps]


def shaded_norm_axes(ax: Axes, history: RunHistory, heads: Sequence[str], bands: HealthBands, title: str) -> None:
    """``heads``' norms over iterations on ``ax`` (log scale), shaded with ``bands``' five bands
    and their edges dashed; the y range always shows every edge."""
    drawn = [bands.dead_below / 2, bands.elevated_max * 2]
    for head in heads:
        steps, raw = _series(history, mn.HEAD_GRAD_NORM, head)
        values = [max(v, _FLOOR) if math.isfinite(v) else np.nan for v in raw]
        style = "--" if history.bands.is_value_head(head) else "-"
        ax.plot(steps, values, marker=".", label=short_head(head), linestyle=style)
        drawn += [v for v in values if math.isfinite(v)]
    ax.set_yscale("log")
    bottom, top = min(drawn) / 2, max(drawn) * 2
    ax.set_ylim(bottom, top)
    for band, low, high in band_shades(bands):
        ax.axhspan(max(low, bottom), min(high, top), color=BAND_COLOURS[band], alpha=BAND_ALPHA, linewidth=0)
    for edge in bands.edges:
        ax.axhline(edge, color="grey", linewidth=0.6, linestyle="--")
    ax.set_xlabel("training iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("gradient L2 norm")
    ax.set_title(f"{title} (bands {band_edges_text(bands)})", fontsize=10)
    if heads:
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)


def lines_figure(history: RunHistory) -> Figure:
    """Per module, its action heads' norms shaded with the action bands and its value heads'
    shaded with the value bands (``BandSet.is_value_head``: the run's own), side by side; one row
    per module."""
    groups = group_heads(history.heads) or [(None, [])]
    is_value = history.bands.is_value_head
    split = [(m, [h for h in heads if not is_value(h)], [h for h in heads if is_value(h)]) for m, heads in groups]
    with_value = any(value for _, _, value in split)
    figure = _new_figure(13.0 if with_value else 10.0, 0.6 + 3.6 * len(split))
    axes = figure.subplots(len(split), 2 if with_value else 1, squeeze=False, width_ratios=[3, 2][: 1 + with_value])
    for row, (module, action, value) in zip(axes, split, strict=True):
        prefix = f"module {module}: " if module is not None else ""
        shaded_norm_axes(row[0], history, action, history.bands.action, f"{prefix}action heads")
        if with_value:
            shaded_norm_axes(row[1], history, value, history.bands.value, f"{prefix}value head")
    figure.suptitle("per-head gradient L2 norm; shading: dead, weak, healthy, elevated, exploding by the head's edges")
    return figure


def entropy_figure(history: RunHistory) -> Figure:
    """Each policy head's normalised entropy (entropy / log actions) over iterations, one axes per
    module; a red x where its collapse latch fired."""
    groups = group_heads(history.policy_heads) or [(None, [])]
    figure = _new_figure(10.0, 0.4 + 3.6 * len(groups))
    for ax, (module, heads) in zip(figure.subplots(len(groups), 1, squeeze=False)[:, 0], groups, strict=True):
        for head in heads:
            steps, values = _series(history, mn.HEAD_ENTROPY_NORM, head)
            series = dict(zip(steps, values, strict=True))
            (line,) = ax.plot(steps, values, marker=".", label=short_head(head))
            latch = history.series.get(mn.head_metric(mn.HEAD_COLLAPSE_LATCH, head), {})
            fired = min((s for s, v in latch.items() if v > 0), default=None)
            if fired is not None:
                ax.plot([fired], [series.get(fired, 0.0)], marker="x", markersize=10, color="#d62728", linestyle="")
                ax.annotate(
                    f"{short_head(head)} collapsed", (fired, series.get(fired, 0.0)), fontsize=7, color=line.get_color()
                )
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("training iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("entropy / log(actions)")
        prefix = f"module {module}: " if module is not None else ""
        ax.set_title(f"{prefix}policy entropy per head (1 uniform, 0 one action); x: collapse latch fired")
        if heads:
            ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return figure


def probe_bars_figure(probe: ProbeView) -> Figure:
    """Bucket x component gradient norms of the latest probe, shares written on the bars; one row of
    bars per probed module in a multi-module run, titled by the module."""
    modules = probe.modules
    figure = _new_figure(10.0, 5.0 * len(modules))
    for row, module in enumerate(modules, start=1):
        ax = figure.add_subplot(len(modules), 1, row)
        buckets, components = probe.module_buckets(module), probe.module_components(module)
        width = 0.8 / max(len(components), 1)
        for k, component in enumerate(components):
            xs = np.arange(len(buckets)) + (k - (len(components) - 1) / 2) * width
            cells = [probe.cell(module, b, component) for b in buckets]
            bars = ax.bar(xs, [np.nan if n is None else n for n, _ in cells], width, label=component)
            labels = [f"{s:+.0%}" if s is not None and math.isfinite(s) else "" for _, s in cells]
            ax.bar_label(bars, labels=labels, fontsize=7, padding=1)
        ax.set_xticks(range(len(buckets)), buckets)
        ax.set_xlabel("bucket (ascending group reward std)")
        ax.set_ylabel("gradient L2 norm")
        prefix = f"module {module}: " if module is not None else ""
        step = probe.steps.get(module, probe.step)
        ax.set_title(f"{prefix}gradient probe, iteration {step}: component norms (signed share on the bars)")
        ax.legend(fontsize=8)
    return figure


def write_plots(history: RunHistory, probe: ProbeView, directory: str | Path) -> list[Path]:
    """Write the heatmap and line plot (the policy entropy plot when the run has policy head health,
    the probe chart when a probe ran); returns the files."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    figures = {HEATMAP_FILE: heatmap_figure(history), LINES_FILE: lines_figure(history)}
    if any(mn.head_metric(mn.HEAD_ENTROPY_NORM, h) in history.series for h in history.policy_heads):
        figures[ENTROPY_FILE] = entropy_figure(history)
    if probe.norms:
        figures[PROBE_FILE] = probe_bars_figure(probe)
    written = []
    for name, figure in figures.items():
        figure.savefig(out / name)
        written.append(out / name)
    return written
