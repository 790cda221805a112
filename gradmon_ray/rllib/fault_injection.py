"""Fault injection for tests: NaN logits or a non-finite gradient element on one rank, one iteration.

``learner_config_dict["gradmon"]["fault_injection"]``:

- ``{"nan_logits": {"rank", "head", "iteration"}}``: the logits of ``head`` are NaN on that
  rank in that (1-based) iteration (``GradmonPPOTorchLearner`` with ``FactoredActorCritic``);
- ``{"grad": [{"rank", "head", "iteration", "value"}]}``: ``value`` (``"nan"`` or ``"inf"``) is
  written into one element of the head's first part's gradient on that rank, before DDP's
  all-reduce (any gradmon learner); for rows of a parameter (``ParamRows``), the first element
  of the first row, so the fault stays inside that head.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradmon_ray.telemetry.head_norms import HeadPart, ParamRows


@dataclass(frozen=True)
class NanLogits:
    rank: int
    head: str
    iteration: int


@dataclass(frozen=True)
class GradFault:
    rank: int
    head: str
    iteration: int
    value: str


@dataclass(frozen=True)
class FaultInjection:
    """The configured faults (none by default)."""

    nan_logits: NanLogits | None = None
    grad: tuple[GradFault, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> FaultInjection:
        data = dict(data or {})
        nan = data.get("nan_logits")
        grads = tuple(GradFault(**dict(g)) for g in data.get("grad") or ())
        for fault in grads:
            if fault.value not in ("nan", "inf"):
                raise ValueError(f"fault_injection.grad.value must be 'nan' or 'inf', got {fault.value!r}")
        return cls(nan_logits=NanLogits(**dict(nan)) if nan else None, grad=grads)

    def nan_logits_head(self, rank: int, iteration: int) -> str | None:
        """The head whose logits are NaN on ``rank`` in ``iteration`` (1-based), else None."""
        fault = self.nan_logits
        if fault is not None and fault.rank == rank and fault.iteration == iteration:
            return fault.head
        return None

    def install_grad_hooks(
        self,
        groups: Mapping[str, Sequence[HeadPart]],
        rank: int,
        current_iteration: Callable[[], int],
    ) -> list[Any]:
        """One tensor hook per fault of ``rank``; returns the handles (``remove()`` them on shutdown).

        A tensor hook on a leaf runs before gradient accumulation, so before DDP's all-reduce:
        the poisoned element reaches every replica the way a real local overflow would.  A fault
        whose head is not in ``groups`` is left to the module that has that head.
        """
        handles = []
        for fault in self.grad:
            if fault.rank != rank or fault.head not in groups:  # several modules: each installs its own heads'
                continue
            part = groups[fault.head][0]
            param = part.param if isinstance(part, ParamRows) else part
            # Flat index of the first element of the head's first row (0 for a whole parameter).
            at = part.rows.start * (param.numel() // param.shape[0]) if isinstance(part, ParamRows) else 0

            def poison(grad: torch.Tensor, fault: GradFault = fault, at: int = at) -> torch.Tensor:
                if current_iteration() != fault.iteration:
                    return grad
                poisoned = grad.clone(memory_format=torch.contiguous_format)
                poisoned.view(-1)[at] = float(fault.value)
                return poisoned

            handles.append(param.register_hook(poison))
        return handles


def with_nan_head(
    logits: torch.Tensor, head_names: Sequence[str], head_sizes: Sequence[int], head: str
) -> torch.Tensor:
    """A copy of ``logits`` with ``head``'s slice set to NaN (heads concatenated in order)."""
    index = list(head_names).index(head)
    start = sum(head_sizes[:index])
    poisoned = logits.clone()
    poisoned[..., start : start + head_sizes[index]] = float("nan")
    return poisoned
