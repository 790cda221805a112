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


def test_logp_sums_mark_each_head_the_way_the_drain_reads_them():
    """The learner's one-kernel path: per-head sums, NaN where a head had a NaN log-prob and
    +-Inf where it had an infinite one, read by the accumulator's drain into the same latch
    lanes the explicit flags give (worked cases by hand; a NaN next to an Inf in the same head
    and minibatch shows as NaN only, as documented)."""
    from gradmon_ray.telemetry import GradientNorms, IterationAccumulator, TelemetryLayout, logp_sums

    nan, inf = float("nan"), float("inf")
    lp = torch.tensor([[-0.1, nan, -inf, -0.2, nan], [-0.3, -0.5, -0.7, -inf, -inf]])  # 2 rows, 5 heads
    sums = logp_sums(lp)
    assert torch.isnan(sums[1]) and sums[2] == -inf and sums[3] == -inf and torch.isnan(sums[4])
    assert sums[0].item() == pytest.approx(-0.4)
    layout = TelemetryLayout(num_reported=1, num_action_heads=5)
    norms = GradientNorms(torch.ones(1), torch.ones(()), torch.zeros(()), torch.zeros(()))
    acc = IterationAccumulator(layout)
    acc.add_minibatch_logp_sums(norms, sums, torch.zeros(()))
    lanes, _, _ = acc.drain()
    assert lanes[layout.logp_nan].tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]  # head 4: NaN and -Inf -> NaN only
    assert lanes[layout.logp_inf].tolist() == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert lanes[layout.minibatches] == 1.0


def test_records_fold_to_the_sums_and_a_drain_starts_over():
    from gradmon_ray.telemetry import GradientNorms, IterationAccumulator, TelemetryLayout

    layout = TelemetryLayout(num_reported=2, num_action_heads=1)
    acc = IterationAccumulator(layout)
    for k in range(5):
        norms = GradientNorms(
            torch.tensor([1.0 + k, float("nan")]), torch.tensor(2.0), torch.tensor(3.0), torch.zeros(())
        )
        acc.add_minibatch(norms, torch.zeros(1), torch.zeros(1), torch.tensor(float(k % 2)))
    lanes, _, _ = acc.drain()
    assert lanes[layout.norm_sum].tolist() == [15.0, 0.0] and lanes[layout.norm_count].tolist() == [5.0, 0.0]
    assert lanes[layout.global_norm_sum] == 10.0 and lanes[layout.nan_grad_count] == 15.0
    assert lanes[layout.skipped] == 2.0 and lanes[layout.minibatches] == 5.0
    again, _, _ = acc.drain()  # a drain starts the next iteration empty
    assert again[layout.minibatches] == 0.0 and again[layout.norm_sum].tolist() == [0.0, 0.0]


def test_iteration_logp_flags_are_exact_per_kind_and_respect_the_mask():
    """The learner's path (``add_minibatch_logp``: log-probs by reference, checked at the drain):
    worked cases by hand over two minibatches of different sizes.  Unlike per-minibatch sums, a
    NaN next to an Inf in the same head and minibatch sets BOTH latches; a padded row (mask
    False) never latches, whatever it holds."""
    from gradmon_ray.telemetry import GradientNorms, IterationAccumulator, TelemetryLayout

    nan, inf = float("nan"), float("inf")
    layout = TelemetryLayout(num_reported=1, num_action_heads=4)
    norms = GradientNorms(torch.ones(1), torch.ones(()), torch.zeros(()), torch.zeros(()))
    acc = IterationAccumulator(layout)
    # minibatch 1: head 0 NaN and -Inf; head 3 NaN only in a padded row (mask False)
    first = torch.tensor([[nan, -0.1, -0.2, -0.3], [-inf, -0.1, -0.2, nan], [-0.5, -0.1, -0.2, -0.3]])
    acc.add_minibatch_logp(norms, first, torch.zeros(()), torch.tensor([True, False, True]))
    # minibatch 2 (no mask, 2 rows): head 1 +Inf, head 2 NaN
    acc.add_minibatch_logp(norms, torch.tensor([[-0.1, inf, -0.2, -0.3], [-0.1, -0.2, nan, -0.3]]), torch.zeros(()))
    lanes, _, _ = acc.drain()
    # head 0: NaN (row 0, kept) and -Inf only in the padded row 1 -> NaN latch, no Inf latch
    assert lanes[layout.logp_nan].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert lanes[layout.logp_inf].tolist() == [0.0, 1.0, 0.0, 0.0]
    acc.add_minibatch_logp(norms, torch.tensor([[nan, -0.1, -0.2, -inf], [-inf, -0.1, -0.2, nan]]), torch.zeros(()))
    lanes, _, _ = acc.drain()  # both kinds in heads 0 and 3 of one minibatch: both latches
    assert lanes[layout.logp_nan].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert lanes[layout.logp_inf].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert lanes[layout.minibatches] == 1.0


