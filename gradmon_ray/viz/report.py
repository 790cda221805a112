"""``gradmon-ray report RUN_ID``: the run's plots plus a short Markdown summary, for offline reading.

``log_plots`` is the same drawing for a live run: the MLflow sink calls it (as its ``plot_fn``,
handed in by ``train.py`` or the user: tracking never imports viz) on its background thread
every ``mlflow.plots_every`` iterations and at the end of the run.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.bands import worst_head
from gradmon_ray.telemetry.blame import Diagnosis, blame_line
from gradmon_ray.tracking.diagnosis_tags import load_diagnoses
from gradmon_ray.viz.layout import band_edges_text, batch_advice, group_heads, short_head
from gradmon_ray.viz.plots import write_plots
from gradmon_ray.viz.probe_view import ProbeView
from gradmon_ray.viz.runs import RunHistory, head_band, latest_probe, load_history

SUMMARY_FILE = "summary.md"
PLOTS_ARTIFACT_DIR = "plots"
"""Where the sink puts the PNGs inside the run's artifacts."""


@dataclass
class HeadSummary:
    """One head over the whole run."""

    head: str
    last: float
    band: str
    low: float
    high: float
    dead_iterations: int
    exploding_iterations: int
    spiking_iterations: int
    """Iterations whose mean was calm but one minibatch's norm was in the exploding band."""
    nan_first: int | None
    inf_first: int | None


def _first_latched(series: dict[int, float]) -> int | None:
    return min((step for step, value in series.items() if value > 0), default=None)


def head_summaries(history: RunHistory, heads: list[str] | None = None) -> list[HeadSummary]:
    """Per-head summary of ``heads`` (default: all), worst head first (``worst_head``'s ordering
    applied repeatedly), each judged by its own edges (``history.bands``: a value head by the value edges)."""
    rows: dict[str, HeadSummary] = {}
    for head in history.heads if heads is None else heads:
        series = history.series.get(mn.head_metric(mn.HEAD_GRAD_NORM, head), {})
        if not series:
            continue
        values = [series[s] for s in sorted(series)]
        finite = [v for v in values if not math.isnan(v)]
        codes = history.series.get(mn.head_metric(mn.HEAD_GRAD_HEALTH, head), {})
        bands = [head_band(codes.get(s), series[s], head, history.bands) for s in sorted(series)]
        latch = history.latch_head(head)  # its own latches, or its module's ``policy`` latch
        rows[head] = HeadSummary(
            head=head,
            last=values[-1],
            band=bands[-1],
            low=min(finite) if finite else math.nan,
            high=max(finite) if finite else math.nan,
            dead_iterations=bands.count("dead"),
            exploding_iterations=bands.count("exploding"),
            spiking_iterations=bands.count("spiking"),
            nan_first=_first_latched(history.series.get(mn.head_metric(mn.HEAD_NAN_LATCH, latch), {})),
            inf_first=_first_latched(history.series.get(mn.head_metric(mn.HEAD_INF_LATCH, latch), {})),
        )
    ordered = []
    remaining = {h: r.last for h, r in rows.items()}
    while remaining:
        head, _ = worst_head(remaining, bands=history.bands)  # a value head by its own edges
        ordered.append(rows[head])
        del remaining[head]
    return ordered


def _range(series: dict[int, float]) -> tuple[float, float] | None:
    values = [v for v in series.values() if math.isfinite(v)]
    return (min(values), max(values)) if values else None


