"""The plots and the report judge each head by its own edges, read back from the PNG itself.

Pixels are read with matplotlib's PNG reader at coordinates computed from each axes' data
transform after the figure was saved; the expected colours are the band's shading blended over
the white axes, and, independently of the palette, which channel dominates (green: healthy, red:
exploding).  Bugs caught: the value head drawn over the action heads' red "exploding" band (the
action edges 2 / 5), the heatmap's value row given edges at 2 and 5, modules mixed in one axes,
the report calling a value head at 8 exploding.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread
from mlflow.tracking import MlflowClient

from gradmon_ray.viz.plots import BAND_ALPHA, BAND_COLOURS, heatmap_figure, lines_figure
from gradmon_ray.viz.probe_view import ProbeView
from gradmon_ray.viz.report import summary_markdown
from gradmon_ray.viz.runs import load_history
from tests.viz.module_runs import log_run

RUNS = {
    "value": ["op", "value"],
    "vf": ["op", "vf"],
    "critic": ["op", "critic"],  # a value head the run declared: its gradmon.value_heads tag says so
    "modules": ["p1/op", "p1/vf", "p2/op", "p2/value"],
}
DECLARED = {"critic": ["critic"], "heatmap_critic": ["critic"]}
"""The runs' ``gradmon.value_heads`` tags (the others declare none: ``value`` and ``vf`` are built in)."""
VALUE_NAMES = ("value", "vf", "critic")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('plots') / 'mlflow.db'}"
    client = MlflowClient(uri)
    runs = {
        name: log_run(client, name, {h: [8.0, 8.0] for h in heads}, value_heads=DECLARED.get(name, ()))
        for name, heads in RUNS.items()
    }
    # log10 norms 0, 0.477, 1.079: crossing 2 at x = log 2 / log 3, 5 and 10 between x = 1 and 2
    runs["heatmap"] = log_run(client, "heatmap", {"op": [1.0, 3.0, 12.0], "value": [1.0, 3.0, 12.0]})
    runs["heatmap_critic"] = log_run(
        client, "heatmap_critic", {"op": [1.0, 3.0, 12.0], "critic": [1.0, 3.0, 12.0]}, value_heads=["critic"]
    )
    runs["heatmap_modules"] = log_run(
        client, "heatmap_modules", {h: [1.0, 3.0, 12.0] for h in ["p1/op", "p1/vf", "p2/op", "p2/value"]}
    )
    return client, runs


def _saved(figure, path: Path) -> np.ndarray:
    """The figure as written to PNG (RGB floats in [0, 1]); its axes' transforms are final after saving."""
    figure.savefig(path)
    return imread(path)[..., :3]


def _pixel(image: np.ndarray, ax, x: float, y: float) -> np.ndarray:
    px, py = (float(v) for v in ax.transData.transform((x, y)))  # display pixels, origin bottom left
    return image[round(image.shape[0] - py), round(px)]


def _blend(hex_colour: str) -> np.ndarray:
    """The band's shading over the white axes background."""
    return 1.0 - BAND_ALPHA + BAND_ALPHA * np.array(to_rgb(hex_colour))


@pytest.mark.parametrize("run", list(RUNS))
def test_lines_plot_a_healthy_value_line_sits_on_green_an_exploding_action_line_on_red(store, run, tmp_path):
    client, runs = store
    history = load_history(client, runs[run])
    figure = lines_figure(history)
    image = _saved(figure, tmp_path / "lines.png")
    axes = [ax for ax in figure.axes if ax.get_title()]
    value_axes = [ax for ax in axes if "value head" in ax.get_title()]
    action_axes = [ax for ax in axes if "action heads" in ax.get_title()]
    modules = 2 if run == "modules" else 1
    assert len(value_axes) == len(action_axes) == modules
    for ax in value_axes:
        assert ax.get_title().endswith("(bands 0.01 / 0.1 / 10 / 50)")
    for ax in action_axes:
        assert ax.get_title().endswith("(bands 0.01 / 0.1 / 2 / 5)")
    if run == "modules":
        assert [ax.get_title().split(":")[0] for ax in axes] == ["module p1"] * 2 + ["module p2"] * 2
    for ax, band in [*((ax, "healthy") for ax in value_axes), *((ax, "exploding") for ax in action_axes)]:
        (line,) = ax.get_lines()[:1]
        assert list(line.get_ydata()) == [8.0, 8.0]
        left = (ax.get_xlim()[0] + 1.0) / 2  # beside the first point, in the x margin: only shading there
        r, g, b = _pixel(image, ax, left, 8.0)
        np.testing.assert_allclose((r, g, b), _blend(BAND_COLOURS[band]), atol=2.5 / 255)
        if band == "healthy":
            assert g > r and g > b
        else:
            assert r > g and r > b


