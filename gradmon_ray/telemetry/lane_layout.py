"""Where each quantity sits in the packed per-iteration buffer: SUM lanes, then MAX lanes.

The accumulator fills a buffer with this layout, the collective reduces it lane by lane and the
tracker reads it back; all three take their offsets from one ``TelemetryLayout``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TelemetryLayout:
    """Lane offsets inside the packed buffer.

    ``num_reported`` heads get norms (the action heads plus the value head);
    ``num_action_heads`` latch heads get log-prob NaN/Inf flags (the action distribution's
    components: ``TelemetryTracker.latch_heads``).
    """

    num_reported: int
    num_action_heads: int

    def __post_init__(self) -> None:
        if self.num_reported < 1 or self.num_action_heads < 1:
            raise ValueError("need num_reported >= 1 and num_action_heads >= 1")

    # SUM lanes -------------------------------------------------------------------
    @property
    def norm_sum(self) -> slice:
        return slice(0, self.num_reported)

    @property
    def global_norm_sum(self) -> int:
        return self.num_reported

    @property
    def norm_count(self) -> slice:
        return slice(self.num_reported + 1, 2 * self.num_reported + 1)

    @property
    def global_norm_count(self) -> int:
        return 2 * self.num_reported + 1

    @property
    def nan_grad_count(self) -> int:
        return 2 * self.num_reported + 2

    @property
    def inf_grad_count(self) -> int:
        return 2 * self.num_reported + 3

    @property
    def skipped(self) -> int:
        return 2 * self.num_reported + 4

    @property
    def minibatches(self) -> int:
        return 2 * self.num_reported + 5

    @property
    def num_sum_lanes(self) -> int:
        return 2 * self.num_reported + 6

    # MAX lanes ---------------------------------------------------------------------
    @property
    def logp_nan(self) -> slice:
        start = self.num_sum_lanes
        return slice(start, start + self.num_action_heads)

    @property
    def logp_inf(self) -> slice:
        start = self.num_sum_lanes + self.num_action_heads
        return slice(start, start + self.num_action_heads)

    @property
    def size(self) -> int:
        return self.num_sum_lanes + 2 * self.num_action_heads

    def merge_replicas(self, lanes: np.ndarray, world_size: int) -> np.ndarray:
        """The lanes after a SUM across ``world_size`` replicas, turned back into one view.

        Norm sums and counts are used as a ratio: SUM needs no correction.  Counts computed
        after DDP's all-reduce (NaN/Inf elements, skipped updates, minibatches) are identical
        on every replica, so their SUM is ``world_size`` times the value.  The MAX lanes are
        0/1 flags on each replica's *local* log-probs, and for 0/1 flags OR == (SUM > 0): one
        SUM reduction carries them without a second call.
        """
        merged = np.array(lanes, dtype=np.float64, copy=True)
        if world_size > 1:
            for lane in (self.nan_grad_count, self.inf_grad_count, self.skipped, self.minibatches):
                merged[lane] /= world_size
            for flags in (self.logp_nan, self.logp_inf):
                merged[flags] = (merged[flags] > 0).astype(np.float64)
        return merged
