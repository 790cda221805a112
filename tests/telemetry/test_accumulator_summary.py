"""``telemetry/accumulator.py`` and ``tracker.py``: on-device accumulation and the once-per-iteration
summary, against hand-computed means (an Inf norm stays in the mean, a NaN is left out)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry import GradientNormPlan, GradientNorms, IterationAccumulator, TelemetryTracker
from gradmon_ray.telemetry.norm_records import NormRecords

REPORTED = ("op", "slot", "value")
ACTION = ("op", "slot")


def _norms(heads, global_norm, nan=0.0, inf=0.0) -> GradientNorms:
    return GradientNorms(
        torch.tensor(heads, dtype=torch.float32),
        torch.tensor(global_norm, dtype=torch.float32),
        torch.tensor(nan),
        torch.tensor(inf),
    )


def _run_iteration(tracker, acc, minibatches):
    for norms, nan_flags, inf_flags, skipped in minibatches:
        acc.add_minibatch(norms, torch.tensor(nan_flags), torch.tensor(inf_flags), torch.tensor(skipped))
    return tracker.finish_iteration(acc.drain()[0])


def test_means_leave_out_nan_keep_inf_and_count_skips():
    tracker = TelemetryTracker(REPORTED, ACTION)
    acc = IterationAccumulator(tracker.layout)
    summary = _run_iteration(
        tracker,
        acc,
        [
            (_norms([1.0, 0.5, 2.0], 3.0), [0.0, 0.0], [0.0, 0.0], 0.0),
            (_norms([3.0, float("nan"), 4.0], float("nan"), nan=7), [0.0, 1.0], [0.0, 0.0], 1.0),
            (_norms([2.0, 1.5, 0.0], 1.0, inf=2), [0.0, 0.0], [1.0, 0.0], 0.0),
        ],
    )
    assert summary.head_norms["op"] == pytest.approx(2.0)  # (1+3+2)/3
    assert summary.head_norms["slot"] == pytest.approx(1.0)  # (0.5+1.5)/2, NaN left out
    assert summary.head_norms["value"] == pytest.approx(2.0)  # (2+4+0)/3
    assert summary.global_norm == pytest.approx(2.0)  # (3+1)/2
    assert summary.nan_grad_count == 7 and summary.inf_grad_count == 2
    assert summary.minibatches == 3 and summary.skipped == 1 and summary.skipped_total == 1
    assert summary.nan_latched == {"op": False, "slot": True}
    assert summary.inf_latched == {"op": True, "slot": False}
    assert summary.nan_first_iteration == {"slot": 1} and summary.inf_first_iteration == {"op": 1}
    assert summary.health == {"op": "healthy", "slot": "healthy", "value": "healthy"}
    assert summary.head_norm_cv == pytest.approx(1.0 / 3.0)  # op 2, slot 1: mean 1.5, std 0.5
    assert acc.buffer.abs().sum().item() == 0.0  # drained


def test_head_without_any_grad_is_missing_and_keeps_prev():
    tracker = TelemetryTracker(REPORTED, ACTION)
    acc = IterationAccumulator(tracker.layout)
    first = _run_iteration(tracker, acc, [(_norms([1.0, 0.05, 0.001], 1.0), [0, 0], [0, 0], 0.0)])
    assert first.health == {"op": "healthy", "slot": "weak", "value": "dead"}
    assert all(math.isnan(v) for v in first.head_norms_prev.values())
    assert first.trends == {"op": "→", "slot": "→", "value": "→"}
    second = _run_iteration(tracker, acc, [(_norms([1.5, float("nan"), 0.001], 1.0), [0, 0], [0, 0], 0.0)])
    assert math.isnan(second.head_norms["slot"]) and second.health["slot"] == "missing"
    assert second.head_norms_prev == {"op": 1.0, "slot": pytest.approx(0.05), "value": pytest.approx(0.001)}
    assert second.trends["op"] == "↗"
    third = _run_iteration(tracker, acc, [(_norms([1.0, 0.2, 0.001], 1.0), [0, 0], [0, 0], 0.0)])
    assert third.head_norms_prev["slot"] == pytest.approx(0.05)  # last known value survives a gap
    assert third.trends == {"op": "↘", "slot": "↗", "value": "→"}


def test_an_iteration_whose_every_norm_is_nan_reports_nan_not_zero():
    """No finite norm at all (every minibatch NaN): the global norm and the heads are missing
    (NaN), never 0 (a 0 would read as a dead network); the values are plain Python floats."""
    tracker = TelemetryTracker(REPORTED, ACTION)
    acc = IterationAccumulator(tracker.layout)
    nan = float("nan")
    summary = _run_iteration(tracker, acc, [(_norms([nan, nan, nan], nan, nan=4), [0.0, 0.0], [0.0, 0.0], 1.0)] * 2)
    assert math.isnan(summary.global_norm)
    assert all(math.isnan(v) for v in summary.head_norms.values())
    assert summary.health == {"op": "missing", "slot": "missing", "value": "missing"}
    assert summary.nan_grad_count == 8.0 and summary.skipped == 2
    metrics = summary.to_metrics()
    assert all(type(v) is float for v in metrics.values())  # what RLlib's fast-path Stats expects


def test_norms_are_the_float64_ratio_of_the_drained_lanes_exactly():
    """Each mean is sum / count in float64, bit for bit (no float32 detour, no clamped count)."""
    tracker = TelemetryTracker(REPORTED, ACTION)
    lay = tracker.layout
    lanes = np.zeros(lay.size)
    lanes[lay.norm_sum] = [1.0, 2.0, 0.1]
    lanes[lay.norm_count] = [3.0, 3.0, 7.0]
    lanes[lay.global_norm_sum], lanes[lay.global_norm_count] = 0.7, 3.0
    summary = tracker.finish_iteration(lanes)
    assert summary.head_norms == {"op": 1.0 / 3.0, "slot": 2.0 / 3.0, "value": 0.1 / 7.0}
    assert summary.global_norm == 0.7 / 3.0


def test_latches_and_counters_survive_state_round_trip():
    tracker = TelemetryTracker(REPORTED, ACTION)
    acc = IterationAccumulator(tracker.layout)
    _run_iteration(tracker, acc, [(_norms([1, 1, 1], 1.0, nan=3), [1, 0], [0, 0], 1.0)])
    restored = TelemetryTracker(REPORTED, ACTION)
    restored.load_state_dict(tracker.state_dict())
    clean = _run_iteration(
        restored, IterationAccumulator(restored.layout), [(_norms([1, 1, 1], 1.0), [0, 0], [0, 0], 0)]
    )
    assert clean.iteration == 2
    assert clean.nan_latched == {"op": True, "slot": False} and clean.nan_first_iteration == {"op": 1}
    assert clean.skipped_total == 1 and clean.skipped == 0
    with pytest.raises(ValueError, match="heads"):
        TelemetryTracker(("a", "value"), ("a",)).load_state_dict(tracker.state_dict())


def test_to_metrics_names_and_codes():
    tracker = TelemetryTracker(REPORTED, ACTION)
    acc = IterationAccumulator(tracker.layout)
    summary = _run_iteration(tracker, acc, [(_norms([7.0, 0.5, 0.001], 7.0), [0, 1], [0, 0], 0.0)])
    metrics = summary.to_metrics()
    assert metrics["grad/head/op/norm"] == pytest.approx(7.0)
    assert metrics["grad/head/op/health"] == mn.HEALTH_CODES["exploding"]
    assert metrics["grad/head/value/health"] == mn.HEALTH_CODES["dead"]
    assert metrics["latch/nan/slot"] == 1.0 and metrics["latch/nan/op"] == 0.0
    assert metrics["latch/nan/slot/first_iteration"] == 1.0
    assert "latch/nan/op/first_iteration" not in metrics
    assert "latch/nan/value" not in metrics  # the value head has no log-probs
    assert metrics[mn.TELEMETRY_ITERATION] == 1.0


def test_finish_iteration_rejects_wrong_layout():
    tracker = TelemetryTracker(REPORTED, ACTION)
    with pytest.raises(ValueError, match="lanes"):
        tracker.finish_iteration(np.zeros(3))
    acc = IterationAccumulator(tracker.layout)
    lanes, reduced, local = acc.drain(reduced_extra=torch.tensor([7.0, 8.0]), local_extra=torch.tensor([9.0]))
    assert lanes.shape == (tracker.layout.size,) and reduced.tolist() == [7.0, 8.0] and local.tolist() == [9.0]
    assert acc.drain()[1].size == 0 and acc.drain()[2].size == 0
    with pytest.raises(ValueError, match="subset"):
        TelemetryTracker(("a", "b"), ("c",))


@pytest.mark.parametrize(("reported", "action"), [(1, 1), (3, 2), (9, 8)])
def test_layout_lanes_are_disjoint_and_cover_the_buffer(reported, action):
    from gradmon_ray.telemetry import TelemetryLayout

    lay = TelemetryLayout(reported, action)
    owner = [None] * lay.size
    lanes = {
        "norm_sum": lay.norm_sum,
        "norm_count": lay.norm_count,
        "logp_nan": lay.logp_nan,
        "logp_inf": lay.logp_inf,
        **{
            k: slice(getattr(lay, k), getattr(lay, k) + 1)
            for k in (
                "global_norm_sum",
                "global_norm_count",
                "nan_grad_count",
                "inf_grad_count",
                "skipped",
                "minibatches",
            )
        },
    }
    for name, sl in lanes.items():
        for i in range(sl.start, sl.stop):
            assert owner[i] is None, (name, owner[i])
            owner[i] = name
    assert None not in owner
    assert lay.logp_nan.start == lay.num_sum_lanes  # every MAX lane comes after every SUM lane


def test_merge_replicas_worked_answer():
    """Two replicas after one SUM: ratio lanes untouched, replicated counts halved, flags OR'd."""
    tracker = TelemetryTracker(REPORTED, ACTION)
    lay = tracker.layout
    summed = np.zeros(lay.size)
    summed[lay.norm_sum] = [4.0, 2.0, 6.0]  # 2 replicas x (2, 1, 3) over one minibatch each
    summed[lay.norm_count] = [2.0, 2.0, 2.0]
    summed[lay.global_norm_sum], summed[lay.global_norm_count] = 8.0, 2.0
    summed[lay.nan_grad_count], summed[lay.inf_grad_count] = 6.0, 0.0
    summed[lay.skipped], summed[lay.minibatches] = 2.0, 2.0
    summed[lay.logp_nan] = [0.0, 1.0]  # only one replica saw a NaN in "slot"
    summed[lay.logp_inf] = [2.0, 0.0]
    merged = lay.merge_replicas(summed, world_size=2)
    assert merged[lay.norm_sum].tolist() == [4.0, 2.0, 6.0] and merged[lay.norm_count].tolist() == [2.0] * 3
    assert merged[lay.nan_grad_count] == 3.0 and merged[lay.skipped] == 1.0 and merged[lay.minibatches] == 1.0
    assert merged[lay.logp_nan].tolist() == [0.0, 1.0] and merged[lay.logp_inf].tolist() == [1.0, 0.0]
    assert np.array_equal(lay.merge_replicas(summed, world_size=1), summed)  # one replica: unchanged
    summary = tracker.finish_iteration(merged)
    assert summary.head_norms == {"op": 2.0, "slot": 1.0, "value": 3.0} and summary.global_norm == 4.0
    assert summary.skipped == 1 and summary.nan_latched == {"op": False, "slot": True}


