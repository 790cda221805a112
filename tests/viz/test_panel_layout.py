"""``gradmon-ray watch`` as users see it: 80 columns, the built-in env's eight heads in their declared
order, several modules, the value head judged by its own edges.  Real MLflow sqlite runs with
hand-picked values (``module_runs.log_run``); every expected cell is written out by hand.

Bugs caught: heads cut to ``alph…`` (or ``agent_0…``) and indistinguishable; a table wider than
the terminal; columns not in the tag's order or the value head not last; a value head at norm 8
called exploding (the action edges) or an action head at 8 called healthy; a latch the head does
not have drawn as a clear latch; a module's skipped updates or global norm missing from the
header; the run's own band edges ignored.
"""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from rich.console import Console

from gradmon_ray import metric_names as mn
from gradmon_ray.envs import HEAD_NAMES
from gradmon_ray.viz.head_table import short_number
from gradmon_ray.viz.panel import render_panel, watch
from gradmon_ray.viz.probe_view import ProbeView
from gradmon_ray.viz.runs import RunSnapshot
from tests.viz.module_runs import log_run

DECLARED = [*HEAD_NAMES, "value"]
assert DECLARED[:3] == ["op", "slot", "blueprint"]  # the env's own order, not sorted
BUILTIN_NORMS = {
    "op": 0.5,
    "slot": 0.005,
    "blueprint": 3.0,
    "style": 0.05,
    "tempo": 8.0,
    "alpha_target": 1.0,
    "alpha_speed": 1.5,
    "alpha_curve": 0.2,
    "value": 8.0,  # healthy: the value edges are 0.01 / 0.1 / 10 / 50
}
TRENDS = {"op": 1, "style": -1, "tempo": 1, "value": -1}  # the rest steady (0)
LATCHES = {h: (0.0, 0.0) for h in HEAD_NAMES} | {"alpha_speed": (1.0, 0.0), "tempo": (0.0, 1.0)}
ENTROPY = {h: 0.5 for h in HEAD_NAMES} | {"slot": 0.1}
LABELS = {"norm", "bar", "state", "NaN", "Inf", "noise", "entropy", "collapse"}


def _builtin(client: MlflowClient, prefix: str = "", skipped: float = 2.0, global_norm: float = 1.25) -> dict:
    """The built-in env's heads (under module ``prefix`` when given) as ``log_run`` arguments."""

    def label(h: str) -> str:
        return f"{prefix}/{h}" if prefix else h

    module = prefix or None
    return {
        "norms": {label(h): [v] for h, v in BUILTIN_NORMS.items()},
        "trends": {label(h): float(TRENDS.get(h, 0)) for h in BUILTIN_NORMS},
        "latches": {label(h): v for h, v in LATCHES.items()},
        "entropy": {label(h): v for h, v in ENTROPY.items()},
        "module_scalars": {
            mn.module_metric(module, mn.SKIPPED_UPDATES_TOTAL): [skipped],
            mn.module_metric(module, mn.GLOBAL_GRAD_NORM): [global_norm],
        },
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store with every run of this module (creating a store costs seconds)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('panel') / 'mlflow.db'}"
    client = MlflowClient(uri)
    runs = {"builtin": log_run(client, "builtin", tag=DECLARED, **_builtin(client))}
    one, two = _builtin(client, "agent_0", skipped=3.0), _builtin(client, "agent_1", skipped=0.0, global_norm=2.5)
    two["norms"] |= {"agent_1/op": [0.005], "agent_1/value": [60.0]}  # dead; exploding by the value edges
    two["module_scalars"][mn.module_metric("agent_1", mn.VGS_SCALING_FACTOR)] = [0.75]
    merged = {k: one[k] | two[k] for k in one}
    runs["multi"] = log_run(client, "multi", tag=[f"agent_{i}/{h}" for i in (0, 1) for h in DECLARED], **merged)
    for name, heads in {
        "value": ["op", "value"],
        "vf": ["op", "vf"],
        "modules": ["p1/op", "p1/vf", "p2/op", "p2/value"],
    }.items():
        runs[name] = log_run(client, name, {h: [8.0] for h in heads})
    return client, runs


