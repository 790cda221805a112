"""Drop-in heads ``pi``/``vf`` with the module's one ``policy`` latch (``latch/nan/policy``): ``watch``
and the report show that latch in each action head's rows, never "–"; a value head keeps "–"; a head
with latches of its own keeps its own; an APPO iteration's fractional trend shows its sign.

Hand-made MLflow runs (``tests/viz/module_runs.log_run``), every cell's answer written out here from
the logged values: latch 1 -> ●, 0 -> ○, nothing logged -> –; trend -0.5 -> ↘.

Bugs these catch: the latch rows looking up ``latch/nan/pi`` only (the newcomer's "–" under ``pi``);
the fallback reaching a value head or another module's ``policy`` latch; the report's latch columns
and "Latched heads" list missing the policy latch; ``int(-0.5) == 0`` shown as "→".
"""

from __future__ import annotations

from mlflow.tracking import MlflowClient
from rich.console import Console

from gradmon_ray.viz.panel import watch
from gradmon_ray.viz.probe_view import ProbeView
from gradmon_ray.viz.report import head_summaries, summary_markdown
from gradmon_ray.viz.runs import load_history
from tests.viz.module_runs import log_run


def _frame(client: MlflowClient, run_id: str) -> str:
    console = Console(record=True, width=220, color_system=None, force_terminal=False)
    watch(client, run_id=run_id, once=True, console=console)
    return console.export_text()


def _rows(text: str, name: str) -> list[list[str]]:
    """The cells of every table row called ``name`` (one table per module), in column order."""
    lines = [ln for ln in text.splitlines() if ln.startswith("│") and ln.split("│")[1].strip() == name]
    return [[cell.strip() for cell in ln.split("│")[2:-1]] for ln in lines]


def test_drop_in_heads_show_the_modules_policy_latch(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = log_run(
        client,
        "drop-in",
        {"pi": [0.5, 0.4], "vf": [3.0, 2.0]},
        trends={"pi": -0.5, "vf": 0.25},  # RLlib's mean of an APPO iteration's steps
        latches={"policy": (1.0, 0.0)},
        entropy={"policy": 0.5},
    )
    text = _frame(client, run_id)
    assert _rows(text, "NaN latch") == [["●", "–"]]
    assert _rows(text, "Inf latch") == [["○", "–"]]
    assert _rows(text, "entropy norm") == [["0.500", "—"]]
    assert _rows(text, "grad norm") == [["0.400 ↘", "2.000 ↗"]]
    assert "policy 0.500" not in text, "the policy's entropy is in pi's column, not repeated below"
    history = load_history(client, run_id)
    rows = {r.head: r for r in head_summaries(history)}
    assert (rows["pi"].nan_first, rows["pi"].inf_first) == (1, None)
    assert (rows["vf"].nan_first, rows["vf"].inf_first) == (None, None)
    markdown = summary_markdown(history, ProbeView(None), "drop-in")
    assert "- pi: NaN from iteration 1" in markdown and "- vf:" not in markdown


def test_each_module_shows_its_own_policy_latch_and_own_latches_win(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = log_run(
        client,
        "two-modules",
        {"p1/pi": [0.5], "p1/vf": [1.0], "p2/a0": [0.5], "p2/pi": [0.6], "p2/vf": [1.0]},
        latches={"p1/policy": (0.0, 1.0), "p2/policy": (1.0, 1.0), "p2/a0": (0.0, 0.0)},
    )
    text = _frame(client, run_id)
    # p1: pi shows p1's policy latch (NaN clear, Inf set); p2: a0 its own (clear), pi p2's policy (set)
    assert _rows(text, "NaN latch") == [["○", "–"], ["○", "●", "–"]]
    assert _rows(text, "Inf latch") == [["●", "–"], ["○", "●", "–"]]
    rows = {r.head: r for r in head_summaries(load_history(client, run_id))}
    assert rows["p1/pi"].inf_first == 1 and rows["p1/pi"].nan_first is None
    assert rows["p2/pi"].nan_first == 1 and rows["p2/a0"].nan_first is None
