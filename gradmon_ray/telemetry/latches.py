"""Per-head NaN/Inf OR-latches on the heads' log-probs (TELE-302/303), and entropy-collapse latches.

Detection runs on the device without synchronising: the learner hands each minibatch's
log-probs to the ``IterationAccumulator`` by reference, which checks the whole iteration's at
its drain (exact per kind: one NaN and one Inf test over all of them);
``logp_nonfinite_flags`` and ``logp_sums`` are the per-minibatch forms.  The latch itself
(``HeadLatches``) lives on the host and is fed once per training iteration.  Once a head's
latch is set it stays set for the whole run, including across checkpoint restores.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def logp_nonfinite_flags(per_head_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN and Inf flags per head for a ``[..., num_heads]`` log-prob tensor.

    Returns two float tensors of shape ``[num_heads]`` (1.0 where any entry of that head is
    NaN, resp. +-Inf).  Two reductions, no host synchronisation: the clean fast path costs
    the same as the dirty one, which is what lets it stay off the host.
    """
    flat = per_head_logp.reshape(-1, per_head_logp.shape[-1])
    nan = torch.isnan(flat).any(dim=0).to(torch.float32)
    inf = torch.isinf(flat).any(dim=0).to(torch.float32)
    return nan, inf


def logp_sums(per_head_logp: torch.Tensor) -> torch.Tensor:
    """Per head, the sum of a ``[..., num_heads]`` log-prob tensor: NaN when the head had a NaN
    log-prob, +-Inf when it had an infinite one (one kernel; the latch reads the sum).

    What one kernel cannot tell apart: a head whose log-probs in the same minibatch hold NaN
    and +-Inf, or both +Inf and -Inf, sums to NaN and sets only the NaN latch that minibatch.
    Log-probs are <= 0, so a finite sum cannot overflow unless they reach ~-1e34.
    """
    return per_head_logp.reshape(-1, per_head_logp.shape[-1]).sum(0)


@dataclass
class HeadLatches:
    """OR-latches for every head, pre-populated with False; never reset during a run."""

    head_names: tuple[str, ...]
    nan: dict[str, bool] = field(default_factory=dict)
    inf: dict[str, bool] = field(default_factory=dict)
    nan_first_iteration: dict[str, int] = field(default_factory=dict)
    inf_first_iteration: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.head_names = tuple(self.head_names)
        for head in self.head_names:
            self.nan.setdefault(head, False)
            self.inf.setdefault(head, False)

    def update(self, nan_flags: Sequence[float], inf_flags: Sequence[float], iteration: int) -> None:
        """OR the per-head flags (any value > 0 counts) of ``iteration`` into the latches."""
        if len(nan_flags) != len(self.head_names) or len(inf_flags) != len(self.head_names):
            raise ValueError(
                f"expected {len(self.head_names)} flags per kind, got {len(nan_flags)} and {len(inf_flags)}"
            )
        for head, is_nan, is_inf in zip(self.head_names, nan_flags, inf_flags, strict=True):
            if is_nan > 0 and not self.nan[head]:
                self.nan[head] = True
                self.nan_first_iteration[head] = iteration
            if is_inf > 0 and not self.inf[head]:
                self.inf[head] = True
                self.inf_first_iteration[head] = iteration

    def latched(self, kind: str) -> list[str]:
        """Heads whose ``kind`` ("nan" or "inf") latch is set, in head order."""
        flags = {"nan": self.nan, "inf": self.inf}[kind]
        return [h for h in self.head_names if flags[h]]

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state for checkpoints."""
        return {
            "head_names": list(self.head_names),
            "nan": dict(self.nan),
            "inf": dict(self.inf),
            "nan_first_iteration": dict(self.nan_first_iteration),
            "inf_first_iteration": dict(self.inf_first_iteration),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], head_names: Iterable[str]) -> HeadLatches:
        """Restore latches; a checkpoint for other heads is an error, not a silent reset."""
        names = tuple(head_names)
        if tuple(state["head_names"]) != names:
            raise ValueError(
                f"checkpointed latches are for heads {state['head_names']}, this learner has {list(names)}"
            )
        return cls(
            names,
            nan={k: bool(v) for k, v in state["nan"].items()},
            inf={k: bool(v) for k, v in state["inf"].items()},
            nan_first_iteration={k: int(v) for k, v in state["nan_first_iteration"].items()},
            inf_first_iteration={k: int(v) for k, v in state["inf_first_iteration"].items()},
        )


@dataclass
class CollapseLatches:
    """Per-head entropy-collapse latches: a head latches once its normalised entropy was below
    ``threshold`` for ``iterations`` consecutive telemetry steps; never reset during a run.

    A step without a value for a head (no minibatch, a one-action head, NaN) breaks no streak and
    extends none; a step at or above the threshold resets the streak (a latched head stays latched).
    """

    head_names: tuple[str, ...]
    threshold: float
    iterations: int
    streak: dict[str, int] = field(default_factory=dict)
    latched: dict[str, bool] = field(default_factory=dict)
    first_iteration: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.head_names = tuple(self.head_names)
        for head in self.head_names:
            self.streak.setdefault(head, 0)
            self.latched.setdefault(head, False)

    def update(self, entropy_norm: Mapping[str, float], iteration: int) -> None:
        """Feed one step's ``{head: entropy_norm}`` (heads absent or NaN: no measurement)."""
        for head in self.head_names:
            value = entropy_norm.get(head, math.nan)
            if math.isnan(value):
                continue
            self.streak[head] = self.streak[head] + 1 if value < self.threshold else 0
            if self.streak[head] >= self.iterations and not self.latched[head]:
                self.latched[head] = True
                self.first_iteration[head] = iteration

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state for checkpoints (the rule itself comes from the config)."""
        return {
            "head_names": list(self.head_names),
            "streak": dict(self.streak),
            "latched": dict(self.latched),
            "first_iteration": dict(self.first_iteration),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``; a checkpoint for other heads is an error, not a silent reset."""
        if tuple(state["head_names"]) != self.head_names:
            raise ValueError(
                f"checkpointed collapse latches are for heads {state['head_names']}, "
                f"this learner has {list(self.head_names)}"
            )
        self.streak = {h: int(state["streak"][h]) for h in self.head_names}
        self.latched = {h: bool(state["latched"][h]) for h in self.head_names}
        self.first_iteration = {k: int(v) for k, v in state["first_iteration"].items()}
