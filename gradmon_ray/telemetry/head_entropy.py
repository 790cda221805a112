"""Per-head policy entropy and KL of a factored categorical policy, from its concatenated logits.

Pure torch, no RLlib: the heads are ``sizes`` (number of actions of each head) and a head's
logits are its slice of the last dimension, in order.  Natural logarithms throughout (nats,
as RLlib's ``entropy`` and ``mean_kl_loss``).  A head's probabilities are
``softmax(slice)``; an action with probability 0 (a ``-inf`` or very negative logit)
contributes exactly 0 to the entropy and to the KL, never ``0 * -inf = NaN``: the
log-probabilities are clamped at the dtype's minimum, as ``torch.distributions.Categorical``
does.

``head_health_lanes`` is what the learner computes once per telemetry step on the step's last
minibatch; it rides in the step's single packed reduction (SUM across learners) and
``HEAD_HEALTH_COUNTS`` tells how many learners contributed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_INDEX_CACHE: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}


def _padding_index(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Gather index into ``[logits, -inf]`` giving a ``[num_heads * max(sizes)]`` layout (cached)."""
    key = (sizes, str(device))
    index = _INDEX_CACHE.get(key)
    if index is None:
        width, pad, offset, flat = max(sizes), sum(sizes), 0, []
        for size in sizes:
            flat.extend(range(offset, offset + size))
            flat.extend([pad] * (width - size))
            offset += size
        index = _INDEX_CACHE[key] = torch.tensor(flat, dtype=torch.long, device=device)
    return index


def head_log_probs(logits: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``[..., num_heads, max(sizes)]`` log-probabilities of each head, clamped at the dtype's
    minimum (padding of smaller heads: probability exactly 0)."""
    sizes = tuple(int(s) for s in sizes)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"every head needs at least one action, got sizes {sizes}")
    if logits.shape[-1] != sum(sizes):
        raise ValueError(f"logits have {logits.shape[-1]} entries, heads of sizes {sizes} need {sum(sizes)}")
    # One gather for all heads: heads smaller than the largest are padded with -inf.
    pad = logits.new_full((*logits.shape[:-1], 1), float("-inf"))
    padded = torch.cat([logits, pad], dim=-1)[..., _padding_index(sizes, logits.device)]
    padded = padded.reshape(*logits.shape[:-1], len(sizes), max(sizes))
    logp = torch.log_softmax(padded, dim=-1)
    return logp.clamp(min=torch.finfo(logp.dtype).min)


def per_head_entropy(logits: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``[..., num_heads]`` entropy (nats) of each head: ``-sum_a p(a) log p(a)``."""
    logp = head_log_probs(logits, sizes)
    return -(logp.exp() * logp).sum(-1)


def per_head_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``[..., num_heads]`` KL(p || q) (nats) of each head: ``sum_a p(a) (log p(a) - log q(a))``.

    For PPO's ``mean_kl_loss`` direction, ``p`` is the sampling policy and ``q`` the current one.
    """
    log_p, log_q = head_log_probs(p_logits, sizes), head_log_probs(q_logits, sizes)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def masked_head_mean(per_head: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``[num_heads]`` mean of a ``[..., num_heads]`` tensor over the rows where ``mask`` holds
    (every row without a mask); padded rows never enter, whatever they hold (NaN included)."""
    rows = per_head.reshape(-1, per_head.shape[-1])
    if mask is None:
        return rows.mean(0)
    keep = mask.reshape(-1, 1).bool()
    return torch.where(keep, rows, 0.0).sum(0) / keep.sum()


HEAD_HEALTH_COUNTS = 2
"""Trailing lanes of ``head_health_lanes``: learners that measured entropy, learners that measured KL."""


def head_health_lane_count(num_heads: int) -> int:
    """Length of ``head_health_lanes`` for ``num_heads`` heads."""
    return 2 * num_heads + HEAD_HEALTH_COUNTS


def head_health_lanes(
    logits: torch.Tensor,
    sampling_logits: torch.Tensor | None,
    sizes: Sequence[int],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[entropy per head, KL per head, 1, kl_measured]`` (float64, on ``logits``' device).

    Entropy and KL(sampling || current) are masked means over the rows of one minibatch;
    without ``sampling_logits`` the KL lanes and ``kl_measured`` are 0.  Summed across
    learners, the two counts divide the sums back into means over learners.
    """
    with torch.no_grad():
        # One log-softmax over both policies and one masked mean over [entropy | KL]: this
        # runs once per step, but every kernel launch here is ~10 us on a CPU.
        num_heads = len(sizes)
        if sampling_logits is None:
            logp = head_log_probs(logits, sizes)
            rows = -(logp.exp() * logp).sum(-1)
        else:
            both = head_log_probs(torch.stack([logits, sampling_logits.to(logits.dtype)]), sizes)
            current, sampling = both[0], both[1]
            rows = torch.cat([-(current.exp() * current).sum(-1), (sampling.exp() * (sampling - current)).sum(-1)], -1)
        means = masked_head_mean(rows, mask).double()
        # The counts by fill kernels: a Python list -> CUDA tensor would be a synchronising copy.
        counts = means.new_ones(HEAD_HEALTH_COUNTS)
        if sampling_logits is None:
            counts[1:].zero_()
            means = torch.cat([means, means.new_zeros(num_heads)])
        return torch.cat([means, counts])


def empty_head_health_lanes(num_heads: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The lanes of a learner that saw no minibatch this step (all zero: counts 0)."""
    return torch.zeros(head_health_lane_count(num_heads), dtype=torch.float64, device=device)


def normalised_entropy(entropy: float, num_actions: int) -> float:
    """``entropy / log(num_actions)``: 1 for a uniform head, 0 for a deterministic one.

    NaN for a head with one action (``log 1 = 0``: such a head has no choice to collapse) and
    for a NaN entropy.
    """
    if num_actions < 2:
        return math.nan
    return entropy / math.log(num_actions)
