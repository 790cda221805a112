"""The DDP comm hook behind the per-head gradient noise scale (2+ learners).

DDP all-reduces gradients bucket by bucket; a comm hook sees each bucket's LOCAL gradients
just before that all-reduce.  ``NoiseScaleHook`` adds their per-head squared norms into the
"local" noise lanes on the device, then hands the bucket to DDP's own ``allreduce_hook``
(which still does the averaging).  After the all-reduce the learner adds the "big batch"
squared norms (``add_big``).  Lane layout and arithmetic: ``gradmon_ray.telemetry.noise_scale``.
A head may hold rows of a parameter (``ParamRows``): those rows' squares go to the head, the
parameter's other rows to the trunk lane.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from gradmon_ray import compat
from gradmon_ray.telemetry.head_norms import HeadPart, ParamRows
from gradmon_ray.telemetry.noise_scale import noise_lane_count


class _BucketLayout(NamedTuple):
    """One DDP bucket's lane indices, built once per bucket layout."""

    index: torch.Tensor  # lane of each tensor's square (heads, else the trunk)
    row_params: tuple[tuple[int, int], ...]  # (tensor position, row count) of each row-split parameter
    row_positions: torch.Tensor  # their tensor positions
    row_index: torch.Tensor  # the lane of each of their rows (a head's, else the trunk), then a trunk lane each


class NoiseScaleHook:
    """Owns one iteration's noise lanes (float64, on ``device``) and the comm hook filling them.

    ``groups`` maps each reported head to its parts (disjoint whole parameters or
    ``ParamRows``); every other parameter (or row of a row-split one) DDP reduces counts as
    trunk.  ``scale`` returns the
    loss scale (a 0-d tensor) when a ``GradScaler`` is in use, else None: DDP reduces the
    still-scaled gradients, so the local squares are unscaled here.
    """

    def __init__(
        self,
        groups: Mapping[str, Sequence[HeadPart]],
        device: torch.device | str | None = None,
        scale: Callable[[], torch.Tensor | None] | None = None,
    ) -> None:
        self.num_heads = len(groups)
        self.lanes = torch.zeros(noise_lane_count(self.num_heads), dtype=torch.float64, device=device)
        self.rows = 0
        """Rows of the minibatches added with ``add_big`` since the last ``take_rows``."""
        self._local = self.lanes[: self.num_heads + 2]  # heads, trunk, global
        self._big = self.lanes[self.num_heads + 2 :]  # heads, global
        self._slot_of: dict[int, int] = {}
        self._rows_of: dict[int, list[tuple[slice, int]]] = {}  # id -> [(rows, head slot)]
        for slot, parts in enumerate(groups.values()):
            for part in parts:
                if isinstance(part, ParamRows):
                    self._rows_of.setdefault(id(part.param), []).append((part.rows, slot))
                else:
                    self._slot_of[id(part)] = slot
        self._index_cache: dict[tuple[int, ...], _BucketLayout] = {}
        self._scale = scale
        self._enabled = False
        self._allreduce: Callable[..., Any] | None = None

    def local_norm_hook(self, state, bucket):  # type: ignore[no-untyped-def]
        # No annotations: DDP checks them against dist.GradBucket / Future[Tensor], and under
        # `from __future__ import annotations` they would be strings.
        if self._enabled:
            self.add_local(bucket.parameters(), bucket.gradients())
        return self._allreduce(state, bucket)  # state: the DDP module's own process group

    def add_local(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """Add the squared norms of ``grads`` (the local gradients of ``params``) to the local lanes."""
        key = tuple(id(p) for p in params)
        layout = self._index_cache.get(key)
        if layout is None:  # DDP may rebuild its buckets after the first iteration
            layout = self._layout(params)
            self._index_cache[key] = layout
        grads = list(grads)
        squares = torch.stack(compat.foreach_norm(grads)).double() ** 2
        scale = self._scale() if self._scale is not None else None
        if scale is not None:
            squares = squares / scale.double() ** 2
        self._local[: self.num_heads + 1].index_add_(0, layout.index, squares)
        self._local[self.num_heads + 1 :].add_(squares.sum())
        if layout.row_params:
            # A row-split parameter's whole square went to the trunk: take it back out and add
            # each of its rows' squares (one row-wise norm per parameter) to its head's lane.
            rows = [torch.linalg.vector_norm(grads[i].reshape(n, -1), dim=1) for i, n in layout.row_params]
            rows_sq = torch.cat(rows).double() ** 2
            if scale is not None:
                rows_sq = rows_sq / scale.double() ** 2
            values = torch.cat([rows_sq, -squares.index_select(0, layout.row_positions)])
            self._local[: self.num_heads + 1].index_add_(0, layout.row_index, values)

    def _layout(self, params: Sequence[torch.Tensor]) -> _BucketLayout:
        device = self.lanes.device
        index = torch.tensor([self._slot_of.get(id(p), self.num_heads) for p in params], device=device)
        split = [(i, p.shape[0]) for i, p in enumerate(params) if id(p) in self._rows_of]
        row_slots: list[int] = []
        for i, n in split:
            slots = [self.num_heads] * n
            for rows, slot in self._rows_of[id(params[i])]:
                slots[rows] = [slot] * (rows.stop - rows.start)
            row_slots += slots
        row_index = torch.tensor(row_slots + [self.num_heads] * len(split), dtype=torch.long, device=device)
        positions = torch.tensor([i for i, _ in split], dtype=torch.long, device=device)
        return _BucketLayout(index, tuple(split), positions, row_index)

    def add_big(self, head_norms: torch.Tensor, global_norm: torch.Tensor, rows: int) -> None:
        """Add one minibatch's all-reduced norms (per head, then global) and its local row count."""
        self._big.add_(torch.cat([head_norms, global_norm.reshape(1)]).double() ** 2)
        self.rows += rows

    def take_rows(self) -> int:
        """The rows counted since the last call; resets the count."""
        rows, self.rows = self.rows, 0
        return rows

    def zero_(self) -> None:
        """Zero the lanes (after the iteration's reduction)."""
        self.lanes.zero_()

    def register(self, module: Any) -> bool:
        """Install on ``module`` if it is a ``DistributedDataParallel`` (True), else do nothing."""
        if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
            return False
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._allreduce = allreduce_hook
        # DDP's own all-reduce on the module's process group (a learner with several modules
        # averages them itself instead: ``enable`` and ``add_local``, rllib.module_sync).
        module.register_comm_hook(state=module.process_group, hook=self.local_norm_hook)
        self._enabled = True
        return True

    def enable(self) -> bool:
        """Measure without DDP: the caller hands each module's local gradients to ``add_local``."""
        self._enabled = True
        return True

    def remove(self) -> None:
        """Stop measuring.  DDP cannot unregister a comm hook: it stays DDP's plain all-reduce."""
        self._enabled = False

    @property
    def enabled(self) -> bool:
        return self._enabled
