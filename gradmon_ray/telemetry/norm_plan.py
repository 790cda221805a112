"""The per-minibatch norm pass: every head's norm, the global norm, NaN/Inf counts (TELE-300/301/310/320).

``GradientNormPlan`` precomputes which gradient goes to which head of which module once, then
computes, per minibatch and for ALL the modules it covers at once, the same numbers as
``head_norms.per_head_grad_norms`` per head, plus each module's global norm and exact NaN/Inf
element counts: a fixed handful of kernels whatever the number of modules, and no host read on
any device (Megatron's ``clip_grads.py`` pattern: one norm pass over every gradient).  The
CPU runs the same code as an accelerator, so counting the ops a CPU update dispatches
(``tests/rllib/test_host_reads.py``) tells what a GPU update launches and waits for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gradmon_ray import compat
from gradmon_ray.compile_on_demand import Kernel, wants_compile
from gradmon_ray.telemetry.head_assignment import HeadSlots
from gradmon_ray.telemetry.head_norms import HeadPart


@dataclass(frozen=True)
class GradientNorms:
    """One minibatch's gradient telemetry of one module (or, batched, of every module), on the device."""

    head_norms: torch.Tensor
    """[heads] L2 norm per head; NaN for a head with no gradient (batched: every module's heads, in order)."""
    global_norm: torch.Tensor
    """0-d L2 norm over every gradient of the module (heads and shared trunk); batched: [modules].
    NaN for a module without any gradient (not trained in this minibatch)."""
    nan_count: torch.Tensor
    """0-d number of NaN gradient elements (batched: [modules])."""
    inf_count: torch.Tensor
    """0-d number of +-Inf gradient elements (batched: [modules])."""

    @property
    def found_nonfinite(self) -> torch.Tensor:
        """1.0 where any gradient element is NaN/Inf (the skip flag), float32, same shape as the counts."""
        return ((self.nan_count + self.inf_count) > 0).to(torch.float32)


def squares_and_counts(grads: list[torch.Tensor]) -> torch.Tensor:
    """``[3, tensors]``: per tensor ``sum(g^2)``, its NaN and its +-Inf element counts (float32).

    Compiled (large models on an accelerator), each tensor is read ONCE for all three
    reductions and nothing gradient-sized is allocated; eagerly it is three passes per tensor.
    """
    rows = []
    for grad in grads:
        x = grad.float()
        rows.append(torch.stack([(x * x).sum(), (x != x).sum().float(), torch.isinf(x).sum().float()]))
    return torch.stack(rows, dim=1)


class CountBuffers(NamedTuple):
    """Persistent buffers of ``squares_and_nonfinite_counts`` for one pattern of present gradients:
    3 floats per gradient element, allocated once (a fresh allocation every minibatch costs a CPU
    as much as a pass over it)."""

    flat: torch.Tensor  # [elements] float32: the gradients, concatenated
    targets: list[torch.Tensor]  # views of ``flat`` shaped like each gradient (the copy's targets)
    marks: torch.Tensor  # [2 * elements]: the non-finite marks, then the NaN marks
    blocks: list[torch.Tensor]  # views of ``marks``: each block's non-finite marks, then its NaN marks

    @classmethod
    def like(cls, grads: list[torch.Tensor], sizes: list[int]) -> CountBuffers:
        """Buffers for ``grads`` (float32 whatever their dtype) counted in consecutive blocks of ``sizes`` elements."""
        n = sum(g.numel() for g in grads)
        flat = torch.empty(n, dtype=torch.float32, device=grads[0].device)
        targets = [view.view(g.shape) for view, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]
        marks = flat.new_empty(2 * n)
        return cls(flat, targets, marks, list(marks.split(sizes + sizes)))


