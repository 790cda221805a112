"""Plots of a run's gradient health, as PNG files (MLflow artifacts and ``gradmon-ray report``).

Built on ``matplotlib.figure.Figure`` with the Agg canvas, never ``pyplot``: pyplot keeps
global state and a GUI backend, and these figures are drawn on the MLflow sink's
background thread.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.bands import DEAD_BELOW, ELEVATED_MAX, HEALTHY_MAX, WEAK_BELOW
from gradmon_ray.viz.runs import ProbeView, RunHistory

HEATMAP_FILE = "head_grad_norm_heatmap.png"
LINES_FILE = "head_grad_norm_lines.png"
PROBE_FILE = "probe_components.png"
ENTROPY_FILE = "head_entropy_norm.png"

BAND_EDGES: tuple[float, ...] = (DEAD_BELOW, WEAK_BELOW, HEALTHY_MAX, ELEVATED_MAX)
"""dead | weak | healthy | elevated | exploding (``classify_grad_norm``)."""
BAND_SHADES: tuple[tuple[str, float, float, str], ...] = (
    ("dead", 0.0, DEAD_BELOW, "#d62728"),
    ("weak", DEAD_BELOW, WEAK_BELOW, "#ffbf00"),
    ("healthy", WEAK_BELOW, HEALTHY_MAX, "#2ca02c"),
    ("elevated", HEALTHY_MAX, ELEVATED_MAX, "#ff7f0e"),
    ("exploding", ELEVATED_MAX, math.inf, "#d62728"),
)
_FLOOR = 1e-6  # a zero norm drawn on a log scale


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
    """Per-head norm heatmap: heads x iterations, log colour scale, band edges as contours."""
    heads, steps, matrix = norm_matrix(history)
    figure = _new_figure(max(6.0, min(16.0, 0.25 * len(steps) + 4)), max(3.0, 0.45 * len(heads) + 1.5))
    ax = figure.add_subplot()
    shown = np.where(np.isfinite(matrix), np.clip(matrix, _FLOOR, None), np.nan)
    finite = shown[np.isfinite(shown)]
    vmax = max(float(finite.max()) if finite.size else 10.0, ELEVATED_MAX * 2)
    image = ax.imshow(
        np.ma.masked_invalid(shown),
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        norm=LogNorm(vmin=min(DEAD_BELOW / 10, float(finite.min()) if finite.size else 1.0), vmax=vmax),
    )
    # Band-edge contours row by row: interpolating *between* heads would draw edges that no head crossed.
    levels = np.log10(BAND_EDGES)
    for i in range(len(heads)):
        row = shown[i]
        ok = np.isfinite(row)
        if ok.sum() < 2:
            continue
        xs = np.arange(len(steps))[ok]
        z = np.log10(np.vstack([row[ok], row[ok]]))
        if z.min() < levels.max() and z.max() > levels.min():
            ax.contour(
                xs, [i - 0.5, i + 0.5], z, levels=levels, colors="white", linewidths=1.2, negative_linestyles="solid"
            )
    ax.set_yticks(range(len(heads)), heads)
    ticks = np.linspace(0, len(steps) - 1, num=min(len(steps), 10), dtype=int) if steps else []
    ax.set_xticks(list(ticks), [str(steps[t]) for t in ticks])
    ax.set_xlabel("training iteration")
    ax.set_title(
        "gradient L2 norm per head (before clipping)\nwhite lines: health-band edges 0.01 / 0.1 / 2 / 5", fontsize=10
    )
    figure.colorbar(image, ax=ax, label="gradient norm (log)")
    return figure


def lines_figure(history: RunHistory) -> Figure:
    """One line per head over iterations on a log axis, health bands shaded behind."""
    figure = _new_figure(10.0, 5.0)
    ax = figure.add_subplot()
    drawn = [DEAD_BELOW / 2, ELEVATED_MAX * 2]  # the y range always shows every band edge
    for head in history.heads:
        series = history.series.get(mn.head_metric(mn.HEAD_GRAD_NORM, head), {})
        steps = sorted(series)
        values = [max(series[s], _FLOOR) if math.isfinite(series[s]) else np.nan for s in steps]
        ax.plot(steps, values, marker=".", label=head, linestyle="--" if head == "value" else "-")
        drawn += [v for v in values if math.isfinite(v)]
    ax.set_yscale("log")
    bottom, top = min(drawn) / 2, max(drawn) * 2
    ax.set_ylim(bottom, top)
    for _name, low, high, colour in BAND_SHADES:
        ax.axhspan(max(low, bottom), min(high, top), color=colour, alpha=0.08, linewidth=0)
    for edge in BAND_EDGES:
        ax.axhline(edge, color="grey", linewidth=0.6, linestyle="--")
    ax.set_xlabel("training iteration")
    ax.set_ylabel("gradient L2 norm")
    ax.set_title("per-head gradient norm; shading: dead, weak, healthy, elevated, exploding")
    if history.heads:
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return figure


def entropy_figure(history: RunHistory) -> Figure:
    """Each policy head's normalised entropy (entropy / log actions) over iterations; a red x where
    its collapse latch fired."""
    figure = _new_figure(10.0, 4.0)
    ax = figure.add_subplot()
    for head in history.policy_heads:
        series = history.series.get(mn.head_metric(mn.HEAD_ENTROPY_NORM, head), {})
        steps = sorted(series)
        (line,) = ax.plot(steps, [series[s] for s in steps], marker=".", label=head)
        latch = history.series.get(mn.head_metric(mn.HEAD_COLLAPSE_LATCH, head), {})
        fired = min((s for s, v in latch.items() if v > 0), default=None)
        if fired is not None:
            ax.plot([fired], [series.get(fired, 0.0)], marker="x", markersize=10, color="#d62728", linestyle="")
            ax.annotate(f"{head} collapsed", (fired, series.get(fired, 0.0)), fontsize=7, color=line.get_color())
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("training iteration")
    ax.set_ylabel("entropy / log(actions)")
    ax.set_title("policy entropy per head (1 uniform, 0 one action); x: collapse latch fired")
    if history.policy_heads:
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return figure


def probe_bars_figure(probe: ProbeView) -> Figure:
    """Bucket x component gradient norms of the latest probe, shares written on the bars."""
    figure = _new_figure(10.0, 5.0)
    ax = figure.add_subplot()
    buckets, components = probe.buckets, probe.components
    width = 0.8 / max(len(components), 1)
    for k, component in enumerate(components):
        xs = np.arange(len(buckets)) + (k - (len(components) - 1) / 2) * width
        heights = [probe.norms[b].get(component, np.nan) for b in buckets]
        bars = ax.bar(xs, heights, width, label=component)
        shares = [probe.shares.get(b, {}).get(component) for b in buckets]
        labels = [f"{s:+.0%}" if s is not None and math.isfinite(s) else "" for s in shares]
        ax.bar_label(bars, labels=labels, fontsize=7, padding=1)
    ax.set_xticks(range(len(buckets)), buckets)
    ax.set_xlabel("bucket (ascending group reward std)")
    ax.set_ylabel("gradient L2 norm")
    ax.set_title(f"gradient probe, iteration {probe.step}: component norms (signed share on the bars)")
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
