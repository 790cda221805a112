"""A step's per-minibatch gradient-norm records: appended by reference, stacked once at the drain.

``NormRecords`` keeps every minibatch's ``PackedNorms`` of all of a learner's modules (one list
append per minibatch) and turns them, once per step, into each module's ``StackedNorms``: what
``accumulator.IterationAccumulator`` folds into its lanes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradmon_ray.telemetry.head_assignment import HeadSlots
from gradmon_ray.telemetry.norm_plan import GradientNorms, PackedNorms


@dataclass(frozen=True)
class StackedNorms:
    """A step's per-minibatch norm records of one module, stacked: ``[minibatches, ...]`` tensors."""

    head_norms: torch.Tensor
    """[minibatches, heads]"""
    scalars: torch.Tensor
    """[4, minibatches]: global norm, NaN count, Inf count, skipped flag."""

    @classmethod
    def of(cls, records: list[tuple[GradientNorms, torch.Tensor]]) -> StackedNorms:
        """Stack ``(norms, skipped)`` records: two stack calls, not five (~20 us each on a CPU); batched
        records (``[modules]`` fields) give ``scalars`` of ``[4, minibatches, modules]``."""
        fields = list(
            zip(*((n.head_norms, n.global_norm, n.nan_count, n.inf_count, s) for n, s in records), strict=True)
        )
        per_module = fields[1][0].shape  # () for one module's records, (modules,) for batched ones
        scalars = torch.stack(fields[1] + fields[2] + fields[3] + fields[4]).reshape(4, len(records), *per_module)
        return cls(torch.stack(fields[0]), scalars)


class NormRecords:
    """A learner's per-minibatch norm records of ALL its modules (``GradientNormPlan.compute_all``):
    one list append per minibatch, whatever the number of modules; ``stacked`` gives all of them at
    the drain (``lane_fold.LaneFold`` folds them at once), ``module`` one module's.

    ``skip_mask`` (``[modules]`` 0/1 floats): whether a minibatch with a non-finite gradient
    counts as skipped in that module (default: in every module).  The skips, square roots and
    Inf counts (non-finite minus NaN) of every record are derived at the drain, at once: a
    handful of kernels a step, none a minibatch."""

    def __init__(self, slots: HeadSlots, skip_mask: torch.Tensor | None = None) -> None:
        self.slots = slots
        self.skip_mask = skip_mask
        self._records: list[PackedNorms] = []
        self._stacked: StackedNorms | None = None

    def add(self, norms: PackedNorms) -> None:
        """Record one minibatch of every module (``GradientNormPlan.compute_all``): no kernel."""
        self._records.append(norms)

    def stacked(self) -> StackedNorms | None:
        """Every module's records of the step, stacked (None without a minibatch): ``head_norms``
        ``[minibatches, heads of all modules]``, ``scalars`` ``[4, minibatches, modules]``; stacked once a step."""
        if self._stacked is None and self._records:
            self._stacked = self._stack()
        return self._stacked

    def module(self, index: int) -> StackedNorms | None:
        """Module ``index``'s records of the step (None without a minibatch): views of ``stacked()``."""
        stacked = self.stacked()
        if stacked is None:
            return None
        return StackedNorms(self.slots.module_heads(stacked.head_norms, index), stacked.scalars[:, :, index])

    def _stack(self) -> StackedNorms:
        # float64 from the start: the lanes sum in float64, and converting once here costs one op
        # where converting the norms and the scalars apart costs two.
        packed = torch.stack([n.packed for n in self._records]).double()
        stacked = PackedNorms(packed, (), self.slots.trunk_base)
        nonfinite, nan = stacked.nonfinite_count, stacked.nan_count
        scalars = torch.stack([stacked.global_norm, nan, nonfinite - nan, self._derived_skips(nonfinite)])
        return StackedNorms(stacked.head_norms, scalars)

    def _derived_skips(self, nonfinite: torch.Tensor) -> torch.Tensor:
        found = nonfinite > 0
        return found.to(nonfinite.dtype) if self.skip_mask is None else found * self.skip_mask  # bool * float: float

    def clear(self) -> None:
        """Start the next step."""
        self._records = []
        self._stacked = None
