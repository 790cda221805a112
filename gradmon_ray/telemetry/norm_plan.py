"""The per-minibatch norm pass: every head's norm, the global norm, NaN/Inf counts (TELE-300/301/310/320).

``GradientNormPlan`` precomputes which gradient goes to which head once, then computes, per
minibatch, the same numbers as ``head_norms.per_head_grad_norms`` for every head at once with a
handful of kernels and no host synchronisation (Megatron's ``clip_grads.py`` pattern: one norm
pass, reused for clipping).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gradmon_ray import compat
from gradmon_ray.compile_on_demand import Kernel, wants_compile
from gradmon_ray.telemetry.head_norms import HeadPart, ParamRows


@dataclass(frozen=True)
class GradientNorms:
    """One minibatch's gradient telemetry, all 0-d/1-d tensors on the parameters' device."""

    head_norms: torch.Tensor
    """[num_heads] L2 norm per head; NaN for a head with no gradient."""
    global_norm: torch.Tensor
    """0-d L2 norm over every gradient the plan covers (heads and shared trunk)."""
    nan_count: torch.Tensor
    """0-d number of NaN gradient elements."""
    inf_count: torch.Tensor
    """0-d number of +-Inf gradient elements."""

    @property
    def found_nonfinite(self) -> torch.Tensor:
        """0-d float tensor, 1.0 when any gradient element is NaN/Inf (the skip flag)."""
        return ((self.nan_count + self.inf_count) > 0).to(torch.float32)


def squares_and_counts(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tensor ``sum(g^2)`` (float32), and the NaN and +-Inf element counts over all of them.

    Compiled (``GradientNormPlan`` on an accelerator, large models), each tensor is read ONCE
    for all three reductions and nothing gradient-sized is allocated; eagerly it is a few
    passes per tensor (the fallback when compiling fails).
    """
    squares, nans, infs = [], [], []
    for grad in grads:
        x = grad.float()
        squares.append((x * x).sum())
        nans.append((x != x).sum())
        infs.append(torch.isinf(x).sum())
    return torch.stack(squares), torch.stack(nans).sum().float(), torch.stack(infs).sum().float()


class _Index(NamedTuple):
    """The plan's tensors for one pattern of present gradients (see ``GradientNormPlan._index_for``)."""

    whole: torch.Tensor  # slot of each present gradient (a row-split parameter's: the trunk slot)
    row_params: tuple[tuple[int, int], ...]  # (position in params, row count) of row-split params with a gradient
    rows: torch.Tensor  # slot of each of their rows, concatenated (rows no head takes: the trunk slot)
    has_grad: torch.Tensor  # per head: does any part of it have a gradient