def squares_and_nonfinite_counts(grads: list[torch.Tensor], buffers: CountBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per tensor sum(g^2) [tensors], [2, blocks])``: the second holds the non-finite (NaN or
    +-Inf) and the NaN element counts of each block of ``buffers`` (consecutive gradients), exact
    below 2^22 elements of a kind per block.

    Float arithmetic instead of ``isnan``/``isinf``: on a CPU, comparisons and bool sums are not
    vectorised (5-10x slower), and ``x * 0`` is NaN exactly at a NaN or an Inf, ``clamp(x, -1, 1)
    * 0`` exactly at a NaN.  A block's count is the squared 2-norm of its 0/1 marks, so ONE
    multi-tensor norm (``_foreach_norm``, as ``clip_grad_norm_`` runs) gives every tensor's norm
    and every block's counts, however many there are.
    """
    flat, marks, n = buffers.flat, buffers.marks, buffers.flat.numel()
    compat.foreach_copy_(buffers.targets, grads)
    torch.mul(flat, 0.0, out=marks[:n])
    torch.clamp(flat, -1.0, 1.0, out=marks[n:]).mul_(0.0)
    marks.nan_to_num_(nan=1.0)
    norms = torch.stack(compat.foreach_norm([*grads, *buffers.blocks])).float()
    squares = norms * norms
    return squares[: len(grads)], squares[len(grads) :].round().reshape(2, len(buffers.blocks) // 2)


class _Index(NamedTuple):
    """The plan's tensors for one pattern of present gradients (see ``GradientNormPlan._index_for``)."""

    whole: torch.Tensor  # slot of each present gradient (a row-split parameter's: its module's trunk slot)
    module_of: torch.Tensor  # module of each present gradient
    module_sizes: list[int]  # present gradient elements per module (the count blocks)
    row_params: tuple[tuple[int, int], ...]  # (position in params, row count) of row-split params with a gradient
    rows: torch.Tensor  # slot of each of their rows, concatenated (rows no head takes: the trunk slot)
    has_grad: torch.Tensor  # per head of every module: does any part of it have a gradient
    module_has_grad: torch.Tensor | None  # per module: any gradient at all (None: every module has one)
    buffers: list[CountBuffers]  # the eager counts' buffers, made at the first eager compute (empty until then)


