"""``gradmon-ray tune``'s progress lines, its trials' run names and ``--num-samples``: no Ray.

The expected numbers are written out by hand (or computed with ``decimal``), the worst head is
fixed by construction from the documented band edges (action heads: healthy up to 2.0, exploding
above 5.0), never read back from the product.
"""

from __future__ import annotations

import math
import re
from decimal import ROUND_HALF_EVEN, Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import main
from gradmon_ray.app.sweep.progress import (
    MAX_RUN_NAME_LEN,
    fmt4,
    trial_count,
    trial_progress_line,
    trial_run_name,
    trial_summary_line,
)

NORM = mn.HEAD_GRAD_NORM


def _metrics(**norms: float) -> dict[str, float]:
    out = {mn.head_metric(NORM, head): value for head, value in norms.items()}
    out[mn.LEARNERS_UPDATED] = 1.0
    return out


def _significant_digits(text: str) -> int:
    mantissa = text.lstrip("-").split("e")[0].replace(".", "").lstrip("0")
    return len(mantissa)


@pytest.mark.parametrize(
    ("value", "printed"),
    [
        (-0.6523456789012345, "-0.6523"),  # what a return looked like (16 digits) before
        (8.684210526315789, "8.684"),
        (0.22615384615384615, "0.2262"),
        (17.049999999, "17.05"),
        (1234.5678, "1235"),
        (20480.0, "2.048e+04"),
        (0.000316227766, "0.0003162"),
        (2.0, "2"),
        (float("nan"), "n/a"),
        (None, "n/a"),
        ("x", "n/a"),
    ],
)
def test_fmt4_prints_four_significant_digits(value, printed):
    assert fmt4(value) == printed


@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12).filter(lambda x: x != 0))
def test_fmt4_is_the_value_rounded_to_four_significant_digits(x):
    exact = Decimal(x)
    quantum = Decimal(1).scaleb(exact.adjusted() - 3)  # the 4th significant digit's place
    expected = exact.quantize(quantum, rounding=ROUND_HALF_EVEN)
    printed = fmt4(x)
    assert _significant_digits(printed) <= 4, printed
    # the printed value is the decimal rounding of x (a carry, 9.9995 -> 10.00, shifts the place once)
    assert Decimal(printed) == expected or Decimal(printed) == expected.quantize(quantum * 10), (x, printed)


def test_progress_line_names_the_trial_iteration_return_and_the_exploding_head():
    metrics = _metrics(op=17.0493, slot=0.2261538, tempo=1.3, value=9.87654)
    metrics[mn.EPISODE_RETURN_MEAN] = -0.6523456789012345
    line = trial_progress_line("3f2a1_00001", 2, 4, metrics)
    assert line == "trial 3f2a1_00001 | iter 2/4 | return -0.6523 | worst head op 17.05 (exploding)"


def test_every_number_in_a_progress_line_has_at_most_four_significant_digits():
    metrics = _metrics(op=1.23456789, slot=0.0123456789, value=123.456789)
    metrics[mn.EPISODE_RETURN_MEAN] = 3.14159265358979
    line = trial_progress_line("abcde_00000", 7, 20, metrics)
    numbers = re.findall(r"-?\d+\.\d+(?:e[+-]\d+)?", line)
    assert numbers == ["3.142", "0.01235"]  # the return, then slot: weak (below 0.1), the worst action head
    assert "worst head slot 0.01235 (weak)" in line


def test_the_healthy_head_furthest_from_the_band_centre_is_the_worst_when_all_are_healthy():
    # healthy band 0.1..2.0, centre sqrt(0.1 * 2.0) = 0.447: 1.9 is further (on a log scale) than 0.3
    line = trial_progress_line("t_0", 1, 2, {**_metrics(op=0.3, slot=1.9), mn.EPISODE_RETURN_MEAN: 1.0})
    assert line.endswith("| worst head slot 1.9 (healthy)")


def test_value_head_is_not_the_worst_unless_asked():
    metrics = {**_metrics(op=0.5, value=400.0), mn.EPISODE_RETURN_MEAN: 0.0}
    assert "worst head op 0.5 (healthy)" in trial_progress_line("t_0", 1, 1, metrics)


def test_no_return_yet_no_update_and_no_telemetry_say_so():
    assert "return n/a" in trial_progress_line("t_0", 1, 2, _metrics(op=0.5))
    nan_return = {**_metrics(op=0.5), mn.EPISODE_RETURN_MEAN: math.nan}  # MetricCarry's NaN before an episode
    assert "return n/a" in trial_progress_line("t_0", 1, 2, nan_return)
    idle = {mn.LEARNERS_UPDATED: 0.0, mn.EPISODE_RETURN_MEAN: 1.0}
    assert trial_progress_line("t_0", 3, 4, idle) == "trial t_0 | iter 3/4 | return 1 | no update: nothing to train on"
    assert trial_progress_line("t_0", 1, 1, {mn.EPISODE_RETURN_MEAN: 1.0}).endswith("| telemetry off")


def test_latched_heads_and_a_stop_are_appended():
    metrics = {**_metrics(op=0.5, slot=0.5), mn.head_metric(mn.HEAD_NAN_LATCH, "slot"): 1.0}
    line = trial_progress_line("t_0", 2, 5, metrics, stop_reason="iteration 2: head 'op' exploding")
    assert line.endswith("| latched: slot | stopped: iteration 2: head 'op' exploding")


def test_tune_results_with_strings_in_them_are_read():
    """Tune's result dict carries strings (trial id, MLflow run id) beside the metrics."""
    result = {**_metrics(op=6.0), "trial_id": "t_0", "mlflow_run_id": "abc", mn.EPISODE_RETURN_MEAN: 2.5}
    assert trial_progress_line("t_0", 1, 1, result).endswith("worst head op 6 (exploding)")


