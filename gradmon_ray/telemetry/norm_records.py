"""A step's per-minibatch gradient-norm records: appended by reference, stacked once at the drain.

``NormRecords`` keeps every minibatch's ``PackedNorms`` of all of a learner's modules (one list
append per minibatch) and stacks them, once per step, into one ``StackedNorms`` of every module:
what ``lane_fold.LaneFold`` folds into the modules' lanes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradmon_ray.telemetry.head_assignment import HeadSlots
from gradmon_ray.telemetry.norm_plan import GradientNorms, PackedNorms


@dataclass(frozen=True)
class StackedNorms:
    """A step's per-minibatch norm records of one or more modules, stacked along the minibatches."""

    values: torch.Tensor
    """[minibatches, heads + modules]: each head's norm (every module's heads, in order), then each
    module's global norm; NaN where there was no gradient."""
    counts: torch.Tensor
    """[3, minibatches, modules]: NaN elements, Inf elements, skipped (0/1)."""
    found: torch.Tensor
    """[minibatches, modules] bool: any NaN/Inf gradient element."""
    num_heads: int

    @property
    def head_norms(self) -> torch.Tensor:
        """[minibatches, heads]"""
        return self.values[:, : self.num_heads]

    @property
    def scalars(self) -> torch.Tensor:
        """[4, minibatches, modules]: global norm, NaN count, Inf count, skipped (a read API; the
        drain folds ``values`` and ``counts``)."""
        return torch.cat([self.values[:, self.num_heads :].unsqueeze(0), self.counts])

    @classmethod
    def of(cls, records: list[tuple[GradientNorms, torch.Tensor]]) -> StackedNorms:
        """Stack one module's ``(norms, skipped)`` records (``IterationAccumulator.add_norms``)."""
        heads = torch.stack([n.head_norms for n, _ in records])
        scalars = torch.stack([torch.stack([n.global_norm, n.nan_count, n.inf_count, s]) for n, s in records], dim=1)
        scalars = scalars.reshape(4, len(records), 1).to(torch.float64)
        return cls(
            torch.cat([heads.to(torch.float64), scalars[0]], dim=1),
            scalars[1:],
            scalars[1] + scalars[2] > 0,
            heads.shape[1],
        )


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

    def __len__(self) -> int:
        """Minibatches recorded this step (the index the next one gets)."""
        return len(self._records)

    @property
    def records(self) -> tuple[PackedNorms, ...]:
        """This step's records so far, in order (a module change carries them over: ``rllib.module_changes``)."""
        return tuple(self._records)

    def stacked(self) -> StackedNorms | None:
        """Every module's records of the step, stacked once a step (None without a minibatch)."""
        if self._stacked is None and self._records:
            self._stacked = self._stack()
        return self._stacked

    def module(self, index: int) -> StackedNorms | None:
        """Module ``index``'s records of the step (None without a minibatch)."""
        stacked = self.stacked()
        if stacked is None:
            return None
        heads = self.slots.module_heads(stacked.head_norms, index)
        glob = stacked.values[:, stacked.num_heads + index : stacked.num_heads + index + 1]
        return StackedNorms(
            torch.cat([heads, glob], dim=1),
            stacked.counts[:, :, index : index + 1],
            stacked.found[:, index : index + 1],
            heads.shape[1],
        )

    def _stack(self) -> StackedNorms:
        # float64 from the start: the lanes sum in float64, and converting once here costs one op
        # where converting the norms and the counts apart costs two.
        packed = torch.stack([n.packed for n in self._records]).double()
        heads, m = self.slots.trunk_base, self.slots.num_modules
        values = packed[:, : heads + m].sqrt()  # head norms and global norms are adjacent: one root
        counts = packed[:, heads + m :].round()  # [minibatches, 2 * modules]: non-finite, NaN
        nonfinite, nan = counts[:, :m], counts[:, m:]
        found = nonfinite > 0
        skips = found.to(packed.dtype) if self.skip_mask is None else found * self.skip_mask  # bool * float: float
        return StackedNorms(values, torch.stack([nan, nonfinite - nan, skips]), found, heads)

    def clear(self) -> None:
        """Start the next step."""
        self._records = []
        self._stacked = None