class GradientNormPlan:
    """Precomputed parameter-to-head assignment for fast per-minibatch norms of one or more modules.

    ``GradientNormPlan(groups, all_params)`` covers one module: ``groups`` maps each reported
    head to its parts (``HeadPart``: whole parameters, or ``ParamRows``); ``all_params`` is every
    trainable parameter (heads plus the shared trunk), which the global norm and the NaN/Inf
    counts cover, always over whole tensors.  ``GradientNormPlan.for_modules`` covers several
    (a learner's monitored modules): one ``compute_all`` per minibatch for all of them.  Two
    heads may take disjoint rows of one parameter; overlapping rows, or a parameter taken whole
    by one head and by rows by another, raise ``ValueError``.

    Kernels per minibatch, whatever the number of modules and tensors
    (``squares_and_nonfinite_counts``): one concatenation, four elementwise passes, ONE
    multi-tensor norm for the tensors' norms and the modules' counts, two ``index_add_`` and the
    final arithmetic; plus one row-wise norm per parameter split by rows between heads.
    With ``fused_counts`` (``"auto"``: from ``AUTO_COMPILE_MIN_PARAMETERS`` gradient elements,
    on an accelerator) ``squares_and_counts`` compiled reads every gradient once for the norms
    and the counts together, with no copy.
    """

    def __init__(
        self,
        groups: Mapping[str, Iterable[HeadPart]],
        all_params: Iterable[torch.nn.Parameter],
        *,
        fused_counts: str = "auto",
    ) -> None:
        self._setup([(groups, all_params)], fused_counts)

    @classmethod
    def for_modules(
        cls,
        modules: Sequence[tuple[Mapping[str, Iterable[HeadPart]], Iterable[torch.nn.Parameter]]],
        *,
        fused_counts: str = "auto",
    ) -> GradientNormPlan:
        """One plan over several modules' ``(groups, all_params)``, in order; parameters must not repeat."""
        plan = cls.__new__(cls)
        plan._setup(modules, fused_counts)
        return plan

    def _setup(
        self,
        modules: Sequence[tuple[Mapping[str, Iterable[HeadPart]], Iterable[torch.nn.Parameter]]],
        fused_counts: str,
    ) -> None:
        self.slots = HeadSlots([(dict(groups), tuple(params)) for groups, params in modules])
        self.params = self.slots.params
        """Every module's trainable parameters, module after module."""
        self.head_names: tuple[str, ...] = self.slots.head_names[0] if len(self.slots.head_names) == 1 else ()
        """The one module's heads (empty for a plan over several modules: ``slots.head_names``)."""
        numel = sum(p.numel() for p in self.params)
        self._fused = Kernel(squares_and_counts, compile=True, label="gradient norms")
        self._use_fused = wants_compile(fused_counts, numel)
        # Cache of the index tensors per pattern of present grads, so that the steady state
        # builds no tensors from host data.
        self._index_cache: dict[tuple[bool, ...], _Index] = {}

    def _index_for(self, present: tuple[bool, ...], device: torch.device) -> _Index:
        cached = self._index_cache.get(present)
        if cached is None or cached.whole.device != device:
            slots = self.slots
            kept = [i for i, ok in enumerate(present) if ok]
            row_params = [(pos, row_slots) for pos, row_slots in slots.row_params if present[pos]]
            row_index = [s for _, row_slots in row_params for s in row_slots]
            has_grad = [False] * slots.trunk_base
            for s in [*(slots.whole[i] for i in kept), *row_index]:
                if s < slots.trunk_base:
                    has_grad[s] = True
            module_sizes = [0] * slots.num_modules
            for i in kept:
                module_sizes[slots.module_of[i]] += self.params[i].numel()

            def longs(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.long, device=device)

            cached = _Index(
                longs([slots.whole[i] for i in kept]),
                longs([slots.module_of[i] for i in kept]),
                module_sizes,
                tuple((pos, len(row_slots)) for pos, row_slots in row_params),
                longs(row_index),
                torch.tensor(has_grad, dtype=torch.bool, device=device),
                None if all(module_sizes) else torch.tensor([n > 0 for n in module_sizes], device=device),
                [],
            )
            self._index_cache[present] = cached
        return cached

    def compute(self) -> GradientNorms:
        """The one module's norms of the gradients currently in ``p.grad`` (0-d global norm and counts)."""
        if self.slots.num_modules != 1:
            raise ValueError(f"this plan covers {self.slots.num_modules} modules: use compute_all()")
        batched = self.compute_all()
        return GradientNorms(
            batched.head_norms,
            batched.global_norm.reshape(()),
            batched.nan_count.reshape(()),
            batched.inf_count.reshape(()),
        )

    def compute_all(self) -> GradientNorms:
        """Every module's norms at once, batched (see ``GradientNorms``); no host read."""
        present = tuple(p.grad is not None for p in self.params)
        grads = [p.grad for p, ok in zip(self.params, present, strict=True) if ok]
        slots = self.slots
        if not grads:
            device = self.params[0].device if self.params else torch.device("cpu")
            zeros = torch.zeros(slots.num_modules, device=device)
            nan = torch.full((slots.trunk_base,), float("nan"), device=device)
            return GradientNorms(nan, torch.full_like(zeros, float("nan")), zeros, zeros.clone())
        index = self._index_for(present, grads[0].device)
        if self._use_fused and grads[0].device.type != "cpu":
            per_tensor = self._fused(grads)
            squares = per_tensor[0]
            counts = torch.zeros(2, slots.num_modules, device=squares.device).index_add_(
                1, index.module_of, per_tensor[1:]
            )
            nan_count, inf_count = counts[0], counts[1]
        else:
            if not index.buffers:
                index.buffers.append(CountBuffers.like(grads, index.module_sizes))
            squares, (nonfinite, nan_count) = squares_and_nonfinite_counts(grads, index.buffers[0])
            inf_count = nonfinite - nan_count
        head_norms, global_norm = self._head_and_global(squares, index)
        return GradientNorms(head_norms, global_norm, nan_count, inf_count)

    def _head_and_global(self, squares: torch.Tensor, index: _Index) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-tensor squared norms -> (per-head norms, NaN for a head without gradients; per-module global norms).

        A row-split parameter's whole square lands in its module's trunk slot; the squares of its
        rows, from one row-wise norm (a view: no copy for a contiguous gradient), in their heads."""
        slots = self.slots
        per_slot = torch.zeros(slots.num_slots, device=squares.device).index_add_(0, index.whole, squares)
        if index.row_params:
            row_norms = torch.cat(
                [
                    torch.linalg.vector_norm(self.params[pos].grad.reshape(n, -1), dim=1)  # type: ignore[union-attr]
                    for pos, n in index.row_params
                ]
            ).float()
            per_slot.index_add_(0, index.rows, row_norms * row_norms)
        global_sq = torch.zeros(slots.num_modules, device=squares.device).index_add_(0, index.module_of, squares)
        heads = per_slot[: slots.trunk_base]
        head_norms = torch.where(index.has_grad, heads.sqrt(), float("nan"))
        global_norm = global_sq.sqrt()
        if index.module_has_grad is not None:  # a module this minibatch did not train: missing, not 0
            global_norm = torch.where(index.module_has_grad, global_norm, float("nan"))
        return head_norms, global_norm
