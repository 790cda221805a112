"""Each module's gradients averaged over the learners that trained it: what DDP does, sparse-safe.

DDP all-reduces a module's gradients from inside ``backward``, so every learner must run the
module's backward in every minibatch.  In multi-agent training a learner's shard of the batch
often holds no sample of some module (an agent that died early, a policy mapped to a rare
agent): that learner never joins the module's all-reduce and the others wait forever
(``docs/observe_only.md`` has stock RLlib's behaviour).  ``ModuleGradientAverage`` instead
all-reduces after ``backward``, for every module in one flat buffer:

- once per update (``exchange_presence``), the learners tell each other which parameters got a
  gradient (one small SUM of 0/1 marks; the only host read it adds, once per update);
- per minibatch (``average``), a learner packs each module's local gradients (zeros where it
  has none), divides each module's part by the number of learners that trained the module
  (DDP divides by the world size first too, so with every learner present the arithmetic is
  DDP's), ONE all-reduce (SUM), then every learner holds the same mean gradient;
- a parameter no learner gave a gradient keeps ``grad = None`` (no optimizer step, as on one
  learner; DDP does the same for globally unused parameters).

Everything here is plain ``torch.distributed`` on the group given (RLlib's world group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gradmon_ray import compat


@dataclass(frozen=True)
class Presence:
    """Which learners trained what in this update (host values, from ``exchange_presence``)."""

    param_counts: tuple[int, ...]
    """Per parameter (all modules, in order): the learners whose minibatch gave it a gradient."""
    module_counts: tuple[int, ...]
    """Per module: the learners that trained it (any of its parameters got a gradient)."""


class ModuleGradientAverage:
    """Average ``modules``' gradients (lists of parameters, the same order on every learner)."""

    def __init__(self, modules: Sequence[Sequence[torch.nn.Parameter]], group: object | None = None) -> None:
        self.modules = [list(params) for params in modules]
        self.params = [p for params in self.modules for p in params]
        self._module_of = [i for i, params in enumerate(self.modules) for _ in params]
        self.group = group
        self.presence: Presence | None = None
        """This update's presence (None until ``exchange_presence``; ``new_update`` resets it)."""
        self._marks: dict[tuple[bool, ...], torch.Tensor] = {}  # this learner's 0/1 marks per pattern, on the device

    def new_update(self) -> None:
        """Forget this update's presence: the next ``average`` exchanges it again."""
        self.presence = None

    def exchange_presence(self) -> Presence:
        """Which parameters got a gradient on how many learners (one small SUM, one host read;
        the marks are built from host data once per pattern of present gradients)."""
        import torch.distributed as dist

        device = self.params[0].device if self.params else torch.device("cpu")
        present = tuple(p.grad is not None for p in self.params)
        cached = self._marks.get(present)
        if cached is None or cached.device != device:
            # Made from host data once per pattern: a pageable host->device copy waits for the
            # device on a GPU, and would be a second sync per update besides the read below.
            cached = self._marks[present] = torch.tensor([float(ok) for ok in present], device=device)
        marks = cached.clone()
        dist.all_reduce(marks, group=self.group)
        counts = [round(v) for v in marks.tolist()]
        per_module = [0] * len(self.modules)
        for count, module in zip(counts, self._module_of, strict=True):
            per_module[module] = max(per_module[module], count)
        self.presence = Presence(tuple(counts), tuple(per_module))
        return self.presence

    def average(
        self, before_reduce: Callable[[int, list[torch.Tensor], list[torch.Tensor]], None] | None = None
    ) -> list[torch.nn.Parameter]:
        """All-reduce the current ``p.grad``s to their mean over the learners that trained each
        module.  ``before_reduce(module index, params, local grads)`` sees each module's local
        gradients first (the gradient noise scale needs them).  Returns the parameters that had
        no gradient here and have one now (their ``grad`` is a new tensor)."""

        presence = self.presence if self.presence is not None else self.exchange_presence()
        kept = [i for i, p in enumerate(self.params) if presence.param_counts[i] > 0]
        if not kept:
            return []
        if before_reduce is not None:
            for m, params in enumerate(self.modules):
                local = [p for p in params if p.grad is not None]
                if local and presence.module_counts[m]:
                    before_reduce(m, local, [p.grad for p in local])  # type: ignore[misc]
        filled = [self.params[i] for i in kept if self.params[i].grad is None]
        by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i in kept:
            by_kind.setdefault((self.params[i].device, self.params[i].dtype), []).append(i)
        for indices in by_kind.values():  # one all-reduce per device and dtype (usually one)
            self._reduce_mean(
                [self.params[i] for i in indices], [presence.module_counts[self._module_of[i]] for i in indices]
            )
        return filled

    def _reduce_mean(self, params: list[torch.nn.Parameter], divisors: list[int]) -> None:
        """``params``' gradients (zeros where missing) divided by their module's learner count,
        summed across learners in ONE all-reduce, written back (a missing one becomes a view)."""
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = compat.flatten_dense(grads)
        if len(set(divisors)) == 1:
            flat.div_(divisors[0])
        else:  # modules trained by different numbers of learners: one division per run of equal divisors
            for start, stop, divisor in _runs(divisors, [p.numel() for p in params]):
                flat[start:stop].div_(divisor)
        dist.all_reduce(flat, group=self.group)
        views = [v.view_as(p) for v, p in zip(_split(flat, params), params, strict=True)]
        existing = [(p.grad, v) for p, v in zip(params, views, strict=True) if p.grad is not None]
        if existing:
            compat.foreach_copy_([g for g, _ in existing], [v for _, v in existing])
        for p, v in zip(params, views, strict=True):
            if p.grad is None:
                p.grad = v


def _split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list(flat.split([t.numel() for t in like]))


def _runs(divisors: list[int], sizes: list[int]) -> list[tuple[int, int, int]]:
    """``(start, stop, divisor)`` element ranges of consecutive tensors sharing a divisor."""
    runs: list[tuple[int, int, int]] = []
    offset = 0
    for divisor, size in zip(divisors, sizes, strict=True):
        if runs and runs[-1][2] == divisor:
            runs[-1] = (runs[-1][0], offset + size, divisor)
        else:
            runs.append((offset, offset + size, divisor))
        offset += size
    return runs
