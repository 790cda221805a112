"""Audit oracles for the spill file format and the result-dict mapping (worked answers)."""

from __future__ import annotations

import json
import math

import pytest

from gradmon_ray.tracking.spill import SpillWriter, _decode, read_spill, replayed_iterations


def _strict(text: str):
    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_spill_lines_are_strict_json_and_non_finite_values_round_trip(tmp_path):
    path = tmp_path / "run.jsonl"
    writer = SpillWriter(path, {"tracking_uri": "sqlite:///x.db", "experiment": "e"})
    values = {"pos": math.inf, "neg": -math.inf, "nan": math.nan, "x": 1.25}
    assert writer.write_iterations([(3, 1000, values, {"t": "a"})], run_id=None) == 1
    writer.write_trailer("rid", "FINISHED")
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3
    for line in lines:  # every line parses without NaN / Infinity extensions
        _strict(line)
    header, iterations, trailer = read_spill(path)
    assert header["experiment"] == "e" and trailer == {"final": True, "run_id": "rid", "status": "FINISHED"}
    (record,) = iterations
    assert record["step"] == 3 and record["tags"] == {"t": "a"}
    decoded = {k: _decode(v) for k, v in record["metrics"].items()}
    assert decoded["pos"] == math.inf and decoded["neg"] == -math.inf and math.isnan(decoded["nan"])
    assert decoded["x"] == 1.25


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([{"step": 1, "metrics": {"a": 1}}, {"step": 1, "metrics": {"b": 2}}], 1),  # same step twice
        ([{"step": 1, "metrics": {"a": 1}}, {"step": 2, "metrics": {}, "tags": {"t": "x"}}], 1),  # tags only
        ([{"step": 1, "metrics": {"a": 1}}, {"step": 2, "metrics": {"a": 2}}], 2),
    ],
)
def test_replayed_iterations_counts_distinct_steps_with_metrics(records, expected):
    assert replayed_iterations(records) == expected
