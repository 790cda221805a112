"""On-device accumulation of one training iteration's telemetry, drained once to the host.

Every minibatch records the small device tensors it already has (norms, counts, flags) in a
list: no kernel, no synchronisation.  On a CPU a kernel and its dispatch cost microseconds, so
the per-minibatch tail must be as close to nothing as possible; the arithmetic that used to
run per minibatch (seven kernels) runs once per iteration.  Once per training iteration
``drain()`` stacks the records into ONE flat buffer, copies it to the host in a single
transfer and starts over.  The buffer is laid out in lanes that reduce by SUM (norm sums, counts)
followed by lanes that reduce by MAX (latch flags), so the same buffer is what a
cross-learner reduction packs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gradmon_ray.telemetry.lane_fold import LaneFold
from gradmon_ray.telemetry.lane_layout import TelemetryLayout
from gradmon_ray.telemetry.norm_plan import GradientNorms
from gradmon_ray.telemetry.norm_records import StackedNorms


class IterationAccumulator:
    """Device-side record of the current training iteration's minibatches (see the module docstring)."""

    def __init__(self, layout: TelemetryLayout, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.buffer = torch.zeros(layout.size, dtype=torch.float64, device=device)
        # Per minibatch: (norms, skipped) and ([n, heads] rows marking log-prob NaNs, the same
        # marking Infs, a row mask or None), kept as the tensors they already are: recording one
        # is a list append, no kernel; the iteration's records are stacked once, at the drain.
        # A learner records the norms of all its modules at once (``NormRecords``) and hands
        # this module's to ``fold``.
        self._norm_records: list[tuple[GradientNorms, torch.Tensor]] = []
        self._logp_records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._own_fold = LaneFold([layout])

    def add_minibatch_logp(
        self, norms: GradientNorms, per_head_logp: torch.Tensor, skipped: torch.Tensor, mask: torch.Tensor | None = None
    ) -> None:
        """Record one minibatch: norms, the 0-d skip flag and its ``[rows, latch heads]``
        log-probs, by reference: the NaN/Inf flags of the whole iteration are
        computed at the drain, in one pass over all its log-probs (exact per kind; rows where
        ``mask`` is False never latch).  No kernel, no host synchronisation, no copy; the
        log-probs stay alive until the drain (``rows x heads`` floats per minibatch)."""
        self.add_norms(norms, skipped)
        self.add_logp(per_head_logp, mask)

    def add_norms(self, norms: GradientNorms, skipped: torch.Tensor) -> None:
        """Record one minibatch's norms and its skip flag (one element); no kernel."""
        self._norm_records.append((norms, skipped if skipped.dim() == 0 else skipped.reshape(())))

    def add_logp(self, per_head_logp: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Record one minibatch's ``[rows, latch heads]`` log-probs (and loss mask) by reference; no kernel."""
        rows = per_head_logp if per_head_logp.dim() == 2 else per_head_logp.reshape(-1, per_head_logp.shape[-1])
        self._logp_records.append((rows, rows, mask))

    def add_minibatch_logp_sums(self, norms: GradientNorms, logp_sums: torch.Tensor, skipped: torch.Tensor) -> None:
        """Record one minibatch with per-latch-head sums of its log-probs (``latches.logp_sums``:
        NaN when the head had a NaN log-prob, +-Inf when it had an infinite one)."""
        marks = logp_sums.reshape(1, -1)
        self.add_norms(norms, skipped)
        self._logp_records.append((marks, marks, None))

    @torch.no_grad()
    def add_minibatch(
        self,
        norms: GradientNorms,
        logp_nan: torch.Tensor,
        logp_inf: torch.Tensor,
        skipped: torch.Tensor,
    ) -> None:
        """Record one minibatch with explicit 0/1 log-prob NaN and Inf flags per latch head
        (``latches.logp_nonfinite_flags``); the learner uses ``add_logp``."""
        nan_marks = torch.where(logp_nan > 0, float("nan"), 0.0).reshape(1, -1)
        inf_marks = torch.where(logp_inf > 0, float("inf"), 0.0).reshape(1, -1)
        self.add_norms(norms, skipped)
        self._logp_records.append((nan_marks, inf_marks, None))

    @torch.no_grad()
    def take_logp_flags(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per latch head, whether any kept row of the step's log-prob records held a NaN, resp. a
        +-Inf (bool, zeros without a record); the records are cleared."""
        logp, self._logp_records = self._logp_records, []
        if logp:
            return _nonfinite_flags(*zip(*logp, strict=True))
        zeros = torch.zeros(self.layout.num_action_heads, dtype=torch.bool, device=self.device)
        return zeros, zeros

    @torch.no_grad()
    def fold(self) -> torch.Tensor:
        """The step's own records (``add_norms``, ``add_logp``) folded into ``buffer`` (on the
        device, no copy): what a packed reduction carries.  Call ``finish`` with the reduced host
        values afterwards.  (A learner folds all its modules at once: ``lane_fold.LaneFold``.)"""
        own, self._norm_records = self._norm_records, []
        norms = StackedNorms.of(own) if own else None
        self.buffer.copy_(self._own_fold.fold(norms, [([0], self.take_logp_flags())]))
        return self.buffer

    def finish(self, host_lanes: np.ndarray, world_size: int = 1) -> np.ndarray:
        """``host_lanes`` (this buffer's slice of the step's host copy, after any SUM across
        ``world_size`` replicas) as one merged view (``layout.merge_replicas``); zeroes the buffer."""
        self.buffer.zero_()
        return self.layout.merge_replicas(host_lanes, world_size)

    def drain(
        self,
        *,
        reduced_extra: torch.Tensor | None = None,
        local_extra: torch.Tensor | None = None,
        allreduce: Callable[[torch.Tensor], object] | None = None,
        reduce_on_device: bool = False,
        world_size: int = 1,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The iteration's single device->host copy, with at most one SUM reduction.

        ``[buffer, reduced_extra]`` is the reduced part and ``local_extra`` rides unreduced in
        the same copy.  With ``allreduce`` (an in-place SUM across ``world_size`` replicas)
        the reduced part is reduced once: on the device before the copy
        (``reduce_on_device``, e.g. NCCL) or on the host copy after it (e.g. gloo).  The
        lanes then go through ``layout.merge_replicas``; the buffer is zeroed.  Returns
        ``(lanes, reduced_extra_on_host, local_extra_on_host)`` (empty arrays when absent).
        """
        buffer = self.fold()
        empty = buffer.new_zeros(0)
        extra_r = empty if reduced_extra is None else reduced_extra.reshape(-1).to(buffer.dtype)
        extra_l = empty if local_extra is None else local_extra.reshape(-1).to(buffer.dtype)
        n = buffer.numel() + extra_r.numel()
        packed = torch.cat([buffer, extra_r, extra_l])
        host = reduce_and_copy(packed, n, allreduce=allreduce, reduce_on_device=reduce_on_device)
        size = self.layout.size
        lanes = self.finish(host[:size], world_size)
        return lanes, host[size:n].copy(), host[n:].copy()


def reduce_and_copy(
    packed: torch.Tensor,
    num_reduced: int,
    *,
    allreduce: Callable[[torch.Tensor], object] | None = None,
    reduce_on_device: bool = False,
) -> np.ndarray:
    """``packed`` on the host after ONE device->host copy, its first ``num_reduced`` values
    SUM-reduced once (the rest rides unreduced).

    With ``allreduce`` (in place), the reduction runs on the device before the copy
    (``reduce_on_device``, e.g. NCCL) or on the host copy after it (e.g. gloo).
    """
    if allreduce is not None and reduce_on_device:
        allreduce(packed[:num_reduced])
    host = packed.cpu()
    if allreduce is not None and not reduce_on_device:
        allreduce(host[:num_reduced])
    return host.numpy()


def _nonfinite_flags(
    nan_rows: tuple[torch.Tensor, ...], inf_rows: tuple[torch.Tensor, ...], masks: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, whether any kept row of the iteration's records holds a NaN, resp. a +-Inf.

    A handful of ops per step whatever the number of minibatches (a GPU's drain is launch-bound
    like its minibatches): one concatenation per kind, the mask applied once, one ``isnan``
    and one ``isinf`` column ``any``.  The CPU runs what an accelerator runs (no branch on a
    value: that would be a host sync before the drain's copy).
    """
    nan_src = torch.cat(nan_rows) if len(nan_rows) > 1 else nan_rows[0]
    keep = joined_mask([len(r) for r in nan_rows], masks, nan_src.device)
    if all(a is b for a, b in zip(nan_rows, inf_rows, strict=True)):
        return nonfinite_flags(nan_src, keep)
    inf_src = torch.cat(inf_rows) if len(inf_rows) > 1 else inf_rows[0]
    return torch.isnan(_kept(nan_src, keep)).any(0), torch.isinf(_kept(inf_src, keep)).any(0)


def nonfinite_flags(values: torch.Tensor, keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of ``[rows, columns]`` ``values``, whether any row ``keep`` holds (every row
    without it) is NaN, resp. +-Inf (bool): padding rows never latch."""
    values = _kept(values, keep)
    return torch.isnan(values).any(0), torch.isinf(values).any(0)


def _kept(values: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``values`` with the rows ``keep`` drops set to 0 (``values`` itself without a mask)."""
    return values if keep is None else torch.where(keep.unsqueeze(-1), values, 0.0)


def joined_mask(
    rows: list[int], masks: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...], device: torch.device
) -> torch.Tensor | None:
    """Several records' loss masks as one flat bool mask (a record without one keeps all its
    ``rows``), or None when no record has a mask."""
    if all(m is None for m in masks):
        return None
    parts = [
        torch.ones(n, dtype=torch.bool, device=device) if m is None else _flat_bool(m)
        for n, m in zip(rows, masks, strict=True)
    ]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _flat_bool(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as a 1-D bool tensor; no op where it is one already (a step's drain sees one per minibatch)."""
    flat = mask if mask.dim() == 1 else mask.reshape(-1)
    return flat if flat.dtype == torch.bool else flat.bool()
