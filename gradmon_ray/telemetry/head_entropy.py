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

from gradmon_ray.telemetry.accumulator import joined_mask

_INDEX_CACHE: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}


def _action_major_index(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Row index into the columns of ``[logits | -inf]`` giving the ``[max(sizes) * num_heads]``
    action-major layout: entry ``a * num_heads + h`` is head ``h``'s action ``a``, or the ``-inf``
    column where head ``h`` has fewer actions (cached per sizes and device)."""
    key = (sizes, str(device))
    index = _INDEX_CACHE.get(key)
    if index is None:
        starts = [sum(sizes[:h]) for h in range(len(sizes))]
        pad = sum(sizes)
        flat = [starts[h] + a if a < size else pad for a in range(max(sizes)) for h, size in enumerate(sizes)]
        index = _INDEX_CACHE[key] = torch.tensor(flat, dtype=torch.long, device=device)
    return index


def _action_major(logits: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """``(log p, p, leading shape)`` of every head, each ``[max(sizes), num_heads, rows]`` with
    ``rows`` the product of ``logits``' leading dimensions; ``log p`` is clamped at the dtype's
    minimum and a head smaller than the largest is padded with ``p = 0``.

    Actions first, because a CPU softmax over the LAST dimension of a few actions runs row by
    row (about 80 ns a row: ~90 us for one minibatch's two policies), while over the first
    dimension it is vectorised across the rows (~8 us).  ``p`` is ``exp`` of the log-softmax
    before the clamp: exp of an underflowing argument (the clamped padding) takes a slow path
    (~15x), and a second softmax over the first dimension took ~0.1 ms inside a learner (py-spy),
    far more than in isolation.
    """
    sizes = tuple(int(s) for s in sizes)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"every head needs at least one action, got sizes {sizes}")
    if logits.shape[-1] != sum(sizes):
        raise ValueError(f"logits have {logits.shape[-1]} entries, heads of sizes {sizes} need {sum(sizes)}")
    flat = torch.nn.functional.pad(logits.reshape(-1, sum(sizes)), (0, 1), value=float("-inf"))
    padded = flat.t().index_select(0, _action_major_index(sizes, logits.device))
    padded = padded.reshape(max(sizes), len(sizes), flat.shape[0])
    logp = torch.log_softmax(padded, 0)
    probs = logp.exp()  # before the clamp: exp(-inf) is 0 on a fast path, exp(dtype min) is not
    return logp.clamp(min=torch.finfo(padded.dtype).min), probs, tuple(logits.shape[:-1])


def _rows_last(per_head: torch.Tensor, leading: tuple[int, ...]) -> torch.Tensor:
    """``[num_heads, rows]`` -> ``[*leading, num_heads]``."""
    return per_head.t().reshape(*leading, per_head.shape[0])


def per_head_entropy(logits: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``[..., num_heads]`` entropy (nats) of each head: ``-sum_a p(a) log p(a)``."""
    logp, p, leading = _action_major(logits, sizes)
    return _rows_last(-(p * logp).sum(0), leading)


def per_head_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``[..., num_heads]`` KL(p || q) (nats) of each head: ``sum_a p(a) (log p(a) - log q(a))``.

    For PPO's ``mean_kl_loss`` direction, ``p`` is the sampling policy and ``q`` the current one.
    """
    p_logits, q_logits = torch.broadcast_tensors(p_logits, q_logits)
    dtype = torch.promote_types(p_logits.dtype, q_logits.dtype)
    log_p, p, leading = _action_major(p_logits.to(dtype), sizes)
    log_q, _, _ = _action_major(q_logits.to(dtype), sizes)
    return _rows_last((p * (log_p - log_q)).sum(0), leading)


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
        values, _ = _entropy_kl_rows([logits], None if sampling_logits is None else [sampling_logits], sizes)
        means = masked_head_mean(values, mask).double()
        # The counts by fill kernels: a Python list -> CUDA tensor would be a synchronising copy.
        counts = means.new_ones(HEAD_HEALTH_COUNTS)
        if sampling_logits is None:
            counts[1:].zero_()
            means = torch.cat([means, means.new_zeros(len(sizes))])
        return torch.cat([means, counts])


def _entropy_kl_rows(
    logits: Sequence[torch.Tensor], sampling_logits: Sequence[torch.Tensor] | None, sizes: Sequence[int]
) -> tuple[torch.Tensor, list[int]]:
    """``[rows, heads]`` entropy of the current policy (``[rows, 2 x heads]``: then KL(sampling ||
    current)) of every row of ``logits`` (one tensor per module, rows in order), and each tensor's
    row count.  One softmax pass over both policies (stacked as rows): this runs once per step,
    but every kernel is ~5-10 us on a CPU."""
    width = logits[0].shape[-1]
    rows = [x if x.dim() == 2 else x.reshape(-1, width) for x in logits]
    counts = [r.shape[0] for r in rows]
    n = sum(counts)
    if sampling_logits is not None:
        rows += [p.reshape(c, width).to(rows[0].dtype) for p, c in zip(sampling_logits, counts, strict=True)]
    logp, p, _ = _action_major(torch.cat(rows) if len(rows) > 1 else rows[0], sizes)
    current = logp[..., :n]
    per_head = -(p[..., :n] * current).sum(0)  # [heads, rows]
    if sampling_logits is not None:
        per_head = torch.cat([per_head, (p[..., n:] * (logp[..., n:] - current)).sum(0)])
    return per_head.t(), counts


def grouped_head_health_lanes(
    logits: Sequence[torch.Tensor],
    sampling_logits: Sequence[torch.Tensor] | None,
    sizes: Sequence[int],
    masks: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """``head_health_lanes`` of several modules with the same heads at once (one softmax pass over
    all their rows, one segmented masked mean): their lanes, module after module, flat.

    ``logits[k]``, ``sampling_logits[k]`` and ``masks[k]`` are module ``k``'s; ``sampling_logits``
    is None for all modules or for none."""
    if len(logits) == 1:
        prev = None if sampling_logits is None else sampling_logits[0]
        return head_health_lanes(logits[0], prev, sizes, masks[0])
    with torch.no_grad():
        values, counts = _entropy_kl_rows(logits, sampling_logits, sizes)
        device, segments = values.device, segment_ids(counts, values.device)
        keep = joined_mask(counts, list(masks), device)
        if keep is None:
            weights = _row_counts(counts, device, values.dtype)
        else:
            values = torch.where(keep.unsqueeze(-1), values, 0.0)  # padded rows never enter, NaN included
            weights = values.new_zeros(len(counts)).index_add_(0, segments, keep.to(values.dtype))
        sums = values.new_zeros(len(counts), values.shape[1]).index_add_(0, segments, values)
        means = (sums / weights.unsqueeze(-1)).double()
        if sampling_logits is None:
            means = torch.cat([means, means.new_zeros(len(counts), len(sizes))], dim=1)
        return torch.cat([means, _health_counts(len(counts), sampling_logits is not None, device)], dim=1).reshape(-1)


_SEGMENTS: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}
_COUNTS: dict[tuple[tuple[int, ...], str, torch.dtype], torch.Tensor] = {}
_HEALTH_COUNTS: dict[tuple[int, bool, str], torch.Tensor] = {}


def segment_ids(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[sum(counts)]`` long: ``k`` for each of the ``counts[k]`` rows of segment ``k`` (made once per
    ``counts`` and device: a tensor from host data each step would be a host-to-device copy)."""
    key = (tuple(counts), str(device))
    ids = _SEGMENTS.get(key)
    if ids is None:
        ids = _SEGMENTS[key] = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(device)
    return ids


def _row_counts(counts: Sequence[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (tuple(counts), str(device), dtype)
    if key not in _COUNTS:
        _COUNTS[key] = torch.tensor(counts, dtype=dtype).to(device)
    return _COUNTS[key]


def _health_counts(modules: int, kl: bool, device: torch.device) -> torch.Tensor:
    """``[modules, HEAD_HEALTH_COUNTS]`` float64: each module measured entropy (1) and, with ``kl``, KL."""
    key = (modules, kl, str(device))
    if key not in _HEALTH_COUNTS:
        _HEALTH_COUNTS[key] = torch.tensor([[1.0, float(kl)]] * modules, dtype=torch.float64).to(device)
    return _HEALTH_COUNTS[key]


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
