"""Plots and the report from a real MLflow store with known values, and plots logged by the sink."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pytest
from matplotlib import colormaps
from matplotlib.colors import to_rgb
from matplotlib.image import imread
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import main
from gradmon_ray.tracking import MlflowSink
from gradmon_ray.viz.plots import (
    HEATMAP_FILE,
    LINES_FILE,
    MISSING_COLOUR,
    PROBE_FILE,
    heatmap_figure,
    norm_matrix,
    write_plots,
)
from gradmon_ray.viz.report import SUMMARY_FILE, head_summaries, log_plots, summary_markdown
from gradmon_ray.viz.runs import RunHistory, latest_probe, load_history
from tests.viz.known_run import HEADS, NORMS, artifacts_beside, make_known_run, shuffled_known_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking the PNG signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


# Figure sizes (inches) at 100 dpi, worked out from the known run's 9 heads (one a value head) and
# 3 iterations: heatmap width max(6, min(16, 0.25 x 3 + 4)) = 6, height max(3, 0.45 x 9 + 1.8) = 5.85;
# lines 13 wide (a value head: two axes) x (0.6 + 3.6 x 1 module) = 4.2; probe chart 10 x 5.
KNOWN_SIZES = {HEATMAP_FILE: (600, 585), LINES_FILE: (1300, 420), PROBE_FILE: (1000, 500)}


@pytest.fixture
def known(tmp_path):
    return make_known_run(f"sqlite:///{tmp_path / 'mlflow.db'}")


def viridis_on_log_scale(norm: float, vmin: float, vmax: float) -> np.ndarray:
    """The RGB a heatmap cell of ``norm`` must have: viridis at the norm's place between vmin and
    vmax in log10, worked out here (matplotlib's colormap, not its ``LogNorm``)."""
    return np.array(colormaps["viridis"]((math.log10(norm) - math.log10(vmin)) / math.log10(vmax / vmin))[:3])


def assert_heatmap_cells(png: Path, history: RunHistory, norms: dict[str, list[float]], vmin: float, vmax: float):
    """Every cell of the heatmap PNG, read at its centre, has the colour of the norm the test logged
    (grey where it logged NaN).  The cell centres come from a drawn ``heatmap_figure`` of the same
    history (its layout only); no row of these runs crosses a band edge, so no contour covers them."""
    figure = heatmap_figure(history)
    figure.canvas.draw()
    ax = figure.axes[0]
    image = imread(png)[..., :3]
    assert [t.get_text() for t in ax.get_yticklabels()] == list(norms)
    failures = []
    for row, (head, values) in enumerate(norms.items()):
        for column, norm in enumerate(values):
            px, py = (float(v) for v in ax.transData.transform((column, row)))
            got = image[round(image.shape[0] - py), round(px)]
            want = np.array(to_rgb(MISSING_COLOUR)) if math.isnan(norm) else viridis_on_log_scale(norm, vmin, vmax)
            if not np.allclose(got, want, atol=2.5 / 255):
                failures.append(f"{head} step {column + 1} ({norm}): {got} != {want}")
    assert not failures, "\n".join(failures)


def test_heatmap_matrix_is_the_metric_history(known):
    client = MlflowClient(known.tracking_uri)
    history = load_history(client, known.run_id)
    heads, steps, matrix = norm_matrix(history)
    assert heads == HEADS and steps == [1, 2, 3]
    expected = np.array([NORMS[h] for h in HEADS])
    np.testing.assert_array_equal(np.isnan(matrix), np.isnan(expected))
    np.testing.assert_allclose(matrix[~np.isnan(matrix)], expected[~np.isnan(expected)])
    # and row by row against MLflow's own history API
    for i, head in enumerate(HEADS):
        logged = {
            m.step: m.value for m in client.get_metric_history(known.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, head))
        }
        assert [logged[s] for s in steps] == pytest.approx(list(matrix[i]), nan_ok=True)


def test_plots_are_pngs_of_the_configured_size_and_the_heatmap_cells_are_the_norms(known, tmp_path):
    """Each PNG's pixel size is its figure size x 100 dpi (``KNOWN_SIZES``); every heatmap cell has
    the colour of its logged norm on the log scale from vmin = min(0.01 / 10, smallest norm 0.005)
    = 0.001 to vmax = max(largest norm 9, 2 x the action edge 5) = 10, a5's missing last step grey."""
    client = MlflowClient(known.tracking_uri)
    history = load_history(client, known.run_id)
    files = write_plots(history, latest_probe(client, known.run_id, history.latest), tmp_path / "plots")
    assert [f.name for f in files] == [HEATMAP_FILE, LINES_FILE, PROBE_FILE]
    assert {f.name: png_size(f) for f in files} == KNOWN_SIZES
    assert_heatmap_cells(files[0], history, NORMS, vmin=0.001, vmax=10.0)