@pytest.mark.parametrize("on_device", [True, False])
def test_drain_reduces_once_on_device_or_on_the_host_copy(on_device):
    """A stand-in for a 2-replica SUM allreduce whose peer holds identical values."""
    tracker = TelemetryTracker(REPORTED, ACTION)
    acc = IterationAccumulator(tracker.layout)
    acc.add_minibatch(
        _norms([1.0, 2.0, 3.0], 4.0, nan=5), torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0]), torch.tensor(1.0)
    )
    calls = []

    def double(t):
        calls.append(t.device.type)
        t.mul_(2)

    lanes, reduced, local = acc.drain(
        reduced_extra=torch.tensor([3.0]),
        local_extra=torch.tensor([7.0]),
        allreduce=double,
        reduce_on_device=on_device,
        world_size=2,
    )
    assert len(calls) == 1  # exactly one reduction
    summary = tracker.finish_iteration(lanes)
    assert summary.head_norms == {"op": 1.0, "slot": 2.0, "value": 3.0}
    assert summary.nan_grad_count == 5.0 and summary.skipped == 1 and summary.minibatches == 1
    assert summary.nan_latched == {"op": False, "slot": True}
    assert reduced.tolist() == [6.0] and local.tolist() == [7.0]  # the local part is not reduced
    assert acc.buffer.abs().sum().item() == 0.0


