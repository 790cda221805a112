"""Scale an optimizer's update by a factor that lives on the device: VGS's ``apply_to: update``.

The step taken is ``theta + f * delta``, where ``delta`` is the optimizer's own update (after
clipping, Adam's normalisation, weight decay), so under Adam a factor ``f`` changes the
parameters by exactly ``f`` times what they would have changed, which a factor on the
gradient cannot do (Adam divides it out).  Two routes, neither syncs with the host:

* learning-rate route: every optimizer here whose update is proportional to its ``lr`` and
  that accepts a tensor ``lr`` (fused Adam/AdamW/SGD, single-tensor Adam/AdamW, SGD,
  gradmon's UPGD) steps with ``lr * f`` and gets its float ``lr`` back afterwards, so LR
  schedules and checkpoints see what they set;
* snapshot route, for the rest (e.g. foreach Adam, which refuses a tensor ``lr``): the
  parameters are copied before the step and pulled back after it,
  ``theta <- theta_after + (1 - f) * (theta_before - theta_after)``: one copy and one pass
  more per step.

A skipped step (non-finite gradients, a ``GradScaler`` overflow) leaves ``delta = 0`` either way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from gradmon_ray import compat
from gradmon_ray.optim.upgd import UPGD


def takes_tensor_lr(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s update is ``lr`` times something and its step accepts a tensor ``lr``."""
    if isinstance(optimizer, (UPGD, torch.optim.SGD)):
        return True
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        for group in optimizer.param_groups:
            if group.get("fused") or group.get("capturable"):
                continue
            foreach = group.get("foreach")
            # torch resolves foreach=None to the foreach kernels for CUDA tensors only.
            if foreach or (foreach is None and any(p.is_cuda for p in group["params"])):
                return False
        return True
    return False


class UpdateScaler:
    """Scales the updates of ``optimizers`` by a 0-d device tensor (see the module docstring)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._by_lr = [opt for opt in optimizers if takes_tensor_lr(opt)]
        self._by_snapshot = [opt for opt in optimizers if not takes_tensor_lr(opt)]
        self._params = [p for opt in self._by_snapshot for g in opt.param_groups for p in g["params"]]
        self._snapshots: list[torch.Tensor] | None = None  # allocated once, on first use

    @property
    def routes(self) -> dict[str, int]:
        """How many optimizers go each route (``{"lr": n, "snapshot": m}``)."""
        return {"lr": len(self._by_lr), "snapshot": len(self._by_snapshot)}

    @contextmanager
    def scaled(self, factor: torch.Tensor) -> Iterator[None]:
        """Inside the block, every ``optimizer.step()`` of these optimizers moves by ``factor * delta``."""
        saved = [[group["lr"] for group in opt.param_groups] for opt in self._by_lr]
        if self._params:
            if self._snapshots is None:
                self._snapshots = [torch.empty_like(p) for p in self._params]
            compat.foreach_copy_(self._snapshots, [p.detach() for p in self._params])
        for opt in self._by_lr:
            for group in opt.param_groups:
                lr = group["lr"]
                if isinstance(lr, torch.Tensor):
                    group["lr"] = factor.to(device=lr.device, dtype=lr.dtype) * lr
                elif factor.device.type == "cpu":  # a python float is a double: lr * 1.0 == lr exactly
                    group["lr"] = factor.double() * lr
                else:  # CUDA's fused kernels read a tensor lr as float32 (not verified on a GPU here)
                    group["lr"] = factor.float() * lr
        try:
            yield
        finally:
            for opt, lrs in zip(self._by_lr, saved, strict=True):
                for group, lr in zip(opt.param_groups, lrs, strict=True):
                    group["lr"] = lr
        if self._params:
            params = [p.detach() for p in self._params]
            # theta_after + (1 - f) * (theta_before - theta_after); snapshots become scratch.
            compat.foreach_sub_(self._snapshots, params)
            compat.foreach_mul_(self._snapshots, 1.0 - factor)
            compat.foreach_add_(params, self._snapshots)
