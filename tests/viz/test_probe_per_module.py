"""Watch, report and plots show each module's probe of a multi-module run on its own, labelled by the
module, with the iteration of that module's own latest probe; a one-module run's probe looks as before.

The runs are hand-made in a real MLflow (sqlite) store, with the names the probe actor writes
(``module/<id>/grad_norm/<bucket>/<component>``); every expected cell is written out below.
``p1`` was probed at iterations 2 and 4 (its latest values are iteration 4's), ``p2`` only at 2 and
with other components, so a mix-up of the two modules changes a cell, a column or a label.

Bugs these catch: ``probe_view`` ignoring the module (the last module's norm overwrites the other's
in one ``bucket_1`` row), ``latest_probe`` looking up the plain name (no iteration in a multi-module
run) or one module's iteration for both, the panel/report/plot showing one module only or without
its label, a module's columns taken from another module, a one-module run's layout changed.
"""

from __future__ import annotations

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from rich.console import Console

from gradmon_ray import metric_names as mn
from gradmon_ray.viz.panel import watch
from gradmon_ray.viz.plots import PROBE_FILE, probe_bars_figure, write_plots
from gradmon_ray.viz.report import summary_markdown
from gradmon_ray.viz.runs import latest_probe, load_history, probe_view
from tests.viz.known_run import make_known_run
from tests.viz.module_runs import log_run
from tests.viz.test_plots_report import png_size

# (module, iteration) -> bucket -> component -> (norm, share)
PROBES = {
    ("p1", 2): {"bucket_1": {"task": (9.0, 0.5), "entropy": (9.0, 0.5)}},  # older: never shown
    ("p1", 4): {
        "bucket_1": {"task": (0.5, 0.75), "entropy": (0.25, 0.25)},
        "bucket_2": {"task": (1.5, 1.2), "entropy": (0.3, -0.2)},
    },
    ("p2", 2): {"bucket_1": {"task": (2.0, 0.4), "value": (3.0, 0.6)}},
}


def _two_module_run(tracking_uri: str) -> str:
    client = MlflowClient(tracking_uri)
    run_id = log_run(client, "two", {"p1/op": [0.5] * 4, "p2/op": [0.6] * 4})
    metrics = []
    for (module, step), buckets in PROBES.items():
        for bucket, components in buckets.items():
            for component, (norm, share) in components.items():
                for template, value in ((mn.PROBE_COMPONENT_NORM, norm), (mn.PROBE_SHARE, share)):
                    name = mn.module_metric(module, mn.probe_metric(template, bucket, component=component))
                    metrics.append(Metric(name, value, 3000 + step, step))
            num_steps = mn.module_metric(module, mn.probe_metric(mn.PROBE_NUM_STEPS, bucket))
            metrics.append(Metric(num_steps, 7.0, 3000 + step, step))
    metrics.append(Metric(mn.PROBE_DURATION_S, 0.25, 3004, 4))  # plain: one per request
    client.log_batch(run_id, metrics=metrics)
    return run_id