def summary_markdown(
    history: RunHistory, probe: ProbeView, run_name: str = "", diagnoses: Sequence[Diagnosis] = ()
) -> str:
    """The report's Markdown: worst heads, latches, non-finite events, VGS scale range, noise scale,
    latest probe."""
    steps = history.head_steps()
    lines = [f"# gradmon-ray report: {run_name or history.run_id}", ""]
    lines.append(f"- run id: `{history.run_id}`")
    lines.append(f"- iterations with telemetry: {len(steps)}" + (f" ({steps[0]}..{steps[-1]})" if steps else ""))
    lines.append(f"- status: {history.tags.get(mn.TAG_STATUS, 'unknown')}")
    if reason := history.tags.get(mn.TAG_STOP_REASON):
        lines.append(f"- stopped by a health rule: {reason}")
    groups = group_heads(history.heads)
    several = len(groups) > 1
    lines += ["", "## Heads, worst first", ""]
    values = [short_head(h) for h in history.heads if history.bands.is_value_head(h)]
    lines.append(
        f"Bands: action heads {band_edges_text(history.bands.action)}, value heads "
        f"({', '.join(dict.fromkeys(values)) or 'none'}) {band_edges_text(history.bands.value)} (dead | weak | "
        "healthy | elevated | exploding)."
    )
    summaries: list[HeadSummary] = []
    for module, heads in groups:
        rows = head_summaries(history, heads)
        summaries += rows
        lines += ["", *([f"### module {module}", ""] if several else []), *_head_table(rows)]
    latched = [r for r in summaries if r.nan_first is not None or r.inf_first is not None]
    lines += ["", "## Latched heads", ""]
    if latched:
        for r in latched:
            kinds = [f"NaN from iteration {r.nan_first}"] if r.nan_first is not None else []
            kinds += [f"Inf from iteration {r.inf_first}"] if r.inf_first is not None else []
            lines.append(f"- {r.head}: " + ", ".join(kinds))
    else:
        lines.append("None: no head's log-probs were ever NaN or Inf.")
    lines += ["", "## Non-finite events (docs/diagnosis.md)", ""]
    lines += [f"- iteration {d.iteration}: {blame_line(d)}" for d in diagnoses] or ["None."]
    lines += ["", "## Policy heads: entropy and collapse", ""]
    lines += _policy_lines(history)
    lines += ["", "## VGS, noise scale, global norm, skipped updates", ""]
    for module in [m for m, _ in groups] or [None]:
        lines += [f"### module {module}", ""] if several else []
        lines += [*_module_lines(history, module), *([""] if several else [])]
    lines += ["", "## Latest gradient probe", ""]
    for module in probe.modules:
        lines += [f"### module {module}", ""] if module is not None else []
        lines += [*_probe_table(probe, module), ""]
    if not probe.norms:
        lines.append("No probe ran (probe.gradient_analysis_every: 0).")
    return "\n".join(lines).rstrip("\n") + "\n"


def _probe_table(probe: ProbeView, module: str | None) -> list[str]:
    """One module's latest probe: the iteration, then bucket x component norms (signed share)."""
    components = probe.module_components(module)
    step = probe.steps.get(module, probe.step)
    lines = [f"Iteration {step}; gradient norm per bucket and component (signed share):", ""]
    lines.append("| bucket | " + " | ".join(components) + " |")
    lines.append("|---|" + "---:|" * len(components))
    for bucket in probe.module_buckets(module):
        cells = []
        for component in components:
            norm, share = probe.cell(module, bucket, component)
            norm = math.nan if norm is None else norm
            cells.append(f"{norm:.4g}" + (f" ({share:+.0%})" if share is not None else ""))
        lines.append(f"| {bucket} | " + " | ".join(cells) + " |")
    return lines