def _one_iteration(tracker, heads):
    acc = IterationAccumulator(tracker.layout)
    zeros = [0.0] * len(tracker.action_heads)
    return _run_iteration(tracker, acc, [(_norms(heads, 1.0), zeros, zeros, 0.0)])


def test_tracker_judges_the_value_head_by_its_own_bands():
    """A value norm of 3.0 is healthy for the critic; the action heads' edges called it elevated."""
    summary = _one_iteration(TelemetryTracker(("op", "slot", "value"), ("op", "slot")), [3.0, 0.05, 3.0])
    assert summary.health == {"op": "elevated", "slot": "weak", "value": "healthy"}
    metrics = summary.to_metrics()
    assert metrics[mn.head_metric(mn.HEAD_GRAD_HEALTH, "value")] == mn.HEALTH_CODES["healthy"]
    assert metrics[mn.head_metric(mn.HEAD_GRAD_HEALTH, "op")] == mn.HEALTH_CODES["elevated"]
    assert summary.worst_head() == ("slot", "weak")  # 0.05 is further (log scale) from sqrt(0.2) than 3.0
    at_six = _one_iteration(TelemetryTracker(("op", "value"), ("op",)), [1.0, 6.0])
    assert at_six.health["value"] == "healthy" and at_six.worst_head()[1] == "healthy"