def _frame(client: MlflowClient, run_id: str, width: int) -> str:
    console = Console(record=True, width=width, color_system=None, force_terminal=False)
    watch(client, run_id=run_id, once=True, console=console)
    return console.export_text()


def compact_tables(text: str) -> list[dict[str, list[str]]]:
    """Each compact table of a frame: ``""`` -> the column names, each row label -> its cells."""
    lines = text.splitlines()
    tables = []
    for i, line in enumerate(lines):
        if line.strip() and set(line.strip()) == {"─"}:
            table = {"": lines[i - 1].split()}
            for row in lines[i + 1 :]:
                tokens = row.split()
                if not tokens or tokens[0] not in LABELS:
                    break
                table[tokens[0]] = tokens[1:]
            tables.append(table)
    return tables


def _wide_rows_all(text: str) -> list[tuple[str, list[str]]]:
    """Every body row of the wide tables: (label, cells)."""
    return [
        (ln.split("│")[1].strip(), [c.strip() for c in ln.split("│")[2:-1]]) for ln in text.splitlines() if "│" in ln
    ]


def _wide_rows(text: str) -> dict[str, list[str]]:
    return dict(_wide_rows_all(text))


BUILTIN_TABLE = {
    "": ["op", "slot", "bluepr…", "style", "tempo", "a_targ…", "a_speed", "a_curve", "value"],
    "norm": ["0.500↗", "5e-03→", "3.000→", "0.050↘", "8.000↗", "1.000→", "1.500→", "0.200→", "8.000↘"],
    # filled cells = round(7 * (log10(norm) + 4) / 6), e.g. 0.5 -> round(4.32) = 4
    "bar": ["█" * n + "░" * (7 - n) for n in (4, 2, 5, 3, 6, 5, 5, 4, 6)],
    "state": ["healthy", "dead", "elev.", "weak", "explod.", "healthy", "healthy", "healthy", "healthy"],
    "NaN": ["○", "○", "○", "○", "○", "○", "●", "○", "–"],
    "Inf": ["○", "○", "○", "○", "●", "○", "○", "○", "–"],
    "entropy": ["0.500", "0.100", "0.500", "0.500", "0.500", "0.500", "0.500", "0.500", "—"],
    "collapse": ["○"] * 8 + ["–"],
}
LEGEND = "heads: bluepr… = blueprint, a_targ… = alpha_target, a_speed = alpha_speed, a_curve = alpha_curve"


def test_80_columns_builtin_heads_abbreviated_uniquely_in_declared_order_with_a_legend(store):
    client, runs = store
    text = _frame(client, runs["builtin"], 80)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    (table,) = compact_tables(text)
    assert table == BUILTIN_TABLE, text
    assert LEGEND in text.replace("\n", " ").replace("  ", " ")
    header = " ".join(text.splitlines()[:2])
    assert "global norm 1.250" in header and "skipped updates 2" in header and "VGS scale —" in header


def test_wide_terminal_full_names_in_declared_order_value_latch_has_none(store):
    client, runs = store
    text = _frame(client, runs["builtin"], 220)
    (header,) = [ln for ln in text.splitlines() if ln.startswith("┃") and not ln.split("┃")[1].strip()]
    assert [c.strip() for c in header.split("┃")[2:-1]] == DECLARED
    rows = _wide_rows(text)
    assert rows["state"] == ["healthy", "dead", "elevated", "weak", "exploding", *["healthy"] * 4]
    assert rows["NaN latch"][-1] == rows["Inf latch"][-1] == rows["collapse"][-1] == "–"
    assert "heads:" not in text  # nothing abbreviated