def test_iteration_logp_flags_finite_values_whose_sum_overflows_never_latch():
    """Finite log-probs whose sum overflows to -Inf latch nothing (the test is per element, not a
    sum); and an all-finite iteration next to a later NaN one latches only the head that held the NaN."""
    from gradmon_ray.telemetry import GradientNorms, IterationAccumulator, TelemetryLayout

    layout = TelemetryLayout(num_reported=1, num_action_heads=3)
    norms = GradientNorms(torch.ones(1), torch.ones(()), torch.zeros(()), torch.zeros(()))
    acc = IterationAccumulator(layout)
    big = torch.finfo(torch.float32).min  # finite: the most negative float32
    acc.add_minibatch_logp(norms, torch.tensor([[big, -0.1, -0.2], [big, -0.3, -0.4]]), torch.zeros(()))
    acc.add_minibatch_logp(norms, torch.tensor([[big, -0.5, -0.6]]), torch.zeros(()), torch.tensor([True]))
    lanes, _, _ = acc.drain()
    assert lanes[layout.logp_nan].tolist() == [0.0, 0.0, 0.0]
    assert lanes[layout.logp_inf].tolist() == [0.0, 0.0, 0.0]
    acc.add_minibatch_logp(norms, torch.tensor([[-0.1, -0.2, -0.3]]), torch.zeros(()))
    acc.add_minibatch_logp(norms, torch.tensor([[-0.1, float("nan"), -0.3]]), torch.zeros(()))
    lanes, _, _ = acc.drain()
    assert lanes[layout.logp_nan].tolist() == [0.0, 1.0, 0.0]
    assert lanes[layout.logp_inf].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_iteration_logp_flags_an_inf_alone_latches_inf_in_every_dtype(dtype):
    """The drain's CPU shortcut only clears an iteration whose sum is finite; one -Inf and no NaN
    must still latch Inf (not NaN, not nothing), and so must a NaN alone, in float32, float16 and
    bfloat16 (which numpy cannot hold: it takes the exact test).  A one-element skip flag counts."""
    from gradmon_ray.telemetry import GradientNorms, IterationAccumulator, TelemetryLayout

    layout = TelemetryLayout(num_reported=1, num_action_heads=3)
    norms = GradientNorms(torch.ones(1), torch.ones(()), torch.zeros(()), torch.zeros(()))
    acc = IterationAccumulator(layout)
    rows = torch.tensor([[-0.1, float("-inf"), -0.3], [-0.2, -0.4, -0.6]], dtype=dtype)
    acc.add_minibatch_logp(norms, rows, torch.ones(1))
    lanes, _, _ = acc.drain()
    assert lanes[layout.logp_inf].tolist() == [0.0, 1.0, 0.0]
    assert lanes[layout.logp_nan].tolist() == [0.0, 0.0, 0.0]
    assert lanes[layout.skipped] == 1.0
    acc.add_minibatch_logp(norms, torch.tensor([[float("nan"), -0.1, -0.2]], dtype=dtype), torch.zeros(()))
    lanes, _, _ = acc.drain()
    assert lanes[layout.logp_nan].tolist() == [1.0, 0.0, 0.0]
    assert lanes[layout.logp_inf].tolist() == [0.0, 0.0, 0.0]
    acc.add_minibatch_logp(norms, torch.tensor([[-0.5, -0.1, -0.2]], dtype=dtype), torch.zeros(()))
    lanes, _, _ = acc.drain()
    assert lanes[layout.logp_nan].tolist() == [0.0, 0.0, 0.0] and lanes[layout.logp_inf].tolist() == [0.0, 0.0, 0.0]


def test_logp_flags_are_float_zero_one_per_head():
    """Documented as float tensors: per head 1.0 where any entry is NaN (resp. +-Inf)."""
    logp = torch.tensor([[[-1.0, float("nan"), -2.0]], [[float("-inf"), -0.5, float("inf")]]])
    nan, inf = logp_nonfinite_flags(logp)
    assert nan.dtype == torch.float32 and inf.dtype == torch.float32
    assert nan.tolist() == [0.0, 1.0, 0.0] and inf.tolist() == [1.0, 0.0, 1.0]
    assert (nan + nan).tolist() == [0.0, 2.0, 0.0]  # flags add up as numbers (a bool tensor would OR)


@pytest.mark.parametrize(("nan_flags", "inf_flags"), [([0.0], [0.0, 0.0]), ([0.0, 0.0], [0.0])])
def test_head_latches_reject_a_wrong_length_for_either_kind_alone(nan_flags, inf_flags):
    latches = HeadLatches(("op", "slot"))
    with pytest.raises(ValueError, match="expected 2 flags per kind"):
        latches.update(nan_flags, inf_flags, 1)