class GradientNormPlan:
    """Precomputed parameter-to-head assignment for fast per-minibatch norms.

    ``groups`` maps each reported head to its parts (``HeadPart``: whole parameters, or
    ``ParamRows``); ``all_params`` is every trainable parameter (heads plus the shared trunk),
    which the global norm and the NaN/Inf counts cover, always over whole tensors.  Two heads
    may take disjoint rows of one parameter; overlapping rows, or a parameter taken whole by
    one head and by rows by another, raise ``ValueError``.  ``compute()`` never synchronises
    with the host; how it counts NaN/Inf elements depends on where the gradients are:

    * CPU: one ``_foreach_norm`` (as ``torch.nn.utils.clip_grad_norm_`` uses) and one
      ``index_add_``; the counts only when the global norm is not finite (testing a CPU
      tensor is no device sync);
    * accelerator, ``fused_counts`` (``"auto"``: from ``AUTO_COMPILE_MIN_PARAMETERS``
      gradient elements): ``squares_and_counts`` compiled, one read of every gradient for
      the norms and the counts together, no copy;
    * accelerator otherwise: ``_foreach_norm`` plus one concatenation of the gradients for
      the counts (three kernels: at small sizes launches, not bytes, are the cost).

    Each row-split parameter adds one row-wise norm (``vector_norm(dim=1)``, its rows' squares
    then go to their heads with the same ``index_add_``): a fixed cost, however many heads split it.
    """

    def __init__(
        self,
        groups: Mapping[str, Iterable[HeadPart]],
        all_params: Iterable[torch.nn.Parameter],
        *,
        fused_counts: str = "auto",
    ) -> None:
        self.head_names: tuple[str, ...] = tuple(groups)
        self.params: tuple[torch.nn.Parameter, ...] = tuple(all_params)
        numel = sum(p.numel() for p in self.params)
        self._fused = Kernel(squares_and_counts, compile=True, label="gradient norms")
        self._use_fused = wants_compile(fused_counts, numel)
        self._trunk_slot = len(self.head_names)
        slot_of, rows_of = _assign_slots(groups)
        position = {id(p): i for i, p in enumerate(self.params)}
        if any(pid not in position for pid in [*slot_of, *rows_of]):
            raise ValueError("every head parameter must also be listed in all_params")
        self._slots = [slot_of.get(id(p), self._trunk_slot) for p in self.params]
        # Per row-split parameter: (position, the head slot of each of its rows, else the trunk's).
        self._row_params = tuple((position[pid], _row_slots(parts, self._trunk_slot)) for pid, parts in rows_of.items())
        # Cache of the index tensors per pattern of present grads, so that the steady state
        # builds no tensors from host data.
        self._index_cache: dict[tuple[bool, ...], _Index] = {}

    def _index_for(self, present: tuple[bool, ...], device: torch.device) -> _Index:
        cached = self._index_cache.get(present)
        if cached is None or cached.whole.device != device:
            slots = [s for s, ok in zip(self._slots, present, strict=True) if ok]
            row_params = [(pos, row_slots) for pos, row_slots in self._row_params if present[pos]]
            row_index = [s for _, row_slots in row_params for s in row_slots]
            has_grad = [False] * (self._trunk_slot + 1)
            for s in [*slots, *row_index]:
                has_grad[s] = True
            cached = _Index(
                torch.tensor(slots, dtype=torch.long, device=device),
                tuple((pos, len(row_slots)) for pos, row_slots in row_params),
                torch.tensor(row_index, dtype=torch.long, device=device),
                torch.tensor(has_grad[: self._trunk_slot], dtype=torch.bool, device=device),
            )
            self._index_cache[present] = cached
        return cached

    def compute(self) -> GradientNorms:
        """Norms of the gradients currently in ``p.grad``; see ``GradientNorms``."""
        present = tuple(p.grad is not None for p in self.params)
        grads = [p.grad for p, ok in zip(self.params, present, strict=True) if ok]
        if not grads:
            device = self.params[0].device if self.params else torch.device("cpu")
            zero = torch.zeros((), device=device)
            nan = torch.full((len(self.head_names),), float("nan"), device=device)
            return GradientNorms(nan, torch.full((), float("nan"), device=device), zero, zero)
        index = self._index_for(present, grads[0].device)
        on_cpu = grads[0].device.type == "cpu"
        if self._use_fused and not on_cpu:
            squares, nan_count, inf_count = self._fused(grads)
            head_norms, global_norm = self._head_and_global(squares, index)
            return GradientNorms(head_norms, global_norm, nan_count, inf_count)
        norms = torch.stack(compat.foreach_norm(grads)).float()
        head_norms, global_norm = self._head_and_global(norms * norms, index)
        if on_cpu:
            # On the CPU a tensor is host memory, so testing it is no device sync. A finite
            # global norm means every element is finite: skip the counts, which cost about 70
            # norms' worth of time on the CPU (bool sums and isinf are not vectorised there).
            if bool(torch.isfinite(global_norm)):
                zero = torch.zeros((), device=global_norm.device)
                return GradientNorms(head_norms, global_norm, zero, zero)
            nan_count = torch.stack([torch.count_nonzero(g != g) for g in grads]).sum().float()
            inf_count = torch.stack([torch.count_nonzero(torch.isinf(g)) for g in grads]).sum().float()
            return GradientNorms(head_norms, global_norm, nan_count, inf_count)
        # A small model on an accelerator: exact counts every minibatch, without a host sync;
        # one concatenation keeps it to three kernels instead of two per tensor.
        flat = torch.cat([g.reshape(-1) for g in grads])
        nan_count = torch.isnan(flat).sum().float()
        inf_count = torch.isinf(flat).sum().float()
        return GradientNorms(head_norms, global_norm, nan_count, inf_count)

    def _head_and_global(self, squares: torch.Tensor, index: _Index) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-tensor squared norms -> (per-head norms, NaN for a head without gradients; global norm).

        A row-split parameter's whole square lands in the (discarded) trunk slot; the squares
        of its rows, from one row-wise norm (a view: no copy for a contiguous gradient), in
        their heads."""
        per_slot = torch.zeros(self._trunk_slot + 1, device=squares.device).index_add_(0, index.whole, squares)
        if index.row_params:
            row_norms = torch.cat(
                [
                    torch.linalg.vector_norm(self.params[pos].grad.reshape(n, -1), dim=1)  # type: ignore[union-attr]
                    for pos, n in index.row_params
                ]
            ).float()
            per_slot.index_add_(0, index.rows, row_norms * row_norms)
        head_norms = torch.where(index.has_grad, per_slot[: self._trunk_slot].sqrt(), float("nan"))
        return head_norms, squares.sum().sqrt()


def _assign_slots(
    groups: Mapping[str, Iterable[HeadPart]],
) -> tuple[dict[int, int], dict[int, tuple[int, list[tuple[slice, int]]]]]:
    """(id of a whole parameter -> head slot, id of a row-split one -> (row count, [(rows, head slot)])).

    Raises ``ValueError`` unless the heads are disjoint: a parameter in two heads, overlapping
    rows, or a parameter taken whole and by rows."""
    names = list(groups)
    slot_of: dict[int, int] = {}
    rows_of: dict[int, tuple[int, list[tuple[slice, int]]]] = {}
    shape_of: dict[int, tuple[int, ...]] = {}
    for slot, parts in enumerate(groups.values()):
        for part in parts:
            if isinstance(part, ParamRows):
                rows_of.setdefault(id(part.param), (part.param.shape[0], []))[1].append((part.rows, slot))
                shape_of[id(part.param)] = tuple(part.param.shape)
            else:
                if id(part) in slot_of:
                    raise ValueError("a parameter belongs to two heads; head groups must be disjoint")
                slot_of[id(part)] = slot
    for pid, (_, parts) in rows_of.items():
        if pid in slot_of:
            raise ValueError(
                f"a parameter of shape {shape_of[pid]} is taken whole by head {names[slot_of[pid]]!r} and by "
                f"rows by head {names[parts[0][1]]!r}; head groups must be disjoint"
            )
        ordered = sorted(parts, key=lambda part: part[0].start)
        for (a, slot_a), (b, slot_b) in itertools.pairwise(ordered):
            if b.start < a.stop:
                raise ValueError(
                    f"rows {a.start}:{a.stop} (head {names[slot_a]!r}) and {b.start}:{b.stop} (head "
                    f"{names[slot_b]!r}) of a parameter of shape {shape_of[pid]} overlap; head groups must be disjoint"
                )
    return slot_of, rows_of


def _row_slots(parts: tuple[int, list[tuple[slice, int]]], trunk: int) -> tuple[int, ...]:
    """The head slot of each row of a ``(row count, [(rows, slot)])`` parameter; ``trunk`` where no head takes it."""
    slots = [trunk] * parts[0]
    for rows, slot in parts[1]:
        slots[rows] = [slot] * (rows.stop - rows.start)
    return tuple(slots)