def test_an_inf_norm_stays_in_the_mean_and_reads_exploding_while_nan_is_left_out():
    tracker = TelemetryTracker(REPORTED, ACTION)
    acc = IterationAccumulator(tracker.layout)
    zeros = torch.zeros(2)
    for norms, skipped in (
        (_norms([1.0, 0.5, 2.0], 3.0), 0.0),
        (_norms([float("inf"), float("nan"), 4.0], float("inf"), inf=3), 1.0),
    ):
        acc.add_minibatch(norms, zeros, zeros, torch.tensor(skipped))
    summary = tracker.finish_iteration(acc.drain()[0])
    assert summary.head_norms["op"] == math.inf  # (1 + inf) / 2: an Inf is data, not "missing"
    assert summary.head_norms["slot"] == pytest.approx(0.5)  # NaN left out: 0.5 / 1
    assert summary.head_norms["value"] == pytest.approx(3.0)
    assert summary.global_norm == math.inf
    assert summary.health["op"] == "exploding" and summary.health["slot"] == "healthy"
    assert summary.inf_grad_count == 3.0 and summary.skipped == 1 and summary.minibatches == 2
    metrics = summary.to_metrics()
    assert metrics[mn.head_metric(mn.HEAD_GRAD_HEALTH, "op")] == mn.HEALTH_CODES["exploding"]
    assert math.isnan(summary.head_norm_cv)  # one finite action-head norm: undefined
    # the next iteration's prev is the Inf, not the last finite value
    acc.add_minibatch(_norms([1.0, 1.0, 1.0], 1.0), zeros, zeros, torch.tensor(0.0))
    nxt = tracker.finish_iteration(acc.drain()[0])
    assert nxt.head_norms_prev["op"] == math.inf and nxt.trends["op"] == "↘"
    assert nxt.head_norms_prev["slot"] == pytest.approx(0.5)