def _white_crossings(image: np.ndarray, ax, row: int, n_steps: int) -> list[float]:
    """Data x of each white run (a band-edge contour) along the middle of heatmap row ``row``."""
    x0 = math.ceil(float(ax.transData.transform((-0.5, row))[0]))
    x1, y = (float(v) for v in ax.transData.transform((n_steps - 0.5, row)))
    line = image[round(image.shape[0] - y), x0 + 1 : math.floor(x1) - 1]
    white = line.min(axis=1) > 0.75  # a 1.2-px white line, anti-aliased: viridis never has all channels above 0.38
    runs, start = [], None
    for i, w in enumerate([*white, False]):
        if w and start is None:
            start = i
        elif not w and start is not None:
            runs.append((start + i - 1) / 2)
            start = None
    inverse = ax.transData.inverted()
    return [float(inverse.transform((x0 + 1 + c, y))[0]) for c in runs]


@pytest.mark.parametrize("run", ["heatmap", "heatmap_critic", "heatmap_modules"])
def test_heatmap_rows_draw_their_own_heads_edges(store, run, tmp_path):
    """op and value both go 1 -> 3 -> 12: op's row crosses its edges 2 and 5, the value row only its
    edge 10 (never 2 or 5), at x interpolated in log10 between the steps."""
    client, runs = store
    history = load_history(client, runs[run])
    figure = heatmap_figure(history)
    image = _saved(figure, tmp_path / "heatmap.png")
    ax = figure.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    crossing = {
        2.0: math.log10(2) / math.log10(3),
        5.0: 1 + (math.log10(5) - math.log10(3)) / (math.log10(12) - math.log10(3)),
        10.0: 1 + (1 - math.log10(3)) / (math.log10(12) - math.log10(3)),
    }
    expected_action, expected_value = [crossing[2.0], crossing[5.0]], [crossing[10.0]]
    expected_labels = {"heatmap": ["op", "value"], "heatmap_critic": ["op", "critic"]}
    assert labels == expected_labels.get(run, ["p1/op", "p1/vf", "p2/op", "p2/value"])
    for row, label in enumerate(labels):
        found = _white_crossings(image, ax, row, 3)
        expected = expected_value if label.split("/")[-1] in VALUE_NAMES else expected_action
        assert found == pytest.approx(expected, abs=0.05), (label, found)
    if run == "heatmap_modules":  # a black line between the modules, none inside one
        assert np.all(_pixel(image, ax, 1.0, 1.5) < 0.1)
        assert np.all(_pixel(image, ax, 0.2, 0.5) > 0.1)


@pytest.mark.parametrize("run", list(RUNS))
def test_report_a_value_head_at_8_is_healthy_an_action_head_exploding(store, run):
    client, runs = store
    text = summary_markdown(load_history(client, runs[run]), ProbeView(None))
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in text.splitlines() if "| 8 |" in line}
    heads = [h.split("/")[-1] for h in RUNS[run]]
    assert rows == {h: ("healthy" if h in VALUE_NAMES else "exploding") for h in heads}
    if run == "modules":
        assert text.index("### module p1") < text.index("### module p2")
        sections = text.split("### module ")
        assert [s.split("\n")[0] for s in sections[1:3]] == ["p1", "p2"]
        for section in sections[1:3]:  # each module's table: its action head first (worst), then its vf/value
            body = [ln.split("|")[1].strip() for ln in section.splitlines() if ln.startswith("| ") and "| 8 |" in ln]
            assert body[0] == "op" and body[1] in ("vf", "value")
