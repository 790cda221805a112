"""What a head is (``HeadPart``), and its gradient norm by the reference formula (TELE-320).

Pure PyTorch: nothing here touches Ray or MLflow, and nothing here synchronises the
device with the host.  ``per_head_grad_norms`` is the reference formula;
``gradmon_ray.telemetry.norm_plan.GradientNormPlan`` computes the same numbers (and the global
norm and NaN/Inf counts) for every head at once with a handful of kernels, which is what the
learner runs every minibatch.

A head is a list of ``HeadPart``: a whole ``torch.nn.Parameter``, or ``ParamRows`` (some rows
of one, e.g. the rows of a policy output layer that produce one action component).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch


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
