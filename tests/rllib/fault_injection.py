"""Fault injection for tests: NaN logits or a non-finite gradient element on one rank, one iteration.

Not shipped: a test wraps the learner class (``faulty(cls)``, or ``with_faults(config, faults)``
on an ``AlgorithmConfig``) and puts the faults in ``learner_config_dict["fault_injection"]``
(beside gradmon's own ``"gradmon"`` entry, which refuses unknown keys):

- ``{"nan_logits": {"rank", "head", "iteration"}}``: the logits of ``head`` are NaN on that
  rank in that (1-based) iteration (``GradmonPPOTorchLearner`` with ``FactoredActorCritic``,
  through its ``logits_for_loss`` hook);
- ``{"grad": [{"rank", "head", "iteration", "value"}]}``: ``value`` (``"nan"`` or ``"inf"``) is
  written into one element of the head's first part's gradient on that rank, before DDP's
  all-reduce (any gradmon learner, through its ``head_gradient_hooks`` hook); for rows of a
  parameter (``ParamRows``), the first element of the first row, so the fault stays inside that head.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradmon_ray.rllib.learner import GradmonPPOTorchLearner
from gradmon_ray.rllib.monitor import global_rank
from gradmon_ray.telemetry.head_norms import HeadPart, ParamRows

FAULTS_KEY = "fault_injection"
"""The ``learner_config_dict`` key the faults are read from."""


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


class FaultInjecting:
    """Mixin before a gradmon learner: the faults of ``learner_config_dict["fault_injection"]``."""

    @functools.cached_property
    def faults(self) -> FaultInjection:
        return FaultInjection.from_dict(self.config.learner_config_dict.get(FAULTS_KEY))  # type: ignore[attr-defined]

    def head_gradient_hooks(self, module_id: str, groups: Mapping[str, Sequence[HeadPart]]) -> list[Any]:
        hooks = super().head_gradient_hooks(module_id, groups)  # type: ignore[misc]
        return hooks + self.faults.install_grad_hooks(groups, global_rank(), lambda: self.gradmon_iteration + 1)  # type: ignore[attr-defined]

    def logits_for_loss(self, module_id: str, logits: torch.Tensor) -> torch.Tensor:
        logits = super().logits_for_loss(module_id, logits)  # type: ignore[misc]
        head = self.faults.nan_logits_head(self.collective.rank, self.gradmon_iteration + 1)  # type: ignore[attr-defined]
        if head is None:
            return logits
        layout = self.module[module_id].unwrapped().head_layout  # type: ignore[attr-defined]
        return with_nan_head(logits, layout.names, layout.sizes, head)


class FaultyPPOTorchLearner(FaultInjecting, GradmonPPOTorchLearner):
    """``GradmonPPOTorchLearner`` with the faults (importable by name on the learner actors)."""


def faulty(learner_class: type) -> type:
    """``learner_class`` (a gradmon learner) with the faults of ``learner_config_dict["fault_injection"]``."""
    if learner_class is GradmonPPOTorchLearner:
        return FaultyPPOTorchLearner
    return type(f"Faulty{learner_class.__name__}", (FaultInjecting, learner_class), {})


def with_faults(config: Any, faults: Mapping[str, Any]) -> Any:
    """``config`` (an ``AlgorithmConfig`` with a gradmon learner class) injecting ``faults``."""
    config.learners(learner_class=faulty(config.learner_class))
    config.learner_config_dict[FAULTS_KEY] = dict(faults)
    return config
