"""Buckets and signed shares: worked answers, edge cases, properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradmon_ray.telemetry import (
    bucket_names,
    cosine_similarities,
    group_reward_stds,
    signed_shares,
    split_into_buckets,
)


def test_buckets_worked_answer_with_remainder_in_the_last():
    stds = [0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6, 1.0, 0.0]  # 11 groups, 4 buckets: 2, 2, 2, 5
    buckets = split_into_buckets(stds, 4)
    assert buckets == [[10, 1], [5, 3], [7, 2], [8, 4, 6, 0, 9]]
    assert [len(b) for b in buckets] == [2, 2, 2, 5]
    assert bucket_names(4) == ["bucket_1", "bucket_2", "bucket_3", "bucket_4"]


def test_buckets_ties_keep_original_order_and_even_split():
    assert split_into_buckets([0.5, 0.5, 0.5, 0.5], 2) == [[0, 1], [2, 3]]
    assert split_into_buckets([3.0, 1.0, 2.0], 1) == [[1, 2, 0]]
    assert split_into_buckets([3.0, 1.0, 2.0], 3) == [[1], [2], [0]]


@pytest.mark.parametrize(
    ("stds", "k", "match"),
    [
        ([1.0, 2.0], 0, "num_buckets must be >= 1"),
        ([1.0], 2, "1 groups for 2 buckets"),
        ([1.0, float("nan")], 1, "NaN"),
    ],
)
def test_bucket_errors(stds, k, match):
    with pytest.raises(ValueError, match=match):
        split_into_buckets(stds, k)


@settings(max_examples=60, deadline=None)
@given(stds=st.lists(st.floats(0, 10), min_size=1, max_size=40), k=st.integers(1, 8))
def test_buckets_property_partition_sorted_sizes(stds, k):
    if len(stds) < k:
        return
    buckets = split_into_buckets(stds, k)
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(stds)))  # a partition
    assert [stds[i] for i in flat] == sorted(stds)  # ascending across buckets
    assert all(len(b) == len(stds) // k for b in buckets[:-1])


def test_group_reward_stds_worked_answer():
    groups, stds = group_reward_stds(
        ["a", "b", "a", "c"],
        [1.0, 5.0, 3.0, 2.0],
        [[1.0], [2.0, 4.0, -1.0], [3.0], [1.0, 3.0]],
    )
    assert groups == ["a", "b", "c"]
    # a: returns 1, 3 -> population std 1; b: one episode -> std of steps [2,4,-1]; c: steps [1,3] -> 1
    assert stds == pytest.approx([1.0, math.sqrt(((2 - 5 / 3) ** 2 + (4 - 5 / 3) ** 2 + (-1 - 5 / 3) ** 2) / 3), 1.0])
    with pytest.raises(ValueError, match="one entry per episode"):
        group_reward_stds(["a"], [1.0, 2.0], [[1.0]])


def test_signed_shares_two_parameter_worked_answer():
    # g_task = (3, 0), g_ent = (1, 2): g = (4, 2), |g|^2 = 20; <g_task, g> = 12, <g_ent, g> = 8
    shares = signed_shares(
        {"task": [torch.tensor([3.0]), torch.tensor([0.0])], "entropy": [torch.tensor([1.0]), torch.tensor([2.0])]}
    )
    assert shares == pytest.approx({"task": 0.6, "entropy": 0.4})
    # an opposing component gets a negative share: g_a = (2,), g_b = (-1,): g = (1,) -> 2, -1
    assert signed_shares({"a": [torch.tensor([2.0])], "b": [torch.tensor([-1.0])]}) == pytest.approx(
        {"a": 2.0, "b": -1.0}
    )
    assert all(math.isnan(v) for v in signed_shares({"a": [torch.zeros(2)], "b": [torch.zeros(2)]}).values())


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 5))
def test_signed_shares_sum_to_one(seed, n):
    gen = torch.Generator().manual_seed(seed)
    comps = {f"c{i}": [torch.randn(3, generator=gen), torch.randn(2, 2, generator=gen)] for i in range(n)}
    assert sum(signed_shares(comps).values()) == pytest.approx(1.0, abs=1e-9)


def test_cosines_worked_answer():
    cos = cosine_similarities({"a": [torch.tensor([1.0, 0.0])], "b": [torch.tensor([1.0, 1.0])], "z": [torch.zeros(2)]})
    assert cos[("a", "b")] == pytest.approx(1 / math.sqrt(2))
    assert math.isnan(cos[("a", "z")])


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([1.0, 2.0], [-2.0, -4.0], -1.0),  # opposing
        ([1.0, 2.0], [-2.0, 1.0], 0.0),  # orthogonal
        ([1.0, 2.0], [0.5, 1.0], 1.0),  # parallel
        ([3.0, 0.0], [-1.0, 1.0], -1 / math.sqrt(2)),  # obtuse
    ],
    ids=["opposing", "orthogonal", "parallel", "obtuse"],
)
def test_cosines_keep_their_sign(a, b, expected):
    # Split over two tensors: the cosine is over the concatenation of all parameters.
    cos = cosine_similarities(
        {"a": [torch.tensor(a[:1]), torch.tensor(a[1:])], "b": [torch.tensor(b[:1]), torch.tensor(b[1:])]}
    )
    assert cos[("a", "b")] == pytest.approx(expected, abs=1e-12)


def test_signed_shares_of_opposing_orthogonal_parallel_pairs():
    # opposing: g = (1,2) + (-2,-4) = (-1,-2), |g|^2 = 5: <a,g> = -5 -> -1, <b,g> = 10 -> 2
    assert signed_shares({"a": [torch.tensor([1.0, 2.0])], "b": [torch.tensor([-2.0, -4.0])]}) == pytest.approx(
        {"a": -1.0, "b": 2.0}
    )
    # orthogonal: g = (-1, 3), |g|^2 = 10: <a,g> = 5 -> 0.5, <b,g> = 5 -> 0.5
    assert signed_shares({"a": [torch.tensor([1.0, 2.0])], "b": [torch.tensor([-2.0, 1.0])]}) == pytest.approx(
        {"a": 0.5, "b": 0.5}
    )
    # parallel: shares are the length ratios, 2/3 and 1/3
    assert signed_shares({"a": [torch.tensor([2.0, 4.0])], "b": [torch.tensor([1.0, 2.0])]}) == pytest.approx(
        {"a": 2 / 3, "b": 1 / 3}
    )


def test_group_reward_stds_compute_in_float64_for_float32_rewards():
    """float32 rewards (numpy rewards from an env) are widened before the std: the population std of
    the float32 values taken as exact doubles, not a float32 std (which differs from ~1e-8 on)."""
    import numpy as np

    steps = np.array([0.1, 0.2, 0.7, 1.3], dtype=np.float32)
    returns = [np.float32(0.1), np.float32(0.25), np.float32(1.7)]

    def pstd(values):
        xs = [float(v) for v in values]
        mean = sum(xs) / len(xs)
        return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))

    groups, stds = group_reward_stds(["solo", "g", "g", "g"], [0.0, *returns], [steps, [0.0], [0.0], [0.0]])
    assert groups == ["solo", "g"]
    assert stds[0] == pytest.approx(pstd(steps), rel=1e-12, abs=0)
    assert stds[1] == pytest.approx(pstd(returns), rel=1e-12, abs=0)


def test_a_nan_std_is_named_in_the_error_word_for_word():
    with pytest.raises(ValueError, match=r"^reward_std contains NaN$"):
        split_into_buckets([0.5, float("nan"), 1.0], 2)
