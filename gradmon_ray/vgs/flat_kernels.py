"""The VGS ``element`` step on flat EMAs: a fixed handful of kernels whatever the number of tensors.

Eagerly, ``vgs.kernels``' per-tensor step launches about ten kernels per parameter tensor: for a
small model on a GPU (well under 1M parameters, where ``compile="auto"`` does not compile) the
launches, not the bytes, are the cost (417 kernels a minibatch for the default model, against
4 for a fused Adam step).  Here the EMAs are two flat buffers and every gradient is copied once
into a flat scratch buffer of the scaler's (one multi-tensor copy), cleaned and folded there in
place, so a step is 91 kernels whatever the number of tensors (``tests/vgs/test_launches.py``):
3 to copy and clean, 4 to fold, 1 to scale, the rest on the fixed sample.  For large models the
copy is a full extra pass over the gradients and bandwidth, not launches, is the cost: there
the compiled step (``vgs.kernels``), which reads each gradient once, is the faster one
(``bench/vgs.py``: 0.08M, 1M, 10M).  The arithmetic is ``vgs.kernels``' own
(``normalized_entries``, ``quantiles``, ...): the tests check both steps against the same
worked answers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradmon_ray import compat
from gradmon_ray.vgs.kernels import GRAD_LIMIT, cleaned_sums, record_sampled_spatial, sampled_factor


def clean_into(workspace: torch.Tensor, views: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every gradient copied into ``workspace`` (flat, float32, parameter order; ``views``: its
    per-parameter views) and ``clean``ed there in place: one multi-tensor copy and two in-place
    passes, nothing allocated, the same number of kernels whatever the number of tensors.
    ``nan_to_num_`` then ``clamp_`` give ``clean``'s values exactly (NaN -> 0, +-Inf and anything
    beyond -> +-``GRAD_LIMIT``)."""
    compat.foreach_copy_(list(views), list(grads))
    workspace.nan_to_num_(nan=0.0, posinf=GRAD_LIMIT, neginf=-GRAD_LIMIT)
    return workspace.clamp_(-GRAD_LIMIT, GRAD_LIMIT)


def _fold_in_place(x: torch.Tensor, means: torch.Tensor, squares: torch.Tensor, weight: torch.Tensor) -> None:
    """``means <- lerp(means, |x|, weight)``, ``squares <- lerp(squares, x^2, weight)``, using the
    scratch ``x`` itself for ``|x|`` and ``x^2`` (it is overwritten): four passes, no allocation."""
    means.lerp_(x.abs_(), weight)
    squares.lerp_(x.mul_(x), weight)


def fold_elements_flat(
    grads: Sequence[torch.Tensor],
    workspace: torch.Tensor,
    views: Sequence[torch.Tensor],
    means: torch.Tensor,
    squares: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """``vgs.kernels.fold_elements`` on flat ``means``/``squares`` (all elements, parameter order);
    returns the spatial sums ``[sum g, sum g^2, max |g|]`` of the cleaned gradients."""
    x = clean_into(workspace, views, grads)
    sums = cleaned_sums(x)  # cleaned in place already
    _fold_in_place(x, means, squares, weight)
    return sums


def element_step_flat(
    grads: Sequence[torch.Tensor],
    workspace: torch.Tensor,
    views: Sequence[torch.Tensor],
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
    x = clean_into(workspace, views, grads)
    picked = x[sample]
    factor = sampled_factor(
        picked, means[sample], squares[sample], weight, counters[2] + keep, beta, eps, alpha, active
    )
    _fold_in_place(x, means, squares, weight)
    if scale_gradients:
        compat.foreach_mul_(list(grads), factor)
    record_sampled_spatial(picked, x.numel(), counters, keep, weight)
    return factor
