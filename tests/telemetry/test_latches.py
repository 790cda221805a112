"""TELE-302/303 latches: detection on device, OR-latch semantics, persistence."""

from __future__ import annotations

import pytest
import torch

from gradmon_ray.telemetry import HeadLatches, logp_nonfinite_flags

HEADS = ("op", "slot", "tempo")


def test_flags_separate_nan_from_inf_per_head():
    lp = torch.zeros(4, 3)
    lp[2, 1] = float("nan")
    lp[0, 2] = float("-inf")
    lp[3, 2] = float("nan")
    nan, inf = logp_nonfinite_flags(lp)
    assert nan.tolist() == [0.0, 1.0, 1.0]
    assert inf.tolist() == [0.0, 0.0, 1.0]


def test_flags_clean_and_time_major_shapes():
    nan, inf = logp_nonfinite_flags(torch.randn(2, 5, 3))
    assert nan.tolist() == [0.0] * 3 and inf.tolist() == [0.0] * 3


def test_latches_prepopulated_and_latch_only_the_flagged_head():
    latches = HeadLatches(HEADS)
    assert latches.nan == {h: False for h in HEADS} and latches.inf == {h: False for h in HEADS}
    latches.update([0, 1, 0], [0, 0, 0], iteration=3)
    assert latches.latched("nan") == ["slot"]
    assert latches.latched("inf") == []
    assert latches.nan_first_iteration == {"slot": 3}


def test_latch_never_resets_and_keeps_first_iteration():
    latches = HeadLatches(HEADS)
    latches.update([1, 0, 0], [0, 0, 1], iteration=2)
    for it in range(3, 10):
        latches.update([0, 0, 0], [0, 0, 0], iteration=it)
    latches.update([1, 0, 0], [0, 0, 1], iteration=10)
    assert latches.latched("nan") == ["op"] and latches.latched("inf") == ["tempo"]
    assert latches.nan_first_iteration == {"op": 2} and latches.inf_first_iteration == {"tempo": 2}


def test_latch_state_round_trip_and_head_mismatch():
    latches = HeadLatches(HEADS)
    latches.update([0, 0, 1], [1, 0, 0], iteration=5)
    restored = HeadLatches.from_state_dict(latches.state_dict(), HEADS)
    assert restored == latches
    with pytest.raises(ValueError, match="heads"):
        HeadLatches.from_state_dict(latches.state_dict(), ("op", "slot"))


def test_update_rejects_wrong_length():
    with pytest.raises(ValueError, match="expected 3 flags"):
        HeadLatches(HEADS).update([0, 0], [0, 0], iteration=1)
