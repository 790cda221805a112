"""Plots and the report from a real MLflow store with known values, and plots logged by the sink."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import main
from gradmon_ray.tracking import MlflowSink
from gradmon_ray.viz.plots import HEATMAP_FILE, LINES_FILE, PROBE_FILE, heatmap_figure, norm_matrix, write_plots
from gradmon_ray.viz.report import SUMMARY_FILE, head_summaries, log_plots, summary_markdown
from gradmon_ray.viz.runs import latest_probe, load_history
from tests.viz.known_run import HEADS, NORMS, artifacts_beside, make_known_run, shuffled_known_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking the PNG signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def known(tmp_path):
    return make_known_run(f"sqlite:///{tmp_path / 'mlflow.db'}")


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


def test_plots_are_pngs_of_sensible_size(known, tmp_path):
    client = MlflowClient(known.tracking_uri)
    history = load_history(client, known.run_id)
    files = write_plots(history, latest_probe(client, known.run_id, history.latest), tmp_path / "plots")
    assert [f.name for f in files] == [HEATMAP_FILE, LINES_FILE, PROBE_FILE]
    for f in files:
        width, height = png_size(f)
        assert 400 <= width <= 2000 and 250 <= height <= 1500, (f.name, width, height)
        assert f.stat().st_size > 10_000  # drawn, not blank


def test_no_probe_no_probe_chart(tmp_path):
    known = make_known_run(f"sqlite:///{tmp_path / 'm.db'}", with_probe=False)
    client = MlflowClient(known.tracking_uri)
    history = load_history(client, known.run_id)
    files = write_plots(history, latest_probe(client, known.run_id, history.latest), tmp_path / "p")
    assert [f.name for f in files] == [HEATMAP_FILE, LINES_FILE]


def test_one_head_one_iteration_still_draws(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'one.db'}")
    run = client.create_run(client.create_experiment("one"))
    client.log_metric(run.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, "op"), 0.0, step=1)  # zero on a log scale
    history = load_history(client, run.info.run_id)
    files = write_plots(history, latest_probe(client, run.info.run_id, history.latest), tmp_path / "p")
    assert all(png_size(f)[0] > 0 for f in files)


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
    assert "| tempo | 7 | exploding | 7 | 9 | 0 | 3 | — | — |" in text


def test_cli_report_writes_plots_and_summary(known, tmp_path, capsys):
    out = tmp_path / "report"
    code = main(["report", known.run_id, "--out", str(out), "--tracking-uri", known.tracking_uri])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sorted([HEATMAP_FILE, LINES_FILE, PROBE_FILE, SUMMARY_FILE])
    assert "wrote 4 files" in capsys.readouterr().out


def test_cli_report_unknown_run_exits_2(known, capsys):
    assert main(["report", "f" * 32, "--tracking-uri", known.tracking_uri]) == 2
    assert "no run with id" in capsys.readouterr().err


def test_log_plots_puts_them_in_the_runs_artifacts(known):
    client = MlflowClient(known.tracking_uri)
    logged = log_plots(client, known.run_id)
    assert logged == [f"plots/{n}" for n in (HEATMAP_FILE, LINES_FILE, PROBE_FILE)]
    assert sorted(a.path for a in client.list_artifacts(known.run_id, "plots")) == sorted(logged)


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
    # the final drawing (at close) saw all three iterations
    local = Path(client.download_artifacts(sink.run_id, f"plots/{HEATMAP_FILE}", str(tmp_path)))
    assert png_size(local)[0] > 0


def test_a_failing_plot_is_counted_never_raised_and_the_run_still_ends(tmp_path):
    def broken(client, run_id):
        raise RuntimeError("no fonts")

    uri = f"sqlite:///{tmp_path / 'b.db'}"
    sink = MlflowSink(uri, "b", plots_every=1, plot_fn=broken)
    sink.log_iteration(1, {"x": 1.0})
    assert sink.close()
    assert sink.plot_failures == 2  # after iteration 1 and at close
    assert MlflowClient(uri).get_run(sink.run_id).info.status == "FINISHED"
    assert math.isfinite(MlflowClient(uri).get_run(sink.run_id).data.metrics["x"])


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
