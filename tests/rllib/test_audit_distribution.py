"""Audit oracle: per-head entropy and KL of ``FactoredCategorical`` head by head, also for
finite logits tens of thousands of nats apart: entropy from torch.distributions' ``Categorical``,
KL written out as sum p_a (log p_a - log p_b) on float64 log-softmaxes (torch's own
``kl_divergence`` calls such a KL infinite once q underflows to 0)."""

from __future__ import annotations

import torch
from torch.distributions import Categorical

from gradmon_ray.losses.distribution import FactoredCategorical

SIZES = (3, 5, 2)


def _split(logits: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(logits, SIZES, dim=-1))


def test_per_head_kl_and_entropy_equal_torch_categorical_for_widely_spread_logits():
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(4, sum(SIZES), generator=gen, dtype=torch.float64)
    b = torch.randn(4, sum(SIZES), generator=gen, dtype=torch.float64)
    b[0, 1] = -5.0e4  # a finite but tiny probability under b where a puts real mass
    b[1, 4] = -2.0e5
    a[2, 8] = -3.0e4  # and the other way round
    dist_cls = FactoredCategorical.for_heads(["h0", "h1", "h2"], SIZES, "multi_discrete")
    pa, pb = dist_cls.from_logits(a), dist_cls.from_logits(b)
    kl = pa.per_head_kl(pb)
    ent = pa.per_head_entropy()
    for h, (la, lb) in enumerate(zip(_split(a), _split(b), strict=True)):
        ca = Categorical(logits=la)
        lpa, lpb = torch.log_softmax(la, -1), torch.log_softmax(lb, -1)
        expected = (lpa.exp() * (lpa - lpb)).sum(-1)
        torch.testing.assert_close(kl[:, h], expected, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(ent[:, h], ca.entropy(), rtol=1e-9, atol=1e-9)
    assert kl[0, 0] > 5.0e3  # about p_a(1) * 5e4 (p_a(1) ~ 0.12): the tiny probability is not floored
    torch.testing.assert_close(pa.kl(pb), kl.sum(-1))
