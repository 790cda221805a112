"""Every module's telemetry lanes of one step, folded in one pass: a fixed number of ops for all modules.

A learner's norm records hold every module's heads and scalars side by side (``NormRecords``:
``[minibatches, heads of all modules]`` and ``[4, minibatches, modules]``).  Folding them module
by module cost some fifteen ops a module a step; here the sums, counts and "trained" lanes of all
modules come from one set of reductions along the minibatch axis, and one ``index_select`` puts
each module's lanes in its ``TelemetryLayout`` order, module after module: the vector the step's
packed reduction carries.  The log-prob latch flags come in blocks of one or more modules
(``rllib.module_groups``: modules with the same action distribution are measured together).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradmon_ray.telemetry.lane_layout import TelemetryLayout
from gradmon_ray.telemetry.norm_records import StackedNorms

FlagBlock = tuple[Sequence[int], Sequence[torch.Tensor]]
"""(module indices, tensors whose concatenation holds, module after module, each module's NaN
flags then its Inf flags, one per latch head): the latch flags of one or more modules."""


class LaneFold:
    """Folds a step's stacked norm records of modules with ``layouts`` (in order) into their lanes."""

    def __init__(self, layouts: Sequence[TelemetryLayout]) -> None:
        self.layouts = tuple(layouts)
        self.sizes = [layout.size for layout in self.layouts]
        self._index: dict[tuple[tuple[int, ...], ...], torch.Tensor] = {}  # per grouping of the flags, on the device

    @property
    def num_heads(self) -> int:
        return sum(layout.num_reported for layout in self.layouts)

    @torch.no_grad()
    def fold(self, norms: StackedNorms | None, flags: Sequence[FlagBlock]) -> torch.Tensor:
        """float64 ``[sum of layout sizes]``: each module's lanes, module after module.

        ``norms``: the step's records of every module (``NormRecords.stacked``), None without a
        minibatch (all lanes zero); ``flags``: the log-prob flags of every module, in
        blocks (``FlagBlock``), each module in exactly one."""
        f64 = torch.float64
        if norms is None:
            device = flags[0][1][0].device if flags else "cpu"
            return torch.zeros(sum(self.sizes), dtype=f64, device=device)
        heads = self.num_heads
        values = norms.values.to(f64)  # [minibatches, heads + modules] (float64 already: no op)
        known = values == values  # NaN norms are left out of the sums and counts, Inf kept
        # A minibatch counts where the module had a gradient: a NaN global norm without NaN/Inf
        # elements is a module this minibatch did not train (its agents were not in it).
        trained = known[:, heads:] | norms.found
        lanes = torch.cat(
            [
                torch.where(known, values, 0.0).sum(0),
                known.sum(0),
                norms.counts.sum(1).reshape(-1),  # NaN counts, Inf counts, skips: [3 * modules]
                trained.sum(0),
                *(tensor for _, tensors in flags for tensor in tensors),
            ]
        )
        grouping = tuple(tuple(indices) for indices, _ in flags)
        if grouping == ((0,),):  # one module's lanes are already in its layout's order
            return lanes
        index = self._index.get(grouping)
        if index is None or index.device != lanes.device:
            order = _lane_order(self.layouts, grouping)
            index = self._index[grouping] = torch.tensor(order, dtype=torch.long).to(lanes.device)
        return lanes.index_select(0, index)


def _lane_order(layouts: Sequence[TelemetryLayout], grouping: Sequence[Sequence[int]]) -> list[int]:
    """Where each module's lanes (its ``TelemetryLayout`` order) sit in ``LaneFold.fold``'s
    concatenation: ``[norm sums (heads, then modules), their counts (same), NaN counts, Inf
    counts, skips, minibatches trained (a block of modules each), the flag blocks]``."""
    heads, m = sum(lay.num_reported for lay in layouts), len(layouts)
    sums = heads + m
    flags_of: dict[int, int] = {}  # module -> where its NaN flags start
    at = 2 * sums + 4 * m
    for indices in grouping:
        for k in indices:
            flags_of[k] = at
            at += 2 * layouts[k].num_action_heads
    if sorted(flags_of) != list(range(m)):
        raise ValueError(f"the flag blocks {list(grouping)} must hold each of the {m} modules once")
    order: list[int] = []
    head_offset = 0
    for k, lay in enumerate(layouts):
        own = range(head_offset, head_offset + lay.num_reported)
        order += [*own, heads + k]  # norm sums: heads, global
        order += [sums + h for h in own] + [sums + heads + k]  # their counts
        order += [2 * sums + block * m + k for block in range(4)]  # NaN, Inf, skipped, minibatches
        order += range(flags_of[k], flags_of[k] + 2 * lay.num_action_heads)  # log-prob NaN flags, Inf flags
        head_offset += lay.num_reported
    return order
