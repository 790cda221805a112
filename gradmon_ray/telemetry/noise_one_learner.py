"""The gradient noise scale with ONE learner: the first epoch's minibatches against their mean.

With several learners ``telemetry.noise_scale`` compares each learner's gradient (``b`` samples)
with their average (``k * b``).  With one learner the two batch sizes come from the first epoch
of an update: each of its ``K`` minibatches is a small-batch gradient ``g_i`` (``b`` rows, its
squared norm already rides the step's host copy: the minibatch norms), and their mean
``(1/K) sum g_i`` stands for the big batch (``K * b`` rows, disjoint samples: the first epoch
visits each row once).  ``E|g_b|^2 = |G|^2 + tr(Sigma)/b`` then gives ``|G|^2`` and
``tr(Sigma)`` as in ``telemetry.noise_scale`` (McCandlish et al. 2018, Appendix A).

The approximation and its bias: the minibatches of one epoch are taken at different weights
(the optimizer steps between them), so the mean is not the gradient of one ``K * b`` batch at
one point: the movement within the epoch adds to the spread between the ``g_i`` and so to
``tr(Sigma)`` (B_simple reads high when the steps are large against the gradient), and PPO's
advantages are standardized over the whole batch, so the samples are not independent.  With
several learners both estimates exist and the tests compare them (docs/metrics.md).

Cost: one multi-tensor add a minibatch of the first epoch (into a flat buffer), five ops a
step (the mean's per-head squared norms: one multi-tensor norm, stack, square, ``index_add``,
and the buffer zeroed); no host read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from gradmon_ray import compat
from gradmon_ray.telemetry.head_assignment import HeadSlots, flat_pieces
from gradmon_ray.telemetry.head_norms import HeadPart


class EpochGradientSum:
    """The sum of one module's gradients over the first epoch's minibatches, per head at the drain."""

    def __init__(self, groups: Mapping[str, Iterable[HeadPart]], params: Sequence[torch.nn.Parameter]) -> None:
        slots = HeadSlots([(dict(groups), tuple(params))])
        self.params = list(params)
        device = self.params[0].device if self.params else torch.device("cpu")
        sizes = [p.numel() for p in self.params]
        self._sum = torch.zeros(sum(sizes), device=device)
        self._views = [v.view(p.shape) for v, p in zip(self._sum.split(sizes), self.params, strict=True)]
        pieces, piece_slot, _ = flat_pieces(slots, range(len(self.params)), self._views)
        h = slots.trunk_base
        heads = [k for k, slot in enumerate(piece_slot) if slot < h]
        self._pieces = pieces
        self._order = [*heads, *range(len(pieces))]
        destinations = [*(piece_slot[k] for k in heads), *([h] * len(pieces))]  # heads, then the module's total
        self._index = torch.tensor(destinations, dtype=torch.long, device=device)
        self._base = torch.zeros(h + 1, device=device)
        self.minibatches: list[int] = []
        """Indices (in the step) of the minibatches added."""

    def add(self, index: int) -> bool:
        """Add the module's current gradients (minibatch ``index`` of the step); False if one is missing."""
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            return False
        compat.foreach_add_(self._views, grads)
        self.minibatches.append(index)
        return True

    def drain(self) -> torch.Tensor:
        """``[heads + 1]`` squared norms of the SUM (heads, then all parameters); zeroes the sum."""
        norms = compat.foreach_norm(self._pieces)
        values = torch.stack([norms[k] for k in self._order])
        out = torch.index_add(self._base, 0, self._index, values * values)
        self._sum.zero_()
        return out


def one_learner_noise_inputs(
    sum_sq: np.ndarray, minibatch_norms: np.ndarray, minibatches: Sequence[int], rows: int
) -> tuple[np.ndarray, np.ndarray, float, float] | None:
    """``(sq_small, sq_big, b_small, b_big)`` for ``NoiseScaleTracker.update``: the mean squared norm of
    the added minibatches' gradients (``minibatch_norms``' rows ``minibatches``: ``[.., heads + 1]``),
    the squared norm of their mean (``sum_sq / K^2``), ``rows`` a minibatch and ``K * rows``.
    None with fewer than two minibatches (no second batch size)."""
    k = len(minibatches)
    if k < 2 or rows <= 0:
        return None
    small = np.asarray(minibatch_norms, dtype=np.float64)[list(minibatches)] ** 2
    if not np.isfinite(small).all():
        return None  # a non-finite minibatch (skipped): no estimate this step
    return small.mean(axis=0), np.asarray(sum_sq, dtype=np.float64) / (k * k), float(rows), float(k * rows)
