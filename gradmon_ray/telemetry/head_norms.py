"""Per-head gradient norms (TELE-320), global norm (TELE-310), NaN/Inf counts (TELE-300/301).

Pure PyTorch: nothing here touches Ray or MLflow, and nothing here synchronises the
device with the host.  ``per_head_grad_norms`` is the reference formula;
``GradientNormPlan`` computes the same numbers for every head at once with a handful of
kernels, which is what the learner runs every minibatch.

A head is a list of ``HeadPart``: a whole ``torch.nn.Parameter``, or ``ParamRows`` (some rows
of one, e.g. the rows of a policy output layer that produce one action component).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gradmon_ray import compat
from gradmon_ray.compile_on_demand import Kernel, wants_compile
from gradmon_ray.telemetry import bands as _bands
from gradmon_ray.telemetry import trends as _trends

# The band edges, ``classify_grad_norm`` and ``worst_head`` live in the torch-free ``bands``
# module, the trend arrow and the CV in the torch-free ``trends`` module; these names stay
# importable from here, where they always were.
DEAD_BELOW = _bands.DEAD_BELOW
WEAK_BELOW = _bands.WEAK_BELOW
HEALTHY_MAX = _bands.HEALTHY_MAX
ELEVATED_MAX = _bands.ELEVATED_MAX
HEALTH_BANDS = _bands.HEALTH_BANDS
classify_grad_norm = _bands.classify_grad_norm
worst_head = _bands.worst_head
TREND_DELTA = _trends.TREND_DELTA
trend_arrow = _trends.trend_arrow
coefficient_of_variation = _trends.coefficient_of_variation


@dataclass(frozen=True, eq=False)  # eq=False: identity equality and hash (a tensor field has neither)
class ParamRows:
    """Rows ``rows`` (along dim 0) of ``param``'s gradient: weight rows of a Linear layer, or
    entries of its bias.  ``rows`` is stored normalised to ``slice(start, stop)``.

    Raises ``ValueError`` for a 0-d parameter, a step other than 1, or rows that are empty or
    outside ``0 .. param.shape[0]``.
    """

    param: torch.nn.Parameter
    rows: slice

    def __post_init__(self) -> None:
        if self.param.dim() == 0:
            raise ValueError("ParamRows needs a parameter with at least one dimension, got a 0-d one")
        n = self.param.shape[0]
        rows = self.rows
        start = 0 if rows.start is None else rows.start
        stop = n if rows.stop is None else rows.stop
        if rows.step not in (None, 1) or not 0 <= start < stop <= n:
            raise ValueError(f"ParamRows rows must be a non-empty slice(start, stop) within 0..{n}, got {rows}")
        object.__setattr__(self, "rows", slice(int(start), int(stop)))

    def grad(self) -> torch.Tensor | None:
        """The rows of ``param.grad`` (a view, no copy), or None without a gradient."""
        g = self.param.grad
        return None if g is None else g[self.rows]


HeadPart = torch.nn.Parameter | ParamRows
"""One entry of a head: a whole parameter, or rows of one."""


def _part_grad(part: HeadPart) -> torch.Tensor | None:
    return part.grad() if isinstance(part, ParamRows) else part.grad


def per_head_grad_norms(groups: Mapping[str, Iterable[HeadPart]]) -> torch.Tensor:
    """L2 gradient norm of each head, in mapping order, on the parameters' device.

    Entry ``h`` is ``vector_norm(stack([vector_norm(g) for g in head's gradients]))``, i.e. the
    L2 norm over all gradient elements of the head, where a whole parameter contributes
    ``p.grad`` and a ``ParamRows`` its rows ``p.grad[rows]``; NaN when no part of the head has
    a gradient (so "no data" is never mistaken for a vanishing gradient).  No host
    synchronisation happens.
    """
    per_head: list[torch.Tensor] = []
    device: torch.device | None = None
    for parts in groups.values():
        grads = [g for g in map(_part_grad, parts) if g is not None]
        if grads:
            device = grads[0].device
            per_head.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        else:
            per_head.append(None)  # type: ignore[arg-type]
    if device is None:
        device = _first_device(groups)
    nan = torch.tensor(float("nan"), device=device)
    return (
        torch.stack([nan if t is None else t.to(device=device, dtype=torch.float32) for t in per_head])
        if per_head
        else torch.empty(0, device=device)
    )


def _first_device(groups: Mapping[str, Iterable[HeadPart]]) -> torch.device:
    for parts in groups.values():
        for part in parts:
            return (part.param if isinstance(part, ParamRows) else part).device
    return torch.device("cpu")


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