def test_summary_line_prints_the_metric_at_four_significant_digits():
    line = trial_summary_line("t_1", "finished", 4, mn.EPISODE_RETURN_MEAN, 8.684210526315789, run_id="r1")
    assert line == f"trial t_1 finished | 4 iterations | {mn.EPISODE_RETURN_MEAN} 8.684 | MLflow run r1"
    assert trial_summary_line("t_2", "failed", 0, "m", None).endswith("| m n/a")


def test_trial_run_names_are_distinct_and_name_the_sweep_trial_and_values():
    a = trial_run_name("vgs_sweep", "3f2a1_00000", {"ppo.lr": 0.000316227766, "vgs.beta": 0.99})
    b = trial_run_name("vgs_sweep", "3f2a1_00001", {"ppo.lr": 0.000316227766, "vgs.beta": 0.99})
    assert a == "vgs_sweep-3f2a1_00000 (ppo.lr=0.0003162, vgs.beta=0.99)" and a != b
    assert trial_run_name("heads", "t_0", {"model.head_logit_scale": {"op": 100.0}}) == (
        'heads-t_0 (model.head_logit_scale={"op":100.0})'
    )
    assert trial_run_name("s", "t_0", {}) == "s-t_0"
    long = trial_run_name("s", "t_0", {f"k{i}": "v" * 20 for i in range(20)})
    assert len(long) == MAX_RUN_NAME_LEN and long.startswith("s-t_0 (") and long.endswith("...")


def test_trial_count_is_samples_times_the_grid():
    space = {"a": {"grid": [1, 2, 3]}, "b": {"choice": [1, 2]}, "c": {"grid": [[1], [2]]}, "d": 5}
    assert trial_count(space, 2) == 12 and trial_count({"a": {"choice": [1]}}, 3) == 3


# --- --num-samples ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [("0", "must be >= 1, got 0"), ("-2", "must be >= 1, got -2"), ("two", "must be a whole number >= 1, got 'two'")],
)
def test_num_samples_below_one_or_not_a_number_exits_2_with_one_line(raw, message, capsys):
    assert main(["tune", "tune_configs/vgs_sweep.yaml", "--num-samples", raw]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gradmon-ray: config error: --num-samples: {message}"]


def test_num_samples_overrides_the_sweep_files(monkeypatch, tmp_path, capsys):
    import gradmon_ray.app.sweep.run
    from gradmon_ray.app.sweep.config import load_sweep

    file_samples = load_sweep("tune_configs/vgs_sweep.yaml")[0].num_samples
    seen = {}

    def fake_run_sweep(sweep, base, progress=None, cfg=None):
        seen["num_samples"] = sweep.num_samples
        return type("Outcome", (), {"parent_run_id": "p", "best": None, "trials": []})()

    monkeypatch.setattr(gradmon_ray.app.sweep.run, "run_sweep", fake_run_sweep)
    argv = ["tune", "tune_configs/vgs_sweep.yaml", "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"]
    main([*argv, "--num-samples", "3"])
    assert seen["num_samples"] == 3 != file_samples
    assert "3 trials of 20 iterations" in capsys.readouterr().out
    main(argv)
    assert seen["num_samples"] == file_samples == 8


def test_the_value_head_is_the_worst_when_asked_and_a_declared_value_head_is_one():
    """Asked to, the value head counts: 400 is exploding by the value bands' edges (1e-3 .. 100 by
    default, checked on the BandSet itself); a head the run declares a value head ('critic') is left
    out unless asked, like ``value``."""
    from gradmon_ray.app.sweep.progress import worst_of
    from gradmon_ray.telemetry.bands import DEFAULT_BANDS

    metrics = {**_metrics(op=0.5, value=400.0), mn.EPISODE_RETURN_MEAN: 0.0}
    assert DEFAULT_BANDS.value.elevated_max < 400.0  # the premise: exploding for a value head
    line = trial_progress_line("t_0", 1, 1, metrics, include_value_head=True)
    assert line.endswith("| worst head value 400 (exploding)")
    assert worst_of(metrics, DEFAULT_BANDS) == ("op", 0.5, "healthy")  # not asked: the value head left out
    critic = {**_metrics(op=0.5, critic=400.0), mn.EPISODE_RETURN_MEAN: 0.0}
    declared = DEFAULT_BANDS.with_value_heads(["critic"])
    assert worst_of(critic, declared) == ("op", 0.5, "healthy")
    assert trial_progress_line("t_0", 1, 1, critic, bands=declared).endswith("| worst head op 0.5 (healthy)")


def test_the_bands_given_are_the_bands_judged_by():
    """A run's own edges (telemetry.bands): 0.5 is healthy by the defaults, elevated when the
    healthy band ends at 0.3."""
    from gradmon_ray.telemetry.bands import BandSet

    tight = BandSet.from_dict({"action": {"dead_below": 1e-4, "weak_below": 1e-2, "healthy_max": 0.3}})
    metrics = {**_metrics(op=0.5), mn.EPISODE_RETURN_MEAN: 0.0}
    assert trial_progress_line("t_0", 1, 1, metrics).endswith("| worst head op 0.5 (healthy)")
    assert trial_progress_line("t_0", 1, 1, metrics, bands=tight).endswith("| worst head op 0.5 (elevated)")


def test_a_trial_a_health_rule_stopped_says_why_in_its_summary():
    line = trial_summary_line("t_3", "stopped", 2, "m", 1.0, run_id="r3", stop_reason="iteration 2: head 'op' dead")
    assert line == "trial t_3 stopped | 2 iterations | m 1 | MLflow run r3 | stopped: iteration 2: head 'op' dead"