def test_the_lanes_sum_in_float64_so_a_large_norm_keeps_a_unit_step():
    """2**24 and 1.0 are exact float32 norms; their sum 16777217 is not a float32 (it rounds to 2**24),
    so only a float64 buffer gives the mean (2**24 + 1) / 2 = 8388608.5."""
    tracker = TelemetryTracker(REPORTED, ACTION)
    acc = IterationAccumulator(tracker.layout)
    zeros = [0.0, 0.0]
    summary = _run_iteration(
        tracker,
        acc,
        [(_norms([2.0**24, 1.0, 1.0], 2.0**24), zeros, zeros, 0.0), (_norms([1.0, 1.0, 1.0], 1.0), zeros, zeros, 0.0)],
    )
    assert summary.head_norms["op"] == 8388608.5
    assert summary.global_norm == 8388608.5


def test_one_minibatch_gives_its_own_global_norm():
    tracker = TelemetryTracker(REPORTED, ACTION)
    summary = _run_iteration(
        tracker, IterationAccumulator(tracker.layout), [(_norms([1.0, 2.0, 3.0], 2.5), [0.0, 0.0], [0.0, 0.0], 0.0)]
    )
    assert summary.global_norm == 2.5
    assert summary.head_norms == {"op": 1.0, "slot": 2.0, "value": 3.0}


def _one_minibatch_of_logp(logp: torch.Tensor):
    """The summary of one iteration of one minibatch (norms 1) whose log-probs are ``logp``."""
    tracker = TelemetryTracker(REPORTED, ACTION)
    acc = IterationAccumulator(tracker.layout)
    acc.add_minibatch_logp(_norms([1.0, 1.0, 1.0], 1.0), logp, torch.tensor(0.0))
    return tracker.finish_iteration(acc.drain()[0])


def test_batched_logp_rows_latch_like_their_flattened_rows():
    """A ``[T, B, heads]`` log-prob tensor is read as its ``T*B`` rows: a NaN at (1, 2) of head
    ``slot`` and a -Inf at (0, 0) of head ``op`` latch those heads, nothing else."""
    logp = torch.full((2, 3, 2), -0.5)
    logp[1, 2, 1] = float("nan")
    logp[0, 0, 0] = float("-inf")
    summary = _one_minibatch_of_logp(logp)
    assert summary.nan_latched == {"op": False, "slot": True}
    assert summary.inf_latched == {"op": True, "slot": False}
    # the same rows, flattened by hand, and a row mask that drops the NaN row (row 5 = (1, 2))
    tracker2 = TelemetryTracker(REPORTED, ACTION)
    acc2 = IterationAccumulator(tracker2.layout)
    mask = torch.tensor([True, True, True, True, True, False])
    acc2.add_minibatch_logp(_norms([1.0, 1.0, 1.0], 1.0), logp, torch.tensor(0.0), mask)
    summary2 = tracker2.finish_iteration(acc2.drain()[0])
    assert summary2.nan_latched == {"op": False, "slot": False}
    assert summary2.inf_latched == {"op": True, "slot": False}


def test_finish_defaults_to_one_replica_and_returns_the_lanes_unchanged():
    tracker = TelemetryTracker(REPORTED, ACTION)
    lay = tracker.layout
    acc = IterationAccumulator(lay)
    acc.add_minibatch(
        _norms([1.0, 2.0, 3.0], 4.0, nan=3), torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0]), torch.tensor(1.0)
    )
    host = acc.fold().numpy().copy()
    assert host[lay.minibatches] == 1.0 and host[lay.nan_grad_count] == 3.0 and host[lay.skipped] == 1.0
    assert np.array_equal(acc.finish(host), host)  # world_size 2 would halve the counts: 0.5, 1.5, 0.5
    assert acc.buffer.abs().sum().item() == 0.0


