"""Policy head health in ``gradmon-ray watch``, the plots and the report, on a hand-made MLflow run.

The gradient heads (``pi``, ``value``) are not the policy heads (``op``, ``slot``), as with
``with_gradmon`` on RLlib's default module; ``op`` collapses at iteration 3.  Bugs caught: the
policy values looked up under the gradient heads only (nothing shown), the latest step not the
one shown, the collapsed head or its iteration missing, the entropy plot never drawn.
"""

from __future__ import annotations

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from rich.console import Console

from gradmon_ray import metric_names as mn
from gradmon_ray.viz.panel import watch
from gradmon_ray.viz.plots import ENTROPY_FILE, HEATMAP_FILE, LINES_FILE, entropy_figure, write_plots
from gradmon_ray.viz.report import summary_markdown
from gradmon_ray.viz.runs import latest_probe, load_history
from tests.viz.test_plots_report import png_size

SERIES = {
    mn.head_metric(mn.HEAD_GRAD_NORM, "pi"): [0.5, 0.5, 0.5],
    mn.head_metric(mn.HEAD_GRAD_NORM, "value"): [1.0, 1.0, 1.0],
    mn.head_metric(mn.HEAD_ENTROPY_NORM, "op"): [0.9, 0.04, 0.03],
    mn.head_metric(mn.HEAD_ENTROPY_NORM, "slot"): [0.8, 0.7, 0.6],
    mn.head_metric(mn.HEAD_COLLAPSE_LATCH, "op"): [0.0, 0.0, 1.0],
    mn.head_metric(mn.HEAD_COLLAPSE_LATCH, "slot"): [0.0, 0.0, 0.0],
}


def _run(tmp_path) -> tuple[MlflowClient, str]:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("hh")).info.run_id
    metrics = [Metric(k, v, 0, step) for k, values in SERIES.items() for step, v in enumerate(values, 1)]
    metrics.append(Metric(mn.head_metric(mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION, "op"), 3.0, 0, 3))
    client.log_batch(run_id, metrics=metrics)
    client.set_tag(run_id, mn.TAG_HEAD_NAMES, "pi,value")
    return client, run_id


def test_watch_shows_every_policy_heads_entropy_norm_and_the_collapsed_head(tmp_path):
    client, run_id = _run(tmp_path)
    console = Console(record=True, width=220, color_system=None)
    snap = watch(client, run_id=run_id, once=True, console=console)
    text = console.export_text()
    assert snap.heads == ["pi", "value"] and snap.policy_heads == ["op", "slot"]
    assert "op 0.030, slot 0.600" in text
    assert "collapsed: op (iteration 3)" in text
    assert "entropy norm" not in text  # no gradient column has one: no empty row


def test_entropy_plot_and_report_rows(tmp_path):
    client, run_id = _run(tmp_path)
    history = load_history(client, run_id)
    files = write_plots(history, latest_probe(client, run_id, history.latest), tmp_path / "plots")
    assert [f.name for f in files] == [HEATMAP_FILE, LINES_FILE, ENTROPY_FILE]  # no probe: no probe chart
    assert png_size(files[2]) == (1000, 400)  # one module: 10 x (0.4 + 3.6) inches at 100 dpi
    # the entropy plot draws each policy head's logged series, and one x: op's collapse at (3, 0.03)
    (ax,) = entropy_figure(history).axes
    op, collapse, slot = ax.get_lines()
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in (op, collapse, slot)] == [
        ([1, 2, 3], SERIES[mn.head_metric(mn.HEAD_ENTROPY_NORM, "op")]),
        ([3], [0.03]),
        ([1, 2, 3], SERIES[mn.head_metric(mn.HEAD_ENTROPY_NORM, "slot")]),
    ]
    assert (op.get_label(), slot.get_label(), collapse.get_marker()) == ("op", "slot", "x")
    summary = summary_markdown(history, latest_probe(client, run_id, history.latest))
    assert "| op | 0.030 | 0.030 | iteration 3 |" in summary
    assert "| slot | 0.600 | 0.600 | — |" in summary


def test_with_policy_heads_as_columns_the_table_has_entropy_and_collapse_rows(tmp_path):
    client, run_id = _run(tmp_path)
    client.log_batch(run_id, metrics=[Metric(mn.head_metric(mn.HEAD_GRAD_NORM, h), 0.5, 0, 3) for h in ("op", "slot")])
    client.set_tag(run_id, mn.TAG_HEAD_NAMES, "op,slot,value")
    console = Console(record=True, width=220, color_system=None)
    watch(client, run_id=run_id, once=True, console=console)
    rows = {line.split("│")[1].strip(): line for line in console.export_text().splitlines() if line.count("│") > 3}
    assert [c.strip() for c in rows["entropy norm"].split("│")[2:5]] == ["0.030", "0.600", "—"]
    assert [c.strip() for c in rows["collapse"].split("│")[2:5]] == ["●", "○", "–"]  # value: no collapse latch
