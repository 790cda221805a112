"""How much each loss component contributes to the total gradient."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import torch


def _flat(grads: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    parts = []
    for i, g in enumerate(grads):
        if g is None:
            if like is None:
                continue
            g = torch.zeros_like(like[i])
        parts.append(g.reshape(-1).double())
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def signed_shares(component_grads: Mapping[str, Sequence[torch.Tensor]]) -> dict[str, float]:
    """``share_i = <g_i, g> / ||g||^2`` with ``g = sum_i g_i``; the shares sum to 1.

    Each component's gradient is a sequence of tensors over the same parameters (same order
    and shapes).  A share can be negative (the component pulls against the total) or above 1.
    All shares are NaN when the total gradient is zero.
    """
    flats = {name: _flat(grads) for name, grads in component_grads.items()}
    if not flats:
        return {}
    total = torch.stack(list(flats.values())).sum(0)
    denom = float(total @ total)
    if denom == 0.0:
        return {name: float("nan") for name in flats}
    return {name: float(g @ total) / denom for name, g in flats.items()}


def cosine_similarities(component_grads: Mapping[str, Sequence[torch.Tensor]]) -> dict[tuple[str, str], float]:
    """Cosine similarity between every pair of component gradients (NaN if one is zero)."""
    flats = {name: _flat(grads) for name, grads in component_grads.items()}
    out = {}
    for a, b in itertools.combinations(flats, 2):
        na, nb = float(flats[a].norm()), float(flats[b].norm())
        out[(a, b)] = float(flats[a] @ flats[b]) / (na * nb) if na > 0 and nb > 0 else math.nan
    return out
