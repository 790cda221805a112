"""A run whose module set changed (``algo.add_module`` mid-run, a league): ``watch``, the plots and the
report show every module, and a module's iteration without samples (NaN counts) never breaks them.

A hand-made MLflow sqlite run, logged as a user's own algorithm with ``GradmonMLflowCallback`` logs
it: modules ``p0`` and ``p1`` from step 1, ``p2`` added before step 3; the ``gradmon.head_names``
tag as a callback that wrote it once at step 1 left it (``p0`` and ``p1`` only: a run written before
the tag followed the module set); at step 3 ``p1`` got no samples, so RLlib's result holds NaN for
its norms and its ``update/skipped`` counters.  Every expected cell is written out here.

Bugs these catch: readers taking the heads from the tag alone (``p2`` missing from watch, the
heatmap and the report though ``module/p2/...`` is in MLflow); ``int(nan)`` in the report's
skipped-updates line (``report`` exiting 1 with no summary.md) or a NaN shown as "nan"/"0".
"""

from __future__ import annotations

from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient
from rich.console import Console

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import main
from gradmon_ray.viz.panel import watch
from gradmon_ray.viz.plots import norm_matrix
from gradmon_ray.viz.report import SUMMARY_FILE
from gradmon_ray.viz.runs import load_history
from tests.viz.known_run import artifacts_beside

NAN = float("nan")
NORMS = {  # label -> norm at steps 1, 2, 3 (None: not logged)
    "p0/pi": [0.5, 0.6, 0.7],
    "p0/vf": [3.0, 3.0, 3.0],
    "p1/pi": [0.4, 0.4, NAN],  # no samples at step 3
    "p1/vf": [2.0, 2.0, NAN],
    "p2/pi": [None, None, 0.9],  # joined before step 3
    "p2/vf": [None, None, 4.0],
}
SKIPPED_TOTAL = {"p0": [0.0, 1.0, 1.0], "p1": [0.0, 2.0, NAN], "p2": [None, None, 0.0]}
ORDER = ["p0/pi", "p0/vf", "p1/pi", "p1/vf", "p2/pi", "p2/vf"]


def _log(tracking_uri: str) -> str:
    client = MlflowClient(tracking_uri)
    exp_id = client.create_experiment("league", artifact_location=artifacts_beside(tracking_uri))
    run_id = client.create_run(exp_id, run_name="league").info.run_id
    metrics = []
    for label, values in NORMS.items():
        name = mn.head_metric(mn.HEAD_GRAD_NORM, label)
        metrics += [Metric(name, v, 1000 + s, s) for s, v in enumerate(values, 1) if v is not None]
    for module, values in SKIPPED_TOTAL.items():
        for template in (mn.SKIPPED_UPDATES_TOTAL, mn.SKIPPED_UPDATES):
            name = mn.module_metric(module, template)
            metrics += [Metric(name, v, 1000 + s, s) for s, v in enumerate(values, 1) if v is not None]
    tags = [RunTag(mn.TAG_HEAD_NAMES, "p0/pi,p0/vf,p1/pi,p1/vf"), RunTag(mn.TAG_STATUS, "finished")]
    client.log_batch(run_id, metrics=metrics, tags=tags)
    client.set_terminated(run_id)
    return run_id


def test_watch_the_plots_and_the_report_show_a_module_added_mid_run(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = _log(uri)
    client = MlflowClient(uri)

    history = load_history(client, run_id)
    assert history.heads == ORDER
    heads, steps, matrix = norm_matrix(history)
    assert heads == ORDER and steps == [1, 2, 3]
    assert matrix[ORDER.index("p2/pi")].tolist()[2] == 0.9 and matrix[ORDER.index("p2/vf")].tolist()[2] == 4.0

    console = Console(record=True, width=220, color_system=None, force_terminal=False)
    watch(client, run_id=run_id, once=True, console=console)
    frame = console.export_text()
    assert "module p2" in frame and "0.900" in frame, frame
    assert "skipped updates —" in frame  # p1's last skipped count is NaN: no samples that iteration

    out = tmp_path / "report"
    assert main(["report", run_id, "--tracking-uri", uri, "--out", str(out)]) == 0
    summary = (out / SUMMARY_FILE).read_text()
    heads_part = summary.split("## Heads, worst first")[1].split("## Latched heads")[0]
    scalars_part = summary.split("## VGS, noise scale")[1].split("## Latest gradient probe")[0]

    def by_module(part: str, keep) -> dict[str, list[str]]:
        return {m.split("\n", 1)[0]: [ln for ln in m.splitlines() if keep(ln)] for m in part.split("### module ")[1:]}

    rows = by_module(heads_part, lambda ln: ln.startswith(("| pi |", "| vf |")))
    last = {
        module: {r.split("|")[1].strip(): (r.split("|")[2].strip(), r.split("|")[3].strip()) for r in rs}
        for module, rs in rows.items()
    }
    assert last == {  # head -> (last norm, band)
        "p0": {"pi": ("0.7", "healthy"), "vf": ("3", "healthy")},
        "p1": {"pi": ("—", "missing"), "vf": ("—", "missing")},
        "p2": {"pi": ("0.9", "healthy"), "vf": ("4", "healthy")},
    }
    assert by_module(scalars_part, lambda ln: ln.startswith("- skipped updates")) == {
        "p0": ["- skipped updates: 1"],
        "p1": ["- skipped updates: 2 (no samples at the last iteration)"],
        "p2": ["- skipped updates: 0"],  # from the step it joined
    }
    assert " nan" not in summary  # ("NaN latch" is a column name)
    assert "wrote" in capsys.readouterr().out