def test_80_columns_two_modules_one_table_each_with_that_modules_numbers(store):
    client, runs = store
    text = _frame(client, runs["multi"], 80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    first, second = compact_tables(text)
    assert first == BUILTIN_TABLE
    assert second[""] == BUILTIN_TABLE[""]
    assert second["norm"][0] == "5e-03↗" and second["norm"][-1] == "60.00↘"
    assert second["state"] == ["dead", *BUILTIN_TABLE["state"][1:-1], "explod."]
    titles = [ln.strip() for ln in lines if ln.startswith("module ")]
    assert titles == [
        "module agent_0  ·  global norm 1.250  ·  VGS scale —  ·  skipped updates 3",
        "module agent_1  ·  global norm 2.500  ·  VGS scale 0.75  ·  skipped updates 0",
    ]
    header = lines[: lines.index(next(ln for ln in lines if ln.startswith("module ")))]
    assert header == ["run multi (finished)  ·  iteration 1  ·  env steps —  ·  return —"]  # no run-wide 0
    assert text.count("heads: ") == 1  # both modules' legends are the same: once


@pytest.mark.parametrize(
    ("run", "states"),
    [
        ("value", {"op": "exploding", "value": "healthy"}),
        ("vf", {"op": "exploding", "vf": "healthy"}),
        ("modules", {"p1/op": "exploding", "p1/vf": "healthy", "p2/op": "exploding", "p2/value": "healthy"}),
    ],
)
def test_a_value_head_at_norm_8_is_healthy_an_action_head_exploding(store, run, states):
    """No health code logged, so the panel judges: a value head (``value``, ``vf``, ``p1/vf``) by
    the value edges (healthy to 10), an action head by the action edges (exploding above 5)."""
    client, runs = store
    text = _frame(client, runs[run], 220)
    shown = [row for label, row in _wide_rows_all(text) if label == "state"]
    assert [s for row in shown for s in row] == list(states.values())


def test_the_runs_own_edges_judge_the_value_head(tmp_path):
    """A run configured with value edges 0.01 / 0.1 / 5 / 20 logs them as params: 8 is elevated."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    params = {f"telemetry.bands.value.{e}": v for e, v in zip(mn_edges(), ("0.01", "0.1", "5", "20"), strict=True)}
    run_id = log_run(client, "edges", {"op": [8.0], "value": [8.0]}, params=params)
    (row,) = [ln for ln in _frame(client, run_id, 220).splitlines() if "│ state" in ln]
    assert [c.strip() for c in row.split("│")[2:-1]] == ["exploding", "elevated"]


def mn_edges() -> tuple[str, ...]:
    """The band edge names, in ``HealthBands`` order."""
    return ("dead_below", "weak_below", "healthy_max", "elevated_max")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "—"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (0.0, "0"),
        (0.004999, "5e-03"),
        (0.01, "0.010"),
        (0.35449, "0.354"),
        (9.9994, "9.999"),
        (9.9996, "10.00"),  # would round to 10.000 (6 characters) as .3f
        (12.345, "12.35"),
        (99.996, "100.0"),
        (999.94, "999.9"),
        (999.96, "1e+03"),
        (23456.0, "2e+04"),
    ],
)
def test_compact_numbers_are_at_most_5_characters(value, text):
    assert short_number(value) == text and len(text) <= 5


def test_more_heads_than_fit_wrap_into_further_tables_with_the_same_rows():
    """13 heads at 80 columns: 9 (8-character label column, 8 per head) then 4, every head once."""
    heads = [f"h{i:02d}" for i in range(12)] + ["value"]
    metrics = {mn.head_metric(mn.HEAD_GRAD_NORM, h): 0.5 for h in heads}
    metrics |= {mn.head_metric(mn.HEAD_NAN_LATCH, h): 0.0 for h in heads[:-1]}
    snap = RunSnapshot("r", "many", "FINISHED", metrics, {}, heads, 1, ProbeView(None))
    console = Console(record=True, width=80, color_system=None, force_terminal=False)
    console.print(render_panel(snap, 80))
    text = console.export_text()
    first, second = compact_tables(text)
    assert first[""] == heads[:9] and second[""] == heads[9:]
    assert list(first) == list(second) == ["", "norm", "bar", "state", "NaN", "Inf"]
    assert second["NaN"] == ["○", "○", "○", "–"]
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "heads:" not in text  # every name fits: nothing to explain
