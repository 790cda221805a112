"""`gradmon-ray watch --once` against a real MLflow store with known values."""

from __future__ import annotations

import time

import pytest
from mlflow.tracking import MlflowClient
from rich.console import Console

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import main
from gradmon_ray.viz.panel import BAR_WIDTH, LATCH_CLEAR, LATCH_SET, head_cells, mini_bar, watch
from gradmon_ray.viz.probe_view import ProbeView
from gradmon_ray.viz.runs import RunSnapshot
from tests.e2e.processes import free_port
from tests.viz.known_run import HEADS, make_known_run, shuffled_known_runs


@pytest.fixture
def known(tmp_path):
    return make_known_run(f"sqlite:///{tmp_path / 'mlflow.db'}")


def _frame(known, **kwargs) -> str:
    console = Console(record=True, width=220, color_system=None, force_terminal=False)
    watch(MlflowClient(known.tracking_uri), once=True, console=console, **kwargs)
    return console.export_text()


def _row(text: str, name: str) -> list[str]:
    """The cells of one panel row, in column (head) order."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith("│") and ln.split("│")[1].strip() == name]
    return [cell.strip() for cell in line.split("│")[2:-1]]


def test_every_head_has_a_column_with_its_values_arrows_states_and_latches(known):
    text = _frame(known, run_id=known.run_id)
    (header,) = [ln for ln in text.splitlines() if ln.startswith("┃") and ln.split("┃")[2].strip() == "op"]
    assert [c.strip() for c in header.split("┃")[2:-1]] == HEADS  # 8 action heads, then value
    assert _row(text, "grad norm") == [
        "0.700 ↗",
        "0.005 →",
        "7.000 ↘",
        "0.050 →",
        "3.000 →",
        "nan →",
        "1.000 →",
        "1.500 →",
        "0.800 →",
    ]
    assert _row(text, "state") == [
        "healthy",
        "dead",
        "exploding",
        "weak",
        "elevated",
        "missing",
        "healthy",
        "healthy",
        "healthy",
    ]
    assert _row(text, "NaN latch") == ["○"] * 6 + ["●", "○", "–"]  # a6; the value head has no latch
    assert _row(text, "Inf latch") == ["○"] * 7 + ["●", "–"]  # a7
    assert _row(text, "noise scale") == ["12.5"] + ["—"] * 8
    assert _row(text, "log bar") == [mini_bar(v) for v in (0.7, 0.005, 7.0, 0.05, 3.0, None, 1.0, 1.5, 0.8)]
    assert "iteration 3" in text and "env steps 3072" in text and "return -0.250" in text
    assert "VGS scale 0.5" in text and "skipped updates 2" in text
    assert "latest probe (iteration 2)" in text
    (b1,) = [ln for ln in text.splitlines() if "bucket_1" in ln]
    assert "0.3 (+90%)" in b1 and "0.02 (+10%)" in b1


def test_experiment_follows_its_newest_run(known):
    newer = make_known_run(known.tracking_uri, with_probe=False)
    text = _frame(known, experiment=known.experiment)
    assert "probe: no probe results" in text  # the second, probe-less run
    assert newer.run_id != known.run_id


@pytest.mark.parametrize(
    ("norm", "cells"),
    [(None, 0), (1e-4, 1), (1e-5, 1), (1e-1, 5), (1.0, 7), (100.0, 10), (1e9, 10), (float("inf"), 10)],
)
def test_mini_bar_is_log_scaled_from_1e_minus_4_to_1e2(norm, cells):
    bar = mini_bar(norm)
    assert len(bar) == BAR_WIDTH and bar.count("█") == cells


def test_mini_bar_zero_norm_is_an_empty_bar():
    assert mini_bar(0.0) == "░" * BAR_WIDTH


def test_cli_watch_once_prints_one_frame_and_exits_0(known, capsys):
    """Captured output is no terminal: the CLI draws the wide table, every head's column by its
    full name, in the tag's order, with the known run's worked states."""
    assert main(["watch", "--once", "--run-id", known.run_id, "--tracking-uri", known.tracking_uri]) == 0
    out = capsys.readouterr().out
    (header,) = [ln for ln in out.splitlines() if ln.startswith("┃") and ln.split("┃")[2].strip() == "op"]
    assert [c.strip() for c in header.split("┃")[2:-1]] == HEADS
    assert _row(out, "state") == [STATES[h] for h in HEADS]
    assert out.count("run known (finished)  ·  iteration 3  ·  env steps 3072") == 1  # one frame, then exit


def test_cli_watch_unknown_run_exits_2_with_one_line(known, capsys):
    assert main(["watch", "--once", "--run-id", "0" * 32, "--tracking-uri", known.tracking_uri]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"gradmon-ray: no run with id or name '{'0' * 32}' at {known.tracking_uri}"


def test_cli_watch_unknown_experiment_exits_2(known, capsys):
    assert main(["watch", "--once", "--experiment", "nope", "--tracking-uri", known.tracking_uri]) == 2
    assert "no experiment named 'nope'" in capsys.readouterr().err


def test_cli_watch_unreachable_server_fails_fast_with_one_line(capsys):
    uri = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert main(["watch", "--once", "--experiment", "x", "--tracking-uri", uri]) == 2  # a bad environment
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"gradmon-ray: config error: --tracking-uri: no MLflow tracking server answers at {uri}")
    assert time.monotonic() - started < 30


def test_cli_watch_rejects_a_bad_interval(capsys):
    assert main(["watch", "--interval", "0"]) == 2
    assert "--interval: must be > 0" in capsys.readouterr().err


def test_live_watch_refreshes_until_the_run_ends(tmp_path):
    """A RUNNING run: the panel picks up a new iteration, and the loop ends when the run does."""
    uri = f"sqlite:///{tmp_path / 'live.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("live"))
    run_id = run.info.run_id
    name = mn.head_metric(mn.HEAD_GRAD_NORM, "op")
    client.log_metric(run_id, name, 0.5, step=1)
    refreshes = []

    def tick() -> bool:  # called once per refresh, before sleeping
        refreshes.append(1)
        if len(refreshes) == 1:
            client.log_metric(run_id, name, 0.9, step=2)
        elif len(refreshes) == 2:
            client.set_terminated(run_id)
        return len(refreshes) > 5  # safety net; the run's end must stop it first

    console = Console(record=True, width=120, color_system=None)
    last = watch(client, run_id=run_id, interval_s=0.05, console=console, should_stop=tick)
    assert last.status == "FINISHED" and last.iteration == 2 and len(refreshes) == 2
    assert last.metrics[name] == 0.9


STATES = dict(
    zip(
        HEADS,
        ["healthy", "dead", "exploding", "weak", "elevated", "missing", "healthy", "healthy", "healthy"],
        strict=True,
    )
)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_columns_follow_the_head_names_tag_whatever_order_the_metrics_were_logged_in(tmp_path, seed):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for known, tag, expected in shuffled_known_runs(uri, seed):
        text = _frame(known, run_id=known.run_id)
        (header,) = [ln for ln in text.splitlines() if ln.startswith("┃") and not ln.split("┃")[1].strip()]
        assert [c.strip() for c in header.split("┃")[2:-1]] == expected, tag
        assert _row(text, "state") == [STATES[h] for h in expected], tag


@pytest.mark.parametrize("with_codes", [True, False], ids=["logged-codes", "no-codes"])
def test_state_row_shows_the_band_the_learner_logged_and_the_value_head_by_its_own_edges(tmp_path, with_codes):
    """The value head at 3.0 is healthy by its own edges (elevated only by the action heads');
    where the learner logged a band (judged by the run's configured edges) the panel shows that one."""
    from mlflow.entities import Metric

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("bands")).info.run_id
    norms = {"op": 3.0, "slot": 1.0, "value": 3.0}
    # slot's logged code says exploding although 1.0 is healthy by default: the run had tighter edges.
    codes = {
        "op": mn.HEALTH_CODES["elevated"],
        "slot": mn.HEALTH_CODES["exploding"],
        "value": mn.HEALTH_CODES["healthy"],
    }
    metrics = [Metric(mn.head_metric(mn.HEAD_GRAD_NORM, h), v, 1000, 1) for h, v in norms.items()]
    if with_codes:
        metrics += [Metric(mn.head_metric(mn.HEAD_GRAD_HEALTH, h), float(c), 1000, 1) for h, c in codes.items()]
    client.log_batch(run_id, metrics=metrics)
    client.set_tag(run_id, mn.TAG_HEAD_NAMES, "op,slot,value")
    console = Console(record=True, width=220, color_system=None, force_terminal=False)
    watch(client, run_id=run_id, once=True, console=console)
    states = _row(console.export_text(), "state")
    assert states == (["elevated", "exploding", "healthy"] if with_codes else ["elevated", "healthy", "healthy"])


def _snap(metrics):
    return RunSnapshot("r", "run", "RUNNING", metrics, {}, ["op", "slot"], 3, ProbeView(None))


def test_latch_cells_read_their_own_latch():
    """``head_cells`` on a hand-made snapshot: each head's NaN and Inf cells show that head's own
    latch, and the state is the logged code (dead) though 0.5 is healthy by the default edges."""
    h = mn.head_metric
    snap = _snap(
        {
            h(mn.HEAD_GRAD_NORM, "op"): 0.5,
            h(mn.HEAD_GRAD_NORM, "slot"): 0.5,
            h(mn.HEAD_NAN_LATCH, "op"): 1.0,
            h(mn.HEAD_INF_LATCH, "op"): 0.0,
            h(mn.HEAD_NAN_LATCH, "slot"): 0.0,
            h(mn.HEAD_INF_LATCH, "slot"): 1.0,
            h(mn.HEAD_GRAD_HEALTH, "op"): 0.0,
            h(mn.HEAD_GRAD_TREND, "op"): -1.0,
        }
    )
    op, slot = head_cells(snap, "op"), head_cells(snap, "slot")
    assert op["NaN latch"].plain == LATCH_SET and op["Inf latch"].plain == LATCH_CLEAR
    assert slot["NaN latch"].plain == LATCH_CLEAR and slot["Inf latch"].plain == LATCH_SET
    assert op["state"].plain == "dead"  # the logged code, though 0.5 is healthy by default edges
    assert op["grad norm"].plain == "0.500 ↘"
    assert slot["state"].plain == "healthy"


def test_the_max_norm_row_shows_the_largest_minibatch_norm_and_its_minibatch(known):
    """A run that logged ``norm_max`` 5.5 at minibatch 2 for ``op`` (state "spiking", code 5) at its
    last iteration: the row shows ``5.500 @2`` and the state ``spiking``; a head without the metric
    shows ``—``.  A run that never logged it (the known run alone) has no such row."""
    assert "max norm" not in [
        ln.split("│")[1].strip() for ln in _frame(known, run_id=known.run_id).splitlines() if ln.startswith("│")
    ]
    client = MlflowClient(known.tracking_uri)
    step = max(m.step for m in client.get_metric_history(known.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, "op")))
    client.log_metric(known.run_id, mn.head_metric(mn.HEAD_GRAD_NORM_MAX, "op"), 5.5, step=step)
    client.log_metric(known.run_id, mn.head_metric(mn.HEAD_GRAD_NORM_ARGMAX, "op"), 2.0, step=step)
    client.log_metric(
        known.run_id, mn.head_metric(mn.HEAD_GRAD_HEALTH, "op"), float(mn.HEALTH_CODES["spiking"]), step=step
    )
    text = _frame(known, run_id=known.run_id)
    row = _row(text, "max norm")
    assert row[0] == "5.500 @2" and set(row[1:]) == {"—"}, row
    assert _row(text, "state")[0] == "spiking"
