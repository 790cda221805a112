"""Each module's gradients averaged over the learners that trained it: what DDP does, sparse-safe.

DDP all-reduces a module's gradients from inside ``backward``, so every learner must run the
module's backward in every minibatch.  In multi-agent training a learner's shard of the batch
often holds no sample of some module (an agent that died early, a policy mapped to a rare
agent): that learner never joins the module's all-reduce and the others wait forever
(``docs/observe_only.md`` has stock RLlib's behaviour).  ``ModuleGradientAverage`` instead
all-reduces after ``backward``, for every module in one flat buffer:

- once per update (``exchange_presence``), the learners tell each other which parameters got a
  gradient (one small SUM of every learner's schema and 0/1 marks; the only host read it adds,
  once per update; after a module change, twice in that update);
- per minibatch (``average``), a learner packs each module's local gradients (zeros where it
  has none), divides each module's part by the number of learners that trained the module
  (DDP divides by the world size first too, so with every learner present the arithmetic is
  DDP's), ONE all-reduce (SUM), then every learner holds the same mean gradient;
- a parameter no learner gave a gradient keeps ``grad = None`` (no optimizer step, as on one
  learner; DDP does the same for globally unused parameters).

The presence exchange is the update's first collective: it checks that the learners average the
same modules, in the same order and shapes (``distributed.agreement``), before any collective
whose size depends on them.  A collective that this learner waits for anyway (the exchange; on
the host, gloo, every one) waits at most ``timeout_s``.  A learner that disagrees or never joins
stops the run with one line, on every learner, where DDP would hang (ray-project/ray#63819).

Everything here is plain ``torch.distributed`` on the group given (RLlib's world group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gradmon_ray import compat
from gradmon_ray.distributed.agreement import SLOTS, Schema, check_agreement, failed, timed_out, wait_for


@dataclass(frozen=True)
class Presence:
    """Which learners trained what in this update (host values, from ``exchange_presence``)."""

    param_counts: tuple[int, ...]
    """Per parameter (all modules, in order): the learners whose minibatch gave it a gradient."""
    module_counts: tuple[int, ...]
    """Per module: the learners that trained it (any of its parameters got a gradient)."""


class ModuleGradientAverage:
    """Average ``modules``' gradients (lists of parameters, the same order on every learner).

    ``names``: the modules' ids (errors name them); ``timeout_s``: how long a collective may wait
    for the other learners (None: torch's group timeout); ``follows``: the average this one
    replaces on this learner (after ``add_module``/``remove_module``), whose exchange size and
    update count it takes over, so that a learner the change did not reach still meets this
    one's first exchange with one of the same size (see ``exchange_presence``).
    """

    def __init__(
        self,
        modules: Sequence[Sequence[torch.nn.Parameter]],
        group: object | None = None,
        *,
        names: Sequence[str] | None = None,
        timeout_s: float | None = None,
        follows: ModuleGradientAverage | None = None,
    ) -> None:
        self.modules = [list(params) for params in modules]
        self.params = [p for params in self.modules for p in params]
        self._module_of = [i for i, params in enumerate(self.modules) for _ in params]
        self.group = group
        self.schema = Schema.of([str(i) for i in range(len(self.modules))] if names is None else names, self.modules)
        self.timeout_s = timeout_s
        self.presence: Presence | None = None
        """This update's presence (None until ``exchange_presence``; ``new_update`` resets it)."""
        self.updates = follows.updates if follows is not None else 0
        """Presence exchanges on this learner so far (errors name the update)."""
        self._mark_slots = follows._mark_slots if follows is not None else 0
        # ^ marks in the learners' last agreed exchange: every learner's header + marks has this
        # size until they agree on a new schema (gloo aborts the process on mismatched sizes).
        self._minibatch = 0
        self._payloads: dict[tuple[bool, ...], torch.Tensor] = {}

    def new_update(self) -> None:
        """Forget this update's presence: the next ``average`` exchanges it again."""
        self.presence = None

    def exchange_presence(self) -> Presence:
        """Which parameters got a gradient on how many learners: ONE small SUM of [every learner's
        schema | 0/1 marks] and one host read; the schemas are compared before the marks are used.
        The first exchange of a new schema carries no marks (its size is the last agreed one) and
        exchanges them right after, once agreed."""
        import torch.distributed as dist

        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.updates += 1
        self._minibatch = 0
        present = tuple(p.grad is not None for p in self.params)
        header = SLOTS * world if world > 1 else 0  # one learner: nobody to disagree with, the marks alone
        if not header or self._mark_slots == len(self.params):  # the schema the learners last agreed on
            summed = self._exchange(self._payload(present, world, rank))
            check_agreement(summed[:header], self.schema, rank, self.updates)
            counts = summed[header:]
        else:  # a new schema: compared first, at the last agreed size; then every learner sends its marks
            blank = torch.tensor(self.schema.header(world, rank) + [0.0] * self._mark_slots, dtype=torch.float64)
            check_agreement(self._exchange(blank.to(self._device()))[:header], self.schema, rank, self.updates)
            self._mark_slots = len(self.params)
            counts = self._exchange(self._payload(present, world, rank)[header:])
        per_module = [0] * len(self.modules)
        for count, module in zip(counts, self._module_of, strict=True):
            per_module[module] = max(per_module[module], round(count))
        self.presence = Presence(tuple(round(c) for c in counts), tuple(per_module))
        return self.presence

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _payload(self, present: tuple[bool, ...], world: int, rank: int) -> torch.Tensor:
        """[this learner's schema header | 0/1 marks] on the device, made from host data once per
        pattern of present gradients: a pageable host->device copy waits for the device on a GPU,
        and would be a second sync per update besides the read."""
        device = self._device()
        cached = self._payloads.get(present)
        if cached is None or cached.device != device:
            values = (self.schema.header(world, rank) if world > 1 else []) + [float(ok) for ok in present]
            cached = self._payloads[present] = torch.tensor(values, dtype=torch.float64, device=device)
        return cached

    def _exchanging(self) -> str:
        return f"the presence exchange of update {self.updates} for modules {list(self.schema.names)}"

    def _averaging(self) -> str:
        return (
            f"the gradient average of minibatch {self._minibatch} of update {self.updates}"
            f" for modules {list(self.schema.names)}"
        )

    def _exchange(self, values: torch.Tensor) -> list[float]:
        """A copy of ``values`` SUM-reduced across the learners within ``timeout_s``, read on the host."""
        summed = values.clone()
        self._all_reduce(summed, self._exchanging, wait=True)
        return summed.tolist()

    def _all_reduce(self, tensor: torch.Tensor, what: Callable[[], str], *, wait: bool) -> None:
        """SUM-all-reduce ``tensor`` in place; a failure, or no completion within ``timeout_s``
        where this learner waits for it anyway (``wait``, or a host tensor: gloo blocks), raises
        one line naming ``what``."""
        import torch.distributed as dist

        host = tensor.device.type == "cpu"
        try:
            if self.timeout_s is None or not (wait or host):  # a device tensor per minibatch: no host wait
                dist.all_reduce(tensor, group=self.group)  # (torch's group timeout, NCCL's watchdog guard it)
                return
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
            done = wait_for(work, self.timeout_s, host=host)
        except RuntimeError as exc:
            raise failed(what(), dist.get_rank(self.group), dist.get_world_size(self.group), exc) from exc
        if not done:
            raise timed_out(what(), dist.get_rank(self.group), dist.get_world_size(self.group), self.timeout_s or 0.0)

    def average(
        self, before_reduce: Callable[[int, list[torch.Tensor], list[torch.Tensor]], None] | None = None
    ) -> list[torch.nn.Parameter]:
        """All-reduce the current ``p.grad``s to their mean over the learners that trained each
        module.  ``before_reduce(module index, params, local grads)`` sees each module's local
        gradients first (the gradient noise scale needs them).  Returns the parameters that had
        no gradient here and have one now (their ``grad`` is a new tensor)."""

        presence = self.presence if self.presence is not None else self.exchange_presence()
        self._minibatch += 1
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
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = compat.flatten_dense(grads)
        if len(set(divisors)) == 1:
            flat.div_(divisors[0])
        else:  # modules trained by different numbers of learners: one division per run of equal divisors
            for start, stop, divisor in _runs(divisors, [p.numel() for p in params]):
                flat[start:stop].div_(divisor)
        self._all_reduce(flat, self._averaging, wait=False)
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
