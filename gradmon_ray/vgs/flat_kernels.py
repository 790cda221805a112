"""The VGS ``element`` step on flat EMAs: a fixed handful of kernels whatever the number of tensors.

Eagerly, ``vgs.kernels``' per-tensor step launches about ten kernels per parameter tensor: for a
small model on a GPU (well under 1M parameters, where ``compile="auto"`` does not compile) the
launches, not the bytes, are the cost (417 kernels a minibatch for the default model, against
4 for a fused Adam step).  Here every gradient is concatenated once and the EMAs are two flat
buffers, so a step is about 40 kernels (one concatenation, one gather per buffer, the sample's
selection, two in-place EMA updates, one multi-tensor scale).  For large models the
concatenation is a full extra copy of the gradients and bandwidth, not launches, is the cost:
there the compiled per-tensor step (``vgs.kernels``), which reads each gradient once and
allocates nothing gradient-sized, is the faster one (``bench/vgs.py``: 0.08M, 1M, 10M).  The
arithmetic is ``vgs.kernels``' own (``clean``, ``normalized_entries``, ``quantiles``, ...):
the tests check both steps against the same worked answers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradmon_ray import compat
from gradmon_ray.vgs.kernels import clean, record_sampled_spatial, sampled_factor, spatial_sums


def flat_cleaned(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every gradient flattened into one vector (parameter order), ``clean``ed."""
    return clean(compat.flatten_dense(list(grads)))


def fold_elements_flat(
    grads: Sequence[torch.Tensor],
    means: torch.Tensor,
    squares: torch.Tensor,
    weight: torch.Tensor,
    factor: torch.Tensor | None,
) -> torch.Tensor:
    """``vgs.kernels.fold_elements`` on flat ``means``/``squares`` (all elements, parameter order);
    returns the spatial sums ``[sum g, sum g^2, max |g|]`` of the cleaned gradients."""
    x = flat_cleaned(grads)
    means.lerp_(x.abs(), weight)
    squares.lerp_(x * x, weight)
    if factor is not None:
        compat.foreach_mul_(list(grads), factor)
    return spatial_sums([x])


def element_step_flat(
    grads: Sequence[torch.Tensor],
    means: torch.Tensor,
    squares: torch.Tensor,
    sample: torch.Tensor,
    counters: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    skip: torch.Tensor,
    active: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    alpha: float,
    scale_gradients: bool,
) -> torch.Tensor:
    """``vgs.kernels.element_step`` on flat EMAs, ``sample`` as flat entry indices; returns the factor."""
    keep = 1.0 - skip
    weight = (1.0 - beta) * keep
    x = flat_cleaned(grads)
    picked = x[sample]
    factor = sampled_factor(
        picked, means[sample], squares[sample], weight, counters[2] + keep, beta, eps, alpha, active
    )
    means.lerp_(x.abs(), weight)
    squares.lerp_(x * x, weight)
    if scale_gradients:
        compat.foreach_mul_(list(grads), factor)
    record_sampled_spatial(picked, x.numel(), counters, keep, weight)
    return factor
