"""Every module's telemetry lanes of one step, folded in one pass: a fixed number of ops for all modules.

A learner's norm records hold every module's heads and scalars side by side (``NormRecords``:
``[minibatches, heads of all modules]`` and ``[4, minibatches, modules]``).  Folding them module
by module cost some fifteen ops a module a step; here the sums, counts and "trained" lanes of all
modules come from one set of reductions along the minibatch axis, and one ``index_select`` puts
each module's lanes in its ``TelemetryLayout`` order, module after module: the vector the step's
packed reduction carries.  Only the log-prob latch flags are per module (each module's records
have their own rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradmon_ray.telemetry.lane_layout import TelemetryLayout
from gradmon_ray.telemetry.norm_records import StackedNorms


class LaneFold:
    """Folds a step's stacked norm records of modules with ``layouts`` (in order) into their lanes."""

    def __init__(self, layouts: Sequence[TelemetryLayout]) -> None:
        self.layouts = tuple(layouts)
        self.sizes = [layout.size for layout in self.layouts]
        self._order = _lane_order(self.layouts)
        self._index: torch.Tensor | None = None  # ``_order`` on the device, made once

    @property
    def num_heads(self) -> int:
        return sum(layout.num_reported for layout in self.layouts)

    @torch.no_grad()
    def fold(self, norms: StackedNorms | None, flags: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """float64 ``[sum of layout sizes]``: each module's lanes, module after module.

        ``norms``: the step's records of every module (``head_norms`` ``[minibatches, heads]``,
        ``scalars`` ``[4, minibatches, modules]`` or, for one module, ``[4, minibatches]``), None
        without a minibatch (all lanes zero); ``flags``: per module its (NaN, Inf) log-prob flags."""
        f64 = torch.float64
        if norms is None:
            return torch.zeros(sum(self.sizes), dtype=f64, device=flags[0][0].device if flags else "cpu")
        heads, m = self.num_heads, len(self.layouts)
        scalars = norms.scalars.to(f64)
        if scalars.dim() == 2:  # one module's records
            scalars = scalars.unsqueeze(-1)
        values = torch.cat([norms.head_norms.to(f64), scalars[0]], dim=1)  # [minibatches, heads + modules]
        known = values == values  # NaN norms are left out of the sums and counts, Inf kept
        # A minibatch counts where the module had a gradient: a NaN global norm without NaN/Inf
        # elements is a module this minibatch did not train (its agents were not in it).
        trained = known[:, heads:] | (scalars[1] + scalars[2] > 0)
        lanes = torch.cat(
            [
                torch.where(known, values, 0.0).sum(0),
                known.sum(0),
                scalars[1:].sum(1).reshape(-1),  # NaN counts, Inf counts, skips: [3 * modules]
                trained.sum(0),
                *(flag for pair in flags for flag in pair),
            ]
        )
        if m == 1:  # one module's lanes are already in its layout's order
            return lanes
        if self._index is None or self._index.device != lanes.device:
            self._index = torch.tensor(self._order, dtype=torch.long, device=lanes.device)
        return lanes.index_select(0, self._index)


def _lane_order(layouts: Sequence[TelemetryLayout]) -> list[int]:
    """Where each module's lanes (its ``TelemetryLayout`` order) sit in ``LaneFold.fold``'s
    concatenation: ``[norm sums (heads, then modules), their counts (same), NaN counts, Inf
    counts, skips, minibatches trained (a block of modules each), log-prob flags module by module]``."""
    heads, m = sum(lay.num_reported for lay in layouts), len(layouts)
    sums = heads + m
    flags_at = 2 * sums + 4 * m
    order: list[int] = []
    head_offset = 0
    for k, lay in enumerate(layouts):
        own = range(head_offset, head_offset + lay.num_reported)
        order += [*own, heads + k]  # norm sums: heads, global
        order += [sums + h for h in own] + [sums + heads + k]  # their counts
        order += [2 * sums + block * m + k for block in range(4)]  # NaN, Inf, skipped, minibatches
        order += range(flags_at, flags_at + 2 * lay.num_action_heads)  # log-prob NaN flags, Inf flags
        flags_at += 2 * lay.num_action_heads
        head_offset += lay.num_reported
    return order
