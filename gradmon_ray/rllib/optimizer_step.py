"""One minibatch's optimizer step under gradmon's rules for non-finite gradients.

``MinibatchStep.take`` is what ``GradmonMonitor.apply_gradients`` runs after the telemetry has
measured the gradients.  Three modes, fixed for a learner's life:

* with a ``torch.amp.GradScaler`` (mixed precision): ``GradScaler.step`` skips on the
  ``found_inf`` its ``unscale_`` recorded; those skips are an overflow at the current scale and
  are counted apart (``scaler_lanes``), not as ``update/skipped``;
* ``torch_skip_nan_gradients=True`` (gradmon's default): a minibatch with any NaN/Inf gradient
  is skipped; fused optimizers read the flag on the device (``torch.amp.GradScaler``'s
  ``found_inf`` protocol), others cost one host sync per minibatch;
* RLlib's default ``False``: the gradients go through ``nan_to_num`` (in place, on the device)
  and the step is taken, exactly as stock RLlib does.
"""

from __future__ import annotations

import torch
from ray.rllib.utils.typing import ParamDict

from gradmon_ray.rllib import compat


class MinibatchStep:
    """Steps a learner's optimizers for one minibatch and reports whether the step was skipped."""

    def __init__(self, grad_scaler: torch.amp.GradScaler | None, device: torch.device | str | None) -> None:
        self.grad_scaler = grad_scaler
        self.scaler_lanes = torch.zeros(2, dtype=torch.float64, device=device)
        """[minibatches the scaler skipped this step (overflow at its scale), scale of the last
        minibatch]: reported once per telemetry step, then the count is zeroed."""

    def take(
        self, optimizers: list[torch.optim.Optimizer], gradients_dict: ParamDict, found: torch.Tensor, skip: bool
    ) -> torch.Tensor:
        """Step every optimizer; returns the skipped-step flag (0-d device tensor).

        ``found`` is the 0-d "some gradient element is NaN/Inf" flag; ``skip`` is the learner's
        ``torch_skip_nan_gradients``.
        """
        if self.grad_scaler is not None:
            self._take_with_scaler(optimizers, found)
            return torch.zeros_like(found)  # the scaler's skip, counted apart
        if skip:
            for optimizer in optimizers:
                if compat.supports_found_inf(optimizer):
                    compat.step_unless_found_inf(optimizer, found)
                elif not bool(found):  # the one tolerated host sync per minibatch
                    optimizer.step()
            return found
        for grad in gradients_dict.values():
            if grad is not None:
                grad.nan_to_num_()
        for optimizer in optimizers:
            optimizer.step()
        return torch.zeros_like(found)

    def _take_with_scaler(self, optimizers: list[torch.optim.Optimizer], found: torch.Tensor) -> None:
        """``GradScaler.step`` and ``update``; the NaN/Inf element counts still report what the
        unscaled gradients held."""
        scaler = self.grad_scaler
        assert scaler is not None
        for optimizer in optimizers:
            scaler.step(optimizer)  # fused Adam reads found_inf on the device
        self.scaler_lanes[0].add_(found)
        self.scaler_lanes[1].copy_(compat.scale_tensor(scaler).reshape(()))
        scaler.update()
