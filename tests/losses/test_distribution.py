"""``losses/distribution.py``: FactoredCategorical against torch.distributions, head by head.

Per-head log-probs, entropy and KL against ``torch.distributions.Categorical`` on each head's
logit slice; KL for logits tens of thousands of nats apart against ``sum p_a (log p_a - log p_b)``
written out on float64 log-softmaxes (torch's own ``kl_divergence`` calls such a KL infinite once
q underflows to 0); a -inf logit against the closed-form entropies of one-hot and uniform heads.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from gradmon_ray.losses.distribution import FactoredCategorical

NAMES, SIZES = ("a", "b", "c"), (2, 4, 3)


def _split(logits):
    return torch.split(logits, list(SIZES), dim=-1)


@pytest.fixture
def logits():
    return torch.randn(6, sum(SIZES), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("fmt", ["dict", "multi_discrete"])
def test_per_head_logp_entropy_kl_match_torch(logits, fmt):
    cls = FactoredCategorical.for_heads(NAMES, SIZES, fmt)
    other_logits = logits.flip(0)
    dist, other = cls.from_logits(logits), cls.from_logits(other_logits)
    actions = torch.stack([torch.tensor([i % s for i in range(6)]) for s in SIZES], dim=-1)
    value = {n: actions[:, i] for i, n in enumerate(NAMES)} if fmt == "dict" else actions
    refs = [Categorical(logits=chunk) for chunk in _split(logits)]
    others = [Categorical(logits=chunk) for chunk in _split(other_logits)]
    expected_logp = torch.stack([r.log_prob(actions[:, i]) for i, r in enumerate(refs)], -1)
    torch.testing.assert_close(dist.per_head_logp(value), expected_logp)
    torch.testing.assert_close(dist.logp(value), expected_logp.sum(-1))
    torch.testing.assert_close(dist.per_head_entropy(), torch.stack([r.entropy() for r in refs], -1))
    expected_kl = torch.stack([kl_divergence(r, o) for r, o in zip(refs, others, strict=True)], -1)
    torch.testing.assert_close(dist.per_head_kl(other), expected_kl)
    torch.testing.assert_close(dist.kl(other), expected_kl.sum(-1))


def test_discrete_single_head():
    cls = FactoredCategorical.for_heads(("action",), (5,), "discrete")
    logits = torch.randn(4, 5)
    dist = cls.from_logits(logits)
    a = torch.tensor([0, 4, 2, 1])
    torch.testing.assert_close(dist.logp(a), Categorical(logits=logits).log_prob(a))
    assert dist.sample().shape == (4,)


def test_sampling_frequencies_and_padding_never_sampled():
    torch.manual_seed(0)
    probs_b = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.cat([torch.log(torch.tensor([0.5, 0.5])), torch.log(probs_b), torch.zeros(3)]).expand(20000, -1)
    sample = FactoredCategorical.for_heads(NAMES, SIZES, "multi_discrete").from_logits(logits).sample()
    assert sample.shape == (20000, 3)
    assert int(sample[:, 0].max()) <= 1 and int(sample[:, 2].max()) <= 2  # padded slots never drawn
    freq = torch.bincount(sample[:, 1], minlength=4).float() / 20000
    torch.testing.assert_close(freq, probs_b, atol=0.015, rtol=0)


def test_deterministic_is_argmax_per_head(logits):
    dist = FactoredCategorical.for_heads(NAMES, SIZES, "dict").from_logits(logits).to_deterministic()
    sample = dist.sample()
    for name, chunk in zip(NAMES, _split(logits), strict=True):
        assert torch.equal(sample[name], chunk.argmax(-1))


def test_a_minus_inf_logit_gives_the_closed_form_entropy_and_zero_self_kl():
    """Head a = [-inf, 0] is one-hot (entropy 0), b and c are uniform (ln 4, ln 3): the total is
    ln 12, not NaN (0 * -inf); the -inf action's log-prob is -inf; KL(p || p) is exactly 0."""
    logits = torch.tensor([[float("-inf"), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    dist = FactoredCategorical.for_heads(NAMES, SIZES, "multi_discrete").from_logits(logits)
    per_head = dist.per_head_entropy()[0].tolist()
    assert per_head == pytest.approx([0.0, math.log(4), math.log(3)], abs=1e-6)
    assert dist.entropy().item() == pytest.approx(math.log(12), abs=1e-6)
    assert dist.per_head_logp(torch.tensor([[0, 0, 0]]))[0, 0].item() == float("-inf")
    assert dist.per_head_kl(dist)[0].tolist() == [0.0, 0.0, 0.0] and dist.kl(dist).item() == 0.0


def test_errors():
    with pytest.raises(TypeError, match="for_heads"):
        FactoredCategorical(torch.zeros(1, 3))
    cls = FactoredCategorical.for_heads(NAMES, SIZES, "dict")
    with pytest.raises(ValueError, match="need 9"):
        cls.from_logits(torch.zeros(1, 8))
    with pytest.raises(TypeError, match="dict of actions"):
        cls.from_logits(torch.zeros(1, 9)).logp(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="exactly one head"):
        FactoredCategorical.for_heads(("a", "b"), (2, 2), "discrete")


WIDE_SIZES = (3, 5, 2)


def _split_wide(logits: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(logits, WIDE_SIZES, dim=-1))


def test_per_head_kl_and_entropy_equal_torch_categorical_for_widely_spread_logits():
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(4, sum(WIDE_SIZES), generator=gen, dtype=torch.float64)
    b = torch.randn(4, sum(WIDE_SIZES), generator=gen, dtype=torch.float64)
    b[0, 1] = -5.0e4  # a finite but tiny probability under b where a puts real mass
    b[1, 4] = -2.0e5
    a[2, 8] = -3.0e4  # and the other way round
    dist_cls = FactoredCategorical.for_heads(["h0", "h1", "h2"], WIDE_SIZES, "multi_discrete")
    pa, pb = dist_cls.from_logits(a), dist_cls.from_logits(b)
    kl = pa.per_head_kl(pb)
    ent = pa.per_head_entropy()
    for h, (la, lb) in enumerate(zip(_split_wide(a), _split_wide(b), strict=True)):
        ca = Categorical(logits=la)
        lpa, lpb = torch.log_softmax(la, -1), torch.log_softmax(lb, -1)
        expected = (lpa.exp() * (lpa - lpb)).sum(-1)
        torch.testing.assert_close(kl[:, h], expected, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(ent[:, h], ca.entropy(), rtol=1e-9, atol=1e-9)
    assert kl[0, 0] > 5.0e3  # about p_a(1) * 5e4 (p_a(1) ~ 0.12): the tiny probability is not floored
    torch.testing.assert_close(pa.kl(pb), kl.sum(-1))
