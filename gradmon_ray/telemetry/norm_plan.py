"""The per-minibatch norm pass: every head's norm, the global norm, NaN/Inf counts (TELE-300/301/310/320).

``GradientNormPlan`` precomputes, once per pattern of present gradients, which contiguous piece
of which gradient goes to which head of which module, then measures ALL the modules it covers
per minibatch with seven dispatched ops whatever the number of modules, tensors and heads, and
no host read on any device (Megatron's ``clip_grads.py`` pattern: one norm pass over every
gradient):

1. one multi-tensor copy of every gradient into the second half of a persistent flat float32
   buffer (``x``);
2. ``x * 0`` into its first half: NaN exactly where ``x`` is NaN or +-Inf;
3. ``ne(buffer, buffer)`` into a marks buffer: 1.0 where non-finite (first half), where NaN
   (second half), else 0.0;
4. ONE multi-tensor 2-norm (``_foreach_norm``, what ``clip_grad_norm_`` runs) of the gradient
   pieces and of each module's two blocks of marks.  Each whole gradient, and each run of rows of
   a row-split parameter (a policy output layer) that one head takes, is a contiguous range of
   ``x``, so every view is made once per pattern; a block's squared norm is its count;
5-7. one ``stack``, one multiply (the squares) and one ``index_add`` into a per-pattern base
   vector that is NaN where a head (or a module) has no gradient.

The result stays packed (``PackedNorms``): square roots, rounded counts and Inf counts
(non-finite minus NaN) are taken once per step, at the drain, over every minibatch at once
(``norm_records``; only the gradient-noise-scale path, 2+ learners, takes a module's roots every
minibatch); the skip flags (``found_inf`` of fused optimizers: one more op) only where something
reads them.  Counts are exact up to 2.8 million non-finite elements of a kind per module and
minibatch (a float32 square root squared and rounded), within two parts in 10^7 beyond.

Why eager and not ``torch.compile``: a GPU minibatch of a small policy is launch-bound (~27 us
an op on an H200), and Inductor emits one reduction kernel per gradient tensor, where each
multi-tensor op above launches one kernel per ~100 tensors.  The CPU runs the same code as an
accelerator, so counting the ops a CPU update dispatches (``tests/telemetry/test_head_norms.py``,
``tests/rllib/test_op_budget.py``) tells what a GPU update launches and waits for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from gradmon_ray import compat
from gradmon_ray.telemetry.head_assignment import HeadSlots, flat_pieces
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


@dataclass(frozen=True)
class PackedNorms:
    """``GradientNormPlan.compute_all``'s result for one minibatch of every module, as computed:
    no kernel has run beyond the plan's seven.  The ``GradientNorms`` fields are derived on access
    (a few kernels each: a learner's drain derives them once for the whole step, ``NormRecords``)."""

    packed: torch.Tensor
    """float32 ``[heads + 3 * modules]`` (``[minibatches, ...]`` stacked): per head the sum of
    squares of its gradient elements (NaN: no gradient), then per module the sum of squares of all
    its gradients (NaN: none), its number of non-finite (NaN or +-Inf) elements and its number of
    NaN elements, both unrounded (round them)."""
    mark_norms: tuple[torch.Tensor, ...]
    """Per module, the 0-d 2-norm of its non-finite marks (``sqrt`` of its count): 0 where none
    (empty for stacked records: their flags are not read)."""
    num_heads: int

    @property
    def num_modules(self) -> int:
        return (self.packed.shape[-1] - self.num_heads) // 3

    @cached_property
    def flags(self) -> tuple[torch.Tensor, ...]:
        """Per module, a 0-d float32: exactly 1.0 where any of its gradient elements is NaN/Inf,
        else 0.0 (the skip flag: fused optimizers take it as ``found_inf``).  One op, on first access."""
        return tuple(compat.foreach_clamp_max(list(self.mark_norms), 1.0))

    def _module_part(self, k: int) -> torch.Tensor:
        """The ``k``-th per-module lane block (0: global squares, 1: non-finite counts, 2: NaN
        counts), along the last dimension (``NormRecords`` stacks minibatches before it)."""
        start = self.num_heads + k * self.num_modules
        return self.packed[..., start : start + self.num_modules]

    @property
    def head_norms(self) -> torch.Tensor:
        return self.packed[..., : self.num_heads].sqrt()

    @property
    def global_norm(self) -> torch.Tensor:
        return self._module_part(0).sqrt()

    @property
    def nonfinite_count(self) -> torch.Tensor:
        return self._module_part(1).round()

    @property
    def nan_count(self) -> torch.Tensor:
        return self._module_part(2).round()

    @property
    def inf_count(self) -> torch.Tensor:
        return self.nonfinite_count - self.nan_count

    @property
    def found_nonfinite(self) -> torch.Tensor:
        return torch.stack(self.flags)


class _Pattern(NamedTuple):
    """The plan's buffers and index for one pattern of present gradients (``GradientNormPlan._pattern``)."""

    buffer: torch.Tensor  # [2 * elements] float32: x * 0 | the gradient values x, persistent
    halves: tuple[torch.Tensor, torch.Tensor]  # its two halves (views made once)
    targets: list[torch.Tensor]  # views of the second half shaped like each present gradient (the copy's targets)
    marks: torch.Tensor  # [2 * elements] float32: non-finite marks | NaN marks
    normed: list[torch.Tensor]  # 1-D views: the gradient pieces, then each module's non-finite, then NaN marks
    head_pieces: tuple[int, ...]  # which pieces belong to a head (the trunk's only to the global norms)
    index: torch.Tensor  # destination in the packed vector of each stacked value
    base: torch.Tensor  # the packed vector before the sums: NaN where a head/module has no gradient, else 0


class GradientNormPlan:
    """Precomputed parameter-to-head assignment for fast per-minibatch norms of one or more modules.

    ``GradientNormPlan(groups, all_params)`` covers one module: ``groups`` maps each reported
    head to its parts (``HeadPart``: whole parameters, or ``ParamRows``); ``all_params`` is every
    trainable parameter (heads plus the shared trunk), which the global norm and the NaN/Inf
    counts cover, always over whole tensors.  ``GradientNormPlan.for_modules`` covers several
    (a learner's monitored modules): one ``compute_all`` per minibatch for all of them.  Two
    heads may take disjoint rows of one parameter; overlapping rows, or a parameter taken whole
    by one head and by rows by another, raise ``ValueError``.  Per minibatch: seven dispatched
    ops (the module docstring), whatever the number of modules, tensors and heads.
    """

    def __init__(self, groups: Mapping[str, Iterable[HeadPart]], all_params: Iterable[torch.nn.Parameter]) -> None:
        self._setup([(groups, all_params)])

    @classmethod
    def for_modules(
        cls, modules: Sequence[tuple[Mapping[str, Iterable[HeadPart]], Iterable[torch.nn.Parameter]]]
    ) -> GradientNormPlan:
        """One plan over several modules' ``(groups, all_params)``, in order; parameters must not repeat."""
        plan = cls.__new__(cls)
        plan._setup(modules)
        return plan

    def _setup(self, modules: Sequence[tuple[Mapping[str, Iterable[HeadPart]], Iterable[torch.nn.Parameter]]]) -> None:
        self.slots = HeadSlots([(dict(groups), tuple(params)) for groups, params in modules])
        self.params = self.slots.params
        """Every module's trainable parameters, module after module."""
        self.head_names: tuple[str, ...] = self.slots.head_names[0] if len(self.slots.head_names) == 1 else ()
        """The one module's heads (empty for a plan over several modules: ``slots.head_names``)."""
        # Per pattern of present grads, so that the steady state builds no tensor from host data.
        self._patterns: dict[tuple[bool, ...], _Pattern] = {}

    def _pattern(self, present: tuple[bool, ...], grads: list[torch.Tensor]) -> _Pattern:
        cached = self._patterns.get(present)
        device = grads[0].device
        if cached is not None and cached.buffer.device == device:
            return cached
        slots = self.slots
        kept = [i for i, ok in enumerate(present) if ok]
        n = sum(g.numel() for g in grads)
        buffer = torch.empty(2 * n, dtype=torch.float32, device=device)
        targets = [v.view(g.shape) for v, g in zip(buffer[n:].split([g.numel() for g in grads]), grads, strict=True)]
        pieces, piece_slot, piece_module = flat_pieces(slots, kept, targets)
        module_sizes = [0] * slots.num_modules
        for i, target in zip(kept, targets, strict=True):
            module_sizes[slots.module_of[i]] += target.numel()
        h, m = slots.trunk_base, slots.num_modules
        marks = torch.empty_like(buffer)
        head_pieces = tuple(k for k, slot in enumerate(piece_slot) if slot < h)
        destinations = [
            *(piece_slot[k] for k in head_pieces),
            *(h + module for module in piece_module),
            *range(h + m, h + 3 * m),  # the marks' blocks: non-finite per module, then NaN per module
        ]
        base = torch.full((h + 3 * m,), float("nan"), device=device)
        base[[piece_slot[k] for k in head_pieces]] = 0.0
        base[[h + module for module in piece_module]] = 0.0
        base[h + m :] = 0.0
        cached = _Pattern(
            buffer,
            (buffer[:n], buffer[n:]),
            targets,
            marks,
            [*pieces, *marks.split(module_sizes + module_sizes)],
            head_pieces,
            torch.tensor(destinations, dtype=torch.long, device=device),
            base,
        )
        self._patterns[present] = cached
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

    def compute_all(self) -> PackedNorms:
        """Every module's norms at once, packed (see ``PackedNorms``); seven ops, no host read."""
        present = tuple(p.grad is not None for p in self.params)
        grads = [p.grad for p, ok in zip(self.params, present, strict=True) if ok]
        slots = self.slots
        h, m = slots.trunk_base, slots.num_modules
        if not grads:
            device = self.params[0].device if self.params else torch.device("cpu")
            packed = torch.cat([torch.full((h + m,), float("nan"), device=device), torch.zeros(2 * m, device=device)])
            return PackedNorms(packed, tuple(torch.zeros((), device=device) for _ in range(m)), h)
        pattern = self._pattern(present, grads)
        compat.foreach_copy_(pattern.targets, grads)
        torch.mul(pattern.halves[1], 0.0, out=pattern.halves[0])
        torch.ne(pattern.buffer, pattern.buffer, out=pattern.marks)
        norms = compat.foreach_norm(pattern.normed)
        pieces = len(norms) - 2 * m
        values = torch.stack([*(norms[k] for k in pattern.head_pieces), *norms])
        packed = torch.index_add(pattern.base, 0, pattern.index, values * values)
        return PackedNorms(packed, tuple(norms[pieces : pieces + m]), h)
