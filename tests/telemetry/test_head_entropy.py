"""Per-head entropy and KL from concatenated logits, against worked answers and numpy.

Bugs these catch: log base 2 or 10 instead of nats, the KL direction swapped, a head slice off
by one (heads of different sizes), padded rows entering the mean, NaN from 0 * log 0.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradmon_ray.telemetry.head_entropy import (
    empty_head_health_lanes,
    head_health_lanes,
    masked_head_mean,
    normalised_entropy,
    per_head_entropy,
    per_head_kl,
)


@pytest.mark.parametrize("n", [2, 3, 7])
def test_uniform_head_has_entropy_log_n_and_entropy_norm_one(n):
    entropy = per_head_entropy(torch.zeros(4, n), [n])
    torch.testing.assert_close(entropy, torch.full((4, 1), math.log(n)))
    assert normalised_entropy(math.log(n), n) == pytest.approx(1.0)


@pytest.mark.parametrize("very_negative", [-1e9, float("-inf")])
def test_one_hot_head_has_entropy_zero_and_no_nan(very_negative):
    logits = torch.tensor([[0.0, very_negative, very_negative, very_negative]])
    entropy = per_head_entropy(logits, [4])
    assert entropy.tolist() == [[0.0]]
    assert normalised_entropy(float(entropy), 4) == 0.0
    kl = per_head_kl(logits, logits, [4])
    assert kl.tolist() == [[0.0]]


def test_one_action_head_entropy_is_zero_and_its_norm_is_nan():
    assert per_head_entropy(torch.tensor([[3.0]]), [1]).tolist() == [[0.0]]
    assert math.isnan(normalised_entropy(0.0, 1))


def test_kl_of_identical_policies_is_zero():
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(per_head_kl(logits, logits, [3, 4]), torch.zeros(5, 2))


def test_kl_of_known_categorical_pairs_in_nats_and_in_p_q_direction():
    p, q = [0.5, 0.5], [0.9, 0.1]
    kl_pq = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # 0.5108...
    kl_qp = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)  # 0.3681...: not symmetric
    logits_p, logits_q = torch.log(torch.tensor([p])), torch.log(torch.tensor([q]))
    assert per_head_kl(logits_p, logits_q, [2]).item() == pytest.approx(kl_pq, rel=1e-6)
    assert per_head_kl(logits_q, logits_p, [2]).item() == pytest.approx(kl_qp, rel=1e-6)
    # logits are only defined up to a constant per head
    assert per_head_kl(logits_p + 3.0, logits_q - 1.0, [2]).item() == pytest.approx(kl_pq, rel=1e-6)


def test_heads_of_different_sizes_are_their_own_slices():
    # head a: 2 actions [0.25, 0.75]; head b: 3 actions uniform; head c: 1 action
    probs_a = [0.25, 0.75]
    logits = torch.tensor([[math.log(0.25), math.log(0.75), 5.0, 5.0, 5.0, -2.0]])
    entropy = per_head_entropy(logits, [2, 3, 1])[0].tolist()
    expected_a = -sum(x * math.log(x) for x in probs_a)
    assert entropy == pytest.approx([expected_a, math.log(3), 0.0], rel=1e-6)
    # only head b differs: q puts [0.5, 0.25, 0.25] on it
    other = logits.clone()
    other[0, 2:5] = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    kl = per_head_kl(logits, other, [2, 3, 1])[0].tolist()
    third = 1 / 3
    expected_b = third * (math.log(third / 0.5) + 2 * math.log(third / 0.25))
    assert kl == pytest.approx([0.0, expected_b, 0.0], abs=1e-6)


def _np_entropy(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    return -(p * np.log(p)).sum(-1)


def test_mask_excludes_padded_rows_as_numpy_on_the_unpadded_rows():
    rng = np.random.default_rng(3)
    sizes = [3, 5]
    logits = rng.normal(size=(2, 6, 8)).astype(np.float32)  # [B, T, A], as a recurrent module's batch
    mask = np.ones((2, 6), dtype=bool)
    mask[0, 4:] = False
    mask[1, 2:] = False
    logits[~mask] = np.nan  # padding may hold anything: it must not reach the mean
    lanes = head_health_lanes(torch.from_numpy(logits), None, sizes, torch.from_numpy(mask)).numpy()
    rows = logits[mask]  # the unpadded rows only
    expected = [_np_entropy(rows[:, :3]).mean(), _np_entropy(rows[:, 3:]).mean()]
    np.testing.assert_allclose(lanes[:2], expected, rtol=1e-5)
    assert lanes[2:].tolist() == [0.0, 0.0, 1.0, 0.0]  # no sampling logits: KL lanes and KL count 0
    no_mask = masked_head_mean(torch.tensor([[1.0, 2.0], [3.0, 6.0]]), None)
    assert no_mask.tolist() == [2.0, 4.0]


def test_lanes_hold_entropy_and_kl_of_the_sampling_policy_to_the_current_one():
    current = torch.log(torch.tensor([[0.9, 0.1], [0.9, 0.1]]))
    sampling = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    lanes = head_health_lanes(current, sampling, [2]).tolist()
    kl_sampling_current = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    entropy = -(0.9 * math.log(0.9) + 0.1 * math.log(0.1))
    assert lanes == pytest.approx([entropy, kl_sampling_current, 1.0, 1.0], rel=1e-6)
    assert empty_head_health_lanes(3).tolist() == [0.0] * 8


def test_lanes_equal_torch_distributions_for_uneven_heads_and_a_mask():
    """An independent path: ``torch.distributions.Categorical`` per head, on the head's own slice,
    for a [B, T, A] batch with heads of 1, 3, 5 and 2 actions, very negative logits (the slow-exp
    region) and a mask.  A wrong gather index (head slices crossed), padding entering a head's
    softmax, or the mask applied along the wrong axis fails here."""
    g = torch.Generator().manual_seed(7)
    sizes = [1, 3, 5, 2]
    current = torch.randn(4, 5, sum(sizes), generator=g) * 3
    sampling = torch.randn(4, 5, sum(sizes), generator=g) * 3
    current[0, 0, 1] = -150.0  # an action the current policy all but rules out
    mask = torch.rand(4, 5, generator=g) > 0.3
    lanes = head_health_lanes(current, sampling, sizes, mask)
    entropy, kl, start = [], [], 0
    for size in sizes:
        cur = torch.distributions.Categorical(logits=current[mask][:, start : start + size].double())
        samp = torch.distributions.Categorical(logits=sampling[mask][:, start : start + size].double())
        entropy.append(cur.entropy().mean())
        kl.append(torch.distributions.kl_divergence(samp, cur).mean())
        start += size
    expected = torch.stack(
        [*entropy, *kl, torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)]
    )
    torch.testing.assert_close(lanes, expected, rtol=1e-5, atol=1e-6)
    per_row = per_head_entropy(current, sizes)  # [B, T, heads], the layout callers see
    assert per_row.shape == (4, 5, 4)
    torch.testing.assert_close(
        per_row[..., 2].double(),
        torch.distributions.Categorical(logits=current[..., 4:9].double()).entropy(),
        rtol=1e-5,
        atol=1e-6,
    )


def test_lanes_of_a_minibatch_without_rows_are_nan_not_an_error():
    """A 0-row minibatch (or a [B, 0, A] recurrent one) reaches the drain as NaN means with
    counts 1: the update goes on, and NaN never ranks as a measured value."""
    for shape in [(0, 10), (4, 0, 10)]:
        empty = torch.zeros(*shape)
        mask = None if len(shape) == 2 else torch.zeros(shape[:2], dtype=torch.bool)
        lanes = head_health_lanes(empty, empty, (3, 7), mask)
        assert all(math.isnan(v) for v in lanes[:4].tolist())
        assert lanes[4:].tolist() == [1.0, 1.0]


def test_kl_promotes_dtypes_and_broadcasts_like_elementwise_arithmetic():
    p = torch.log(torch.tensor([[0.5, 0.5]]))
    q = torch.log(torch.tensor([[0.9, 0.1], [0.5, 0.5]], dtype=torch.float64))
    kl = per_head_kl(p, q, [2])  # p's one row against each of q's two rows
    assert kl.dtype == torch.float64 and kl.shape == (2, 1)
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl[:, 0].tolist() == pytest.approx([expected, 0.0], abs=1e-12)


def test_logits_of_the_wrong_width_are_refused_naming_their_width():
    logits = torch.zeros(4, 6)  # 4 rows of 6 entries; heads of sizes (2, 3) need 5
    with pytest.raises(ValueError) as err:
        per_head_entropy(logits, (2, 3))
    assert str(err.value) == "logits have 6 entries, heads of sizes (2, 3) need 5"


def test_sampling_logits_are_read_in_the_current_logits_dtype():
    """float32 logits with float64 sampling logits: both policies go through one float32 softmax, so the
    lanes equal those of the sampling logits given in float32; the entropy lane is the closed form
    -sum p log p of the uniform 2-action head (log 2) and of a [0.1, 0.2, 0.7] head (numpy, float64)."""
    probs = np.array([0.1, 0.2, 0.7])
    row = np.concatenate([[0.0, 0.0], np.log(probs)])
    logits = torch.tensor(np.stack([row, row]), dtype=torch.float32)
    sampling = torch.tensor(np.stack([row + 0.3, row - 0.2]), dtype=torch.float64)
    lanes = head_health_lanes(logits, sampling, (2, 3))
    assert torch.equal(lanes, head_health_lanes(logits, sampling.float(), (2, 3)))
    assert lanes[:2].tolist() == pytest.approx([math.log(2.0), float(-(probs * np.log(probs)).sum())], rel=1e-6)