def test_drain_returns_multi_element_extras_flattened_in_order():
    tracker = TelemetryTracker(REPORTED, ACTION)
    acc = IterationAccumulator(tracker.layout)
    acc.add_minibatch(
        _norms([1.0, 2.0, 3.0], 4.0), torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor(0.0)
    )
    lanes, reduced, local = acc.drain(
        reduced_extra=torch.tensor([[5.0, 6.0], [7.0, 8.0]]), local_extra=torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    )
    assert reduced.tolist() == [5.0, 6.0, 7.0, 8.0]
    assert local.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert tracker.finish_iteration(lanes).head_norms == {"op": 1.0, "slot": 2.0, "value": 3.0}


def test_skip_iteration_advances_the_iteration_clock():
    tracker = TelemetryTracker(REPORTED, ACTION)
    tracker.skip_iteration()
    tracker.skip_iteration()
    assert tracker.iteration == 2
    summary = _run_iteration(
        tracker, IterationAccumulator(tracker.layout), [(_norms([1.0, 1.0, 1.0], 1.0), [0.0, 1.0], [0.0, 0.0], 0.0)]
    )
    assert summary.iteration == 3 and summary.nan_first_iteration == {"slot": 3}


@pytest.mark.parametrize(("reported", "action"), [(0, 1), (1, 0), (0, 0)])
def test_layout_needs_a_reported_head_and_a_latch_head_each(reported, action):
    from gradmon_ray.telemetry import TelemetryLayout

    with pytest.raises(ValueError, match=r"^need num_reported >= 1 and num_action_heads >= 1$"):
        TelemetryLayout(reported, action)


def test_an_iteration_whose_only_nonfinite_flag_is_an_inf_latches_inf():
    """Explicit flags: the NaN marks are all 0 and only the Inf marks hold an Inf, so the Inf marks
    must be looked at on their own (their sum is what is not finite); the latch metrics name it."""
    tracker = TelemetryTracker(REPORTED, ACTION)
    summary = _run_iteration(
        tracker,
        IterationAccumulator(tracker.layout),
        [
            (_norms([1.0, 1.0, 1.0], 1.0), [0.0, 0.0], [0.0, 0.0], 0.0),
            (_norms([1.0, 1.0, 1.0], 1.0), [0.0, 0.0], [0.0, 1.0], 0.0),
        ],
    )
    assert summary.nan_latched == {"op": False, "slot": False}
    assert summary.inf_latched == {"op": False, "slot": True}
    metrics = summary.to_metrics()
    assert metrics[mn.head_metric(mn.HEAD_INF_LATCH, "slot")] == 1.0
    assert metrics[mn.head_metric(mn.HEAD_INF_LATCH_FIRST_ITERATION, "slot")] == 1.0
    assert mn.head_metric(mn.HEAD_INF_LATCH_FIRST_ITERATION, "op") not in metrics


def test_a_head_with_nan_and_plus_inf_log_probs_latches_both():
    """Column ``op`` holds a NaN and a +Inf (two rows), column ``slot`` only finite values."""
    logp = torch.tensor([[float("nan"), -1.0], [float("inf"), -2.0], [-0.5, -0.5]])
    summary = _one_minibatch_of_logp(logp)
    assert summary.nan_latched == {"op": True, "slot": False}
    assert summary.inf_latched == {"op": True, "slot": False}