def test_no_probe_no_probe_chart(tmp_path):
    known = make_known_run(f"sqlite:///{tmp_path / 'm.db'}", with_probe=False)
    client = MlflowClient(known.tracking_uri)
    history = load_history(client, known.run_id)
    files = write_plots(history, latest_probe(client, known.run_id, history.latest), tmp_path / "p")
    assert [f.name for f in files] == [HEATMAP_FILE, LINES_FILE]


def test_one_head_one_iteration_still_draws(tmp_path):
    """One head, one iteration, a zero norm (a log scale has no place for it): the heatmap and the
    lines plot, no probe chart, no entropy plot; a 1 x 1 matrix of the logged 0.0; the heatmap
    max(6, min(16, 0.25 x 1 + 4)) = 6 x max(3, 0.45 x 1 + 1.8) = 3 inches, the lines plot (no value
    head: one axes) 10 x (0.6 + 3.6) = 4.2 inches, at 100 dpi."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'one.db'}")
    run = client.create_run(client.create_experiment("one"))
    client.log_metric(run.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, "op"), 0.0, step=1)  # zero on a log scale
    history = load_history(client, run.info.run_id)
    heads, steps, matrix = norm_matrix(history)
    assert (heads, steps, matrix.tolist()) == (["op"], [1], [[0.0]])
    files = write_plots(history, latest_probe(client, run.info.run_id, history.latest), tmp_path / "p")
    assert [f.name for f in files] == [HEATMAP_FILE, LINES_FILE]
    assert [png_size(f) for f in files] == [(600, 300), (1000, 420)]


def test_report_summary_worked_answers(known):
    client = MlflowClient(known.tracking_uri)
    history = load_history(client, known.run_id)
    rows = {r.head: r for r in head_summaries(history)}
    ordered = [r.head for r in head_summaries(history)]
    # dead and exploding first (furthest from the healthy centre first), then missing, weak/elevated, healthy
    assert ordered[:2] == ["slot", "tempo"] and ordered[2] == "a5" and set(ordered[3:5]) == {"a3", "a4"}
    assert rows["slot"].dead_iterations == 3 and rows["tempo"].exploding_iterations == 3
    assert (rows["tempo"].low, rows["tempo"].high) == (7.0, 9.0)
    assert rows["a6"].nan_first == 2 and rows["a6"].inf_first is None
    assert rows["a7"].inf_first == 3 and rows["op"].nan_first is None
    text = summary_markdown(history, latest_probe(client, known.run_id, history.latest), "known")
    assert "- a6: NaN from iteration 2" in text and "- a7: Inf from iteration 3" in text
    assert "VGS scaling factor: 0.5 .. 1" in text
    assert "median 30, last 40" in text
    assert "Iteration 2;" in text and "| bucket_1 | 0.3 (+90%) | 0.02 (+10%) |" in text
    assert "| tempo | 7 | exploding | 7 | 9 | 0 | 3 | 0 | — | — |" in text


def test_cli_report_writes_plots_and_summary(known, tmp_path, capsys):
    out = tmp_path / "report"
    code = main(["report", known.run_id, "--out", str(out), "--tracking-uri", known.tracking_uri])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sorted([HEATMAP_FILE, LINES_FILE, PROBE_FILE, SUMMARY_FILE])
    assert "wrote 4 files" in capsys.readouterr().out
    assert {name: png_size(out / name) for name in KNOWN_SIZES} == KNOWN_SIZES
    summary = (out / SUMMARY_FILE).read_text()
    assert "| tempo | 7 | exploding | 7 | 9 | 0 | 3 | 0 | — | — |" in summary  # the worked row, as below
    assert "- a6: NaN from iteration 2" in summary and "- a7: Inf from iteration 3" in summary


def test_cli_report_unknown_run_exits_2(known, capsys):
    assert main(["report", "f" * 32, "--tracking-uri", known.tracking_uri]) == 2
    assert "no run with id" in capsys.readouterr().err


def test_log_plots_puts_them_in_the_runs_artifacts(known, tmp_path):
    client = MlflowClient(known.tracking_uri)
    logged = log_plots(client, known.run_id)
    assert logged == [f"plots/{n}" for n in (HEATMAP_FILE, LINES_FILE, PROBE_FILE)]
    assert sorted(a.path for a in client.list_artifacts(known.run_id, "plots")) == sorted(logged)
    local = Path(client.download_artifacts(known.run_id, f"plots/{HEATMAP_FILE}", str(tmp_path)))
    assert png_size(local) == KNOWN_SIZES[HEATMAP_FILE]
    assert_heatmap_cells(local, load_history(client, known.run_id), NORMS, vmin=0.001, vmax=10.0)


def test_sink_draws_plots_every_n_iterations_and_at_close(tmp_path):
    uri = f"sqlite:///{tmp_path / 'sink.db'}"
    MlflowClient(uri).create_experiment("sink", artifact_location=artifacts_beside(uri))
    sink = MlflowSink(uri, "sink", plots_every=2, plot_fn=log_plots)
    for step in (1, 2, 3):
        sink.log_iteration(step, {mn.head_metric(mn.HEAD_GRAD_NORM, h): 0.5 * step for h in ("op", "value")})
        assert sink.flush(30)
        if step == 2:
            sink.flush(30)
    assert sink.close()
    client = MlflowClient(uri)
    arts = [a.path for a in client.list_artifacts(sink.run_id, "plots")]
    assert sorted(arts) == sorted([f"plots/{HEATMAP_FILE}", f"plots/{LINES_FILE}"])
    assert sink.plot_failures == 0
    # the final drawing (at close) saw all three iterations: three columns of cells, 0.5 x step,
    # on the log scale from min(0.001, 0.5) = 0.001 to max(1.5, 10) = 10; 6 x max(3, 2.7) inches
    local = Path(client.download_artifacts(sink.run_id, f"plots/{HEATMAP_FILE}", str(tmp_path)))
    assert png_size(local) == (600, 300)
    norms = {"op": [0.5, 1.0, 1.5], "value": [0.5, 1.0, 1.5]}
    assert_heatmap_cells(local, load_history(client, sink.run_id), norms, vmin=0.001, vmax=10.0)


def test_a_failing_plot_is_counted_never_raised_and_the_run_still_ends(tmp_path):
    def broken(client, run_id):
        raise RuntimeError("no fonts")

    uri = f"sqlite:///{tmp_path / 'b.db'}"
    sink = MlflowSink(uri, "b", plots_every=1, plot_fn=broken)
    sink.log_iteration(1, {"x": 1.0})
    assert sink.close()
    assert sink.plot_failures == 2  # after iteration 1 and at close
    assert MlflowClient(uri).get_run(sink.run_id).info.status == "FINISHED"
    assert MlflowClient(uri).get_run(sink.run_id).data.metrics == {"x": 1.0}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heatmap_rows_follow_the_head_names_tag_whatever_order_the_metrics_were_logged_in(tmp_path, seed):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for known, tag, expected in shuffled_known_runs(uri, seed):
        history = load_history(MlflowClient(uri), known.run_id)
        heads, _, matrix = norm_matrix(history)
        assert heads == expected, tag
        np.testing.assert_array_equal(matrix, np.array([NORMS[h] for h in expected]))
        ax = heatmap_figure(history).axes[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == expected, tag


def test_heatmap_matrix_has_one_row_per_head_and_a_column_for_every_logged_step():
    h = mn.head_metric
    series = {
        h(mn.HEAD_GRAD_NORM, "op"): {1: 0.5, 2: 0.25},
        h(mn.HEAD_GRAD_NORM, "slot"): {2: 1.5, 4: 3.0},  # joins late, skips step 3
        h(mn.HEAD_GRAD_NORM, "value"): {3: 7.0},
    }
    heads, steps, matrix = norm_matrix(RunHistory("r", ["op", "slot", "value"], series, {}, {}))
    assert heads == ["op", "slot", "value"] and steps == [1, 2, 3, 4]
    nan = float("nan")
    expected = np.array([[0.5, 0.25, nan, nan], [nan, 1.5, nan, 3.0], [nan, nan, 7.0, nan]])
    np.testing.assert_array_equal(matrix, expected)


def test_the_report_counts_the_iterations_a_head_was_spiking(tmp_path):
    """Worked answer: head ``op`` logged health code 5 ("spiking": calm mean, one exploding
    minibatch) at iterations 2 and 3 of 4; the report's heads table says 2, the other head 0."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'spike.db'}")
    run_id = client.create_run(client.create_experiment("spike")).info.run_id
    for step, (op_code, slot_code) in enumerate([(2, 2), (5, 2), (5, 3), (2, 2)], start=1):
        client.log_metric(run_id, mn.head_metric(mn.HEAD_GRAD_NORM, "op"), 1.0, step=step)
        client.log_metric(run_id, mn.head_metric(mn.HEAD_GRAD_HEALTH, "op"), float(op_code), step=step)
        client.log_metric(run_id, mn.head_metric(mn.HEAD_GRAD_NORM, "slot"), 2.5, step=step)
        client.log_metric(run_id, mn.head_metric(mn.HEAD_GRAD_HEALTH, "slot"), float(slot_code), step=step)
    history = load_history(client, run_id)
    rows = {r.head: r for r in head_summaries(history)}
    assert (rows["op"].spiking_iterations, rows["slot"].spiking_iterations) == (2, 0)
    probe = latest_probe(client, run_id, history.latest)
    table = [line for line in summary_markdown(history, probe).splitlines() if line.startswith("| op |")]
    assert len(table) == 1 and table[0].split("|")[8].strip() == "2", table
