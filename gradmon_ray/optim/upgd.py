"""UPGD: utility-based perturbed gradient descent (Elsayed & Mahmood, ICLR 2024).

Per weight, the utility ``u = -g * w`` (first-order estimate of the loss change if the weight
were removed) is tracked as an EMA; utilities are scaled by the *global* maximum over all
weights and squashed with a sigmoid.  Useful weights (scaled utility near 1) are protected
from change; unused ones receive the full gradient plus Gaussian noise, which keeps them
plastic.  With ``lr``, weight decay ``lambda``, utility decay ``beta_u`` and noise ``sigma``:

    u   <- beta_u * u + (1 - beta_u) * (-g * w)
    s   =  sigmoid((u / (1 - beta_u^t)) / max(u))
    w   <- (1 - lr * lambda) * w - 2 * lr * (g + sigma * xi) * (1 - s),   xi ~ N(0, 1)

This follows the paper's reference implementation, with two differences: the global max is
kept on the device (``torch.maximum``, no Python comparison of tensors, hence no host sync),
and a global max of exactly 0 (all utilities zero, e.g. the first step from zero weights)
gives ``s = sigmoid(0) = 0.5`` instead of 0/0 = NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

GENERATOR_STATE_KEY = "upgd_generator_state"
"""Key of the noise generator's state in ``UPGD.state_dict()``."""


class UPGD(torch.optim.Optimizer):
    """First-order global UPGD.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (the update uses ``2 * lr``, as the paper's code does).
        weight_decay: decoupled weight decay ``lambda``.
        beta_utility: EMA decay of the utility.
        sigma: standard deviation of the perturbation noise.
        generator: optional ``torch.Generator`` for the noise (reproducible runs, and
            identical noise on every replica when each gets the same seed).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-5,
        weight_decay: float = 0.001,
        beta_utility: float = 0.999,
        sigma: float = 0.001,
        generator: torch.Generator | None = None,
    ) -> None:
        if lr < 0 or weight_decay < 0 or sigma < 0 or not 0.0 <= beta_utility < 1.0:
            raise ValueError("UPGD needs lr >= 0, weight_decay >= 0, sigma >= 0 and 0 <= beta_utility < 1")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, beta_utility=beta_utility, sigma=sigma))
        self._generator = generator

    def state_dict(self) -> dict[str, Any]:
        """``Optimizer.state_dict()`` plus the noise generator's state.

        Without it a restored run would replay the noise from the seed and stop being the
        continuation of the checkpointed one (break/resume equivalence).
        """
        state = super().state_dict()
        if self._generator is not None:
            state[GENERATOR_STATE_KEY] = self._generator.get_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of ``state_dict``; a state without a generator entry keeps the current one."""
        state_dict = dict(state_dict)
        generator_state = state_dict.pop(GENERATOR_STATE_KEY, None)
        super().load_state_dict(state_dict)
        if generator_state is not None and self._generator is not None:
            # RLlib round-trips optimizer state through numpy (and the learner's device).
            self._generator.set_state(torch.as_tensor(generator_state, dtype=torch.uint8).cpu())

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update; parameters without ``.grad`` are left alone."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active: list[tuple[dict[str, Any], torch.Tensor]] = []
        global_max: torch.Tensor | None = None
        for group in self.param_groups:
            beta = group["beta_utility"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["avg_utility"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                state["avg_utility"].mul_(beta).add_(-p.grad * p, alpha=1 - beta)
                current = state["avg_utility"].max()
                global_max = current if global_max is None else torch.maximum(global_max, current)
                active.append((group, p))
        if global_max is None:
            return loss
        for group, p in active:
            state = self.state[p]
            correction = 1 - group["beta_utility"] ** state["step"]
            ratio = (state["avg_utility"] / correction) / global_max
            scaled = torch.sigmoid(torch.where(global_max != 0, ratio, torch.zeros_like(ratio)))
            noise = torch.randn(p.shape, device=p.device, dtype=p.dtype, generator=self._generator) * group["sigma"]
            # One add of the whole (small) update: ``lr`` may be a 0-d tensor (VGS in update
            # mode scales it on the device), and (1 - lr * wd) rounded near 1 would blur it.
            update = p * group["weight_decay"] + 2.0 * (p.grad + noise) * (1 - scaled)
            p.sub_(update * group["lr"])
        return loss