def test_the_view_keeps_each_modules_cells_and_its_own_iteration(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    run_id = _two_module_run(uri)
    client = MlflowClient(uri)
    probe = latest_probe(client, run_id, client.get_run(run_id).data.metrics)
    assert probe.norms == {
        "p1": {"bucket_1": {"task": 0.5, "entropy": 0.25}, "bucket_2": {"task": 1.5, "entropy": 0.3}},
        "p2": {"bucket_1": {"task": 2.0, "value": 3.0}},
    }
    assert probe.shares == {
        "p1": {"bucket_1": {"task": 0.75, "entropy": 0.25}, "bucket_2": {"task": 1.2, "entropy": -0.2}},
        "p2": {"bucket_1": {"task": 0.4, "value": 0.6}},
    }
    assert probe.steps == {"p1": 4, "p2": 2} and probe.step == 4
    assert probe.modules == ["p1", "p2"]
    assert probe.module_components("p2") == ["task", "value"] and probe.module_buckets("p2") == ["bucket_1"]
    plain = probe_view({mn.probe_metric(mn.PROBE_COMPONENT_NORM, "bucket_1", component="task"): 0.3})
    assert plain.norms == {None: {"bucket_1": {"task": 0.3}}} and plain.modules == [None]


def test_the_panel_shows_one_labelled_table_per_module(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    run_id = _two_module_run(uri)
    console = Console(record=True, width=200, color_system=None, force_terminal=False)
    watch(MlflowClient(uri), run_id=run_id, once=True, console=console)
    lines = console.export_text().splitlines()
    start = lines.index("latest probe (module p1, iteration 4): gradient norm (signed share)")
    second = lines.index("latest probe (module p2, iteration 2): gradient norm (signed share)")

    def table(block: list[str]) -> list[list[str]]:
        return [[c.strip() for c in ln.split("│" if "│" in ln else "┃")[1:-1]] for ln in block if ln[:1] in "│┃"]

    assert table(lines[start:second]) == [
        ["bucket", "task", "entropy"],
        ["bucket_1", "0.5 (+75%)", "0.25 (+25%)"],
        ["bucket_2", "1.5 (+120%)", "0.3 (-20%)"],
    ]
    assert table(lines[second:]) == [["bucket", "task", "value"], ["bucket_1", "2 (+40%)", "3 (+60%)"]]


P1_P2_REPORT = """## Latest gradient probe

### module p1

Iteration 4; gradient norm per bucket and component (signed share):

| bucket | task | entropy |
|---|---:|---:|
| bucket_1 | 0.5 (+75%) | 0.25 (+25%) |
| bucket_2 | 1.5 (+120%) | 0.3 (-20%) |

### module p2

Iteration 2; gradient norm per bucket and component (signed share):

| bucket | task | value |
|---|---:|---:|
| bucket_1 | 2 (+40%) | 3 (+60%) |
"""

ONE_MODULE_REPORT = """## Latest gradient probe

Iteration 2; gradient norm per bucket and component (signed share):

| bucket | task | entropy |
|---|---:|---:|
| bucket_1 | 0.3 (+90%) | 0.02 (+10%) |
| bucket_2 | 0.5 (+80%) | 0.04 (+20%) |
"""


def test_the_report_has_a_section_per_module_and_a_one_module_run_keeps_its_table(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    for run_id, expected in ((_two_module_run(uri), P1_P2_REPORT), (make_known_run(uri).run_id, ONE_MODULE_REPORT)):
        history = load_history(client, run_id)
        text = summary_markdown(history, latest_probe(client, run_id, history.latest))
        assert text[text.index("## Latest gradient probe") :] == expected


def test_the_probe_plot_has_a_row_of_bars_per_module_with_its_own_values(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    run_id = _two_module_run(uri)
    client = MlflowClient(uri)
    history = load_history(client, run_id)
    probe = latest_probe(client, run_id, history.latest)
    files = write_plots(history, probe, tmp_path / "plots")
    (chart,) = [f for f in files if f.name == PROBE_FILE]
    assert png_size(chart) == (1000, 1000)  # 10 x (5 per module) inches at 100 dpi
    p1, p2 = probe_bars_figure(probe).axes
    suffix = ": component norms (signed share on the bars)"
    assert p1.get_title() == "module p1: gradient probe, iteration 4" + suffix
    assert p2.get_title() == "module p2: gradient probe, iteration 2" + suffix
    cases = (
        (p1, {"task": [0.5, 1.5], "entropy": [0.25, 0.3]}, ["bucket_1", "bucket_2"]),
        (p2, {"task": [2.0], "value": [3.0]}, ["bucket_1"]),
    )
    for ax, heights, buckets in cases:
        assert {c.get_label(): [b.get_height() for b in c] for c in ax.containers} == heights
        assert [t.get_text() for t in ax.get_xticklabels()] == buckets
    assert [t.get_text() for t in p1.texts] == ["+75%", "+120%", "+25%", "-20%"]
    assert [t.get_text() for t in p2.texts] == ["+40%", "+60%"]