def test_an_overflowing_log_prob_sum_is_an_answer_not_a_warning():
    """Finite log-probs of -3e38 overflow a float32 sum (the fast path's test) to -Inf: no RuntimeWarning
    escapes, and the exact path finds nothing non-finite."""
    import warnings

    logp = torch.tensor([[-3e38, -1.0], [-3e38, -1.0]], dtype=torch.float32)
    tracker = TelemetryTracker(REPORTED, ACTION)
    acc = IterationAccumulator(tracker.layout)
    acc.add_minibatch_logp(_norms([1.0, 1.0, 1.0], 1.0), logp, torch.tensor(0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lanes = acc.drain()[0]
    summary = tracker.finish_iteration(lanes)
    assert summary.nan_latched == {"op": False, "slot": False}
    assert summary.inf_latched == {"op": False, "slot": False}


def test_norm_records_give_each_module_its_own_heads_and_scalars():
    """``NormRecords`` of one plan over modules with 1, 3 and 2 heads, two minibatches: module
    ``m``'s stacked records are its own heads (as many as it has, not module 0's count) and its
    own ``[global norm, NaN count, Inf count, skipped]`` per minibatch.  Oracle: numpy norms and
    counts of the gradients set here, and the modules given a non-finite gradient here."""
    gen = torch.Generator().manual_seed(3)
    modules = []
    for heads in (1, 3, 2):
        params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(heads + 1)]  # the last one: the trunk
        modules.append(({f"h{i}": [p] for i, p in enumerate(params[:-1])}, params))
    plan = GradientNormPlan.for_modules(modules)
    records = NormRecords(plan.slots)
    seen = []  # per minibatch, per module: its gradients (numpy, float64)
    skips = [[0.0, 0.0, 0.0], [0.0, 1.0, 1.0]]  # the modules given a non-finite gradient below
    for minibatch in range(2):
        for _, params in modules:
            for p in params:
                p.grad = torch.randn(2, generator=gen)
        if minibatch == 1:
            modules[1][1][0].grad[1] = float("nan")  # module 1's head h0
            modules[2][1][-1].grad[0] = float("-inf")  # module 2's trunk
        seen.append([[p.grad.double().numpy().copy() for p in params] for _, params in modules])
        records.add(plan.compute_all())
    for m, (groups, _) in enumerate(modules):
        stacked = records.module(m)
        scalars = stacked.scalars[:, :, 0]
        assert stacked.head_norms.shape == (2, len(groups)) and scalars.shape == (4, 2), m
        for k in range(2):
            grads = seen[k][m]
            want_heads = [math.sqrt(np.sum(g**2)) for g in grads[:-1]]
            np.testing.assert_allclose(stacked.head_norms[k].numpy(), want_heads, rtol=1e-6, err_msg=f"{m} {k}")
            every = np.concatenate(grads)
            want = [math.sqrt(np.sum(every**2)), np.isnan(every).sum(), np.isinf(every).sum(), skips[k][m]]
            np.testing.assert_allclose(scalars[:, k].numpy(), want, rtol=1e-6, err_msg=f"{m} {k}")


@pytest.mark.parametrize("skip_mask", [None, [0.0, 1.0]], ids=["default", "first-module-never-skips"])
def test_norm_records_derive_exact_counts_and_skips_at_the_drain(skip_mask):
    """Records added without skip flags (the learner's path): each module's NaN and Inf counts are
    exact integers, though the norm pass carries them as squared float32 norms (3 -> 2.9999998
    unrounded), and a minibatch is skipped where the module had a non-finite element and its
    ``skip_mask`` entry is 1.  Oracle: the counts set here by hand."""
    a = [torch.nn.Parameter(torch.zeros(7)), torch.nn.Parameter(torch.zeros(3))]
    b = [torch.nn.Parameter(torch.zeros(5))]
    plan = GradientNormPlan.for_modules([({"h": a[:1]}, a), ({"h": b}, b)])
    records = NormRecords(plan.slots, None if skip_mask is None else torch.tensor(skip_mask))
    nan, inf = float("nan"), float("inf")
    a[0].grad = torch.tensor([nan, 1.0, nan, inf, -inf, nan, 2.0])
    a[1].grad = torch.tensor([inf, 0.0, inf])
    b[0].grad = torch.ones(5)
    records.add(plan.compute_all())
    a[0].grad = torch.ones(7)
    a[1].grad = torch.ones(3)
    b[0].grad = torch.tensor([inf, 1.0, 1.0, 1.0, -inf])  # Inf only: skipped all the same
    records.add(plan.compute_all())
    first, second = (records.module(k).scalars[:, :, 0] for k in range(2))
    assert first[1].tolist() == [3.0, 0.0] and first[2].tolist() == [4.0, 0.0]
    assert second[1].tolist() == [0.0, 0.0] and second[2].tolist() == [0.0, 2.0]
    mask = skip_mask or [1.0, 1.0]
    assert first[3].tolist() == [mask[0], 0.0] and second[3].tolist() == [0.0, mask[1]]
    assert first[0, 1].item() == pytest.approx(math.sqrt(10.0))