def _head_table(rows: list[HeadSummary]) -> list[str]:
    """The heads table (head names without their module: the section names it)."""
    lines = [
        "| head | last norm | band | min | max | dead iters | exploding iters | spiking iters "
        "| NaN latch | Inf latch |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        nan = f"iteration {r.nan_first}" if r.nan_first is not None else "—"
        inf = f"iteration {r.inf_first}" if r.inf_first is not None else "—"
        lines.append(
            f"| {short_head(r.head)} | {_num(r.last)} | {r.band} | {_num(r.low)} | {_num(r.high)} "
            f"| {r.dead_iterations} | {r.exploding_iterations} | {r.spiking_iterations} | {nan} | {inf} |"
        )
    return lines


def _module_lines(history: RunHistory, module: str | None) -> list[str]:
    """One module's VGS scale range, gradient noise scale, global norm and skipped updates."""
    lines = []
    vgs = _range(history.module_series(mn.VGS_SCALING_FACTOR, module))
    lines.append(f"- VGS scaling factor: {vgs[0]:.4g} .. {vgs[1]:.4g}" if vgs else "- VGS: not enabled in this run")
    noise_series = history.module_series(mn.GLOBAL_NOISE_SCALE, module)
    noise = [noise_series[s] for s in sorted(noise_series) if math.isfinite(noise_series[s])]
    if noise:
        lines.append(f"- gradient noise scale (global): median {statistics.median(noise):.4g}, last {noise[-1]:.4g}")
        lines.append(f"- batch size: {batch_advice(statistics.median(noise), history.params)} (from the median)")
    else:
        lines.append("- gradient noise scale: not measured (distributed.noise_scale* off, or not defined yet)")
    norm = history.module_series(mn.GLOBAL_GRAD_NORM, module)
    if norm:
        low, high = _range(norm) or (math.nan, math.nan)
        lines.append(f"- global gradient norm: last {norm[max(norm)]:.4g}, min {low:.4g}, max {high:.4g}")
    ratio = history.module_series(mn.UPDATE_RATIO, module)
    if ratio:
        lines.append(f"- update-to-weight ratio (all weights, per iteration): last {ratio[max(ratio)]:.3g}")
    cosine = history.module_series(mn.SHARED_GRAD_COSINE_MIN, module)
    if cosine:
        last = cosine[max(cosine)]
        lines.append(f"- shared parameters: lowest cosine with another module's gradient {last:+.2f} (last)")
    lines.append(_skipped_line(history.module_series(mn.SKIPPED_UPDATES_TOTAL, module)))
    return lines


def _skipped_line(series: dict[int, float]) -> str:
    """The module's skipped-update total: its last count (NaN where RLlib had no number: the module
    got no samples that iteration, e.g. a league module not playing)."""
    if not series:
        return "- skipped updates: not logged"
    counts = [series[s] for s in sorted(series) if math.isfinite(series[s])]
    if not counts:
        return "- skipped updates: — (no samples)"
    note = "" if math.isfinite(series[max(series)]) else " (no samples at the last iteration)"
    return f"- skipped updates: {int(counts[-1])}{note}"


def _num(value: float) -> str:
    """A table number; "—" where there is none (NaN: a head without a gradient, a module without samples)."""
    return f"{value:.4g}" if math.isfinite(value) or math.isinf(value) else "—"


def _policy_lines(history: RunHistory) -> list[str]:
    """Per policy head: last and lowest normalised entropy, and the iteration its collapse latch fired."""
    if not history.policy_heads:
        return ["Not measured in this run (telemetry off, or an action distribution that is not categorical per head)."]
    lines = ["| head | last entropy / log actions | lowest | collapse latch |", "|---|---:|---:|---|"]
    for head in history.policy_heads:
        series = history.series.get(mn.head_metric(mn.HEAD_ENTROPY_NORM, head), {})
        values = [series[s] for s in sorted(series) if math.isfinite(series[s])]
        fired = _first_latched(history.series.get(mn.head_metric(mn.HEAD_COLLAPSE_LATCH, head), {}))
        last, low = (f"{values[-1]:.3f}", f"{min(values):.3f}") if values else ("—", "—")
        lines.append(f"| {head} | {last} | {low} | {f'iteration {fired}' if fired is not None else '—'} |")
    return lines


def write_report(client: Any, run_id: str, out_dir: str | Path) -> list[Path]:
    """Plots and ``summary.md`` for ``run_id`` in ``out_dir``; returns the files written."""
    history = load_history(client, run_id)
    probe = latest_probe(client, run_id, history.latest)
    out = Path(out_dir)
    files = write_plots(history, probe, out)
    run_name = history.tags.get("mlflow.runName", "")
    diagnoses = load_diagnoses(client, run_id)
    (out / SUMMARY_FILE).write_text(summary_markdown(history, probe, run_name, diagnoses))
    return [*files, out / SUMMARY_FILE]


def log_plots(client: Any, run_id: str) -> list[str]:
    """Draw the run's plots from what MLflow holds and log them as artifacts under ``plots/``."""
    history = load_history(client, run_id)
    probe = latest_probe(client, run_id, history.latest)
    if not history.head_steps() and not probe.norms:
        return []  # nothing to draw yet
    with tempfile.TemporaryDirectory(prefix="gradmon-plots-") as directory:
        files = write_plots(history, probe, directory)
        client.log_artifacts(run_id, directory, artifact_path=PLOTS_ARTIFACT_DIR)
    return [f"{PLOTS_ARTIFACT_DIR}/{f.name}" for f in files]
