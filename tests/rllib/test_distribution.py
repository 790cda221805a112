"""FactoredCategorical against torch.distributions, head by head."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from gradmon_ray.rllib import FactoredCategorical

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


def test_minus_inf_logit_keeps_entropy_and_kl_finite():
    logits = torch.tensor([[float("-inf"), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    dist = FactoredCategorical.for_heads(NAMES, SIZES, "multi_discrete").from_logits(logits)
    assert torch.isfinite(dist.entropy()).all()
    assert dist.per_head_entropy()[0, 0].item() == pytest.approx(0.0)  # one-hot head a
    assert torch.isinf(dist.per_head_logp(torch.tensor([[0, 0, 0]]))[0, 0])
    assert torch.isfinite(dist.kl(dist)).all()


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
