"""Audit oracles for the panel's per-head cells: built from a hand-made snapshot, no MLflow."""

from __future__ import annotations

import numpy as np
import pytest

from gradmon_ray import metric_names as mn
from gradmon_ray.viz.panel import LATCH_CLEAR, LATCH_SET, head_cells
from gradmon_ray.viz.plots import norm_matrix
from gradmon_ray.viz.runs import ProbeView, RunHistory, RunSnapshot, head_band

# The codes written out (metric_names.HEALTH_CODES is what the learner logs).
CODES = {-1: "missing", 0: "dead", 1: "weak", 2: "healthy", 3: "elevated", 4: "exploding"}


@pytest.mark.parametrize("code", sorted(CODES))
def test_the_logged_health_code_wins_over_the_default_edges(code):
    # norm 0.5 is "healthy" by the default edges; a run with its own edges logged another code
    assert head_band(float(code), 0.5, "op") == CODES[code]
    assert head_band(float(code), 0.5, "value") == CODES[code]


def test_without_a_code_the_head_is_judged_by_its_own_default_edges():
    assert head_band(None, 5.0, "value") == "healthy"  # value head: healthy up to 10
    assert head_band(None, 5.0, "op") == "elevated"  # action heads: healthy up to 2
    assert head_band(None, None, "op") == "missing"


def _snap(metrics):
    return RunSnapshot("r", "run", "RUNNING", metrics, {}, ["op", "slot"], 3, ProbeView(None))


def test_latch_cells_read_their_own_latch():
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


def test_heatmap_matrix_has_one_row_per_head_and_a_column_for_every_logged_step():
    h = mn.head_metric
    series = {
        h(mn.HEAD_GRAD_NORM, "op"): {1: 0.5, 2: 0.25},
        h(mn.HEAD_GRAD_NORM, "slot"): {2: 1.5, 4: 3.0},  # joins late, skips step 3
        h(mn.HEAD_GRAD_NORM, "value"): {3: 7.0},
    }
    history = RunHistory("r", ["op", "slot", "value"], series, {}, {})
    heads, steps, matrix = norm_matrix(history)
    assert heads == ["op", "slot", "value"] and steps == [1, 2, 3, 4]
    nan = float("nan")
    expected = np.array([[0.5, 0.25, nan, nan], [nan, 1.5, nan, 3.0], [nan, nan, 7.0, nan]])
    np.testing.assert_array_equal(matrix, expected)
