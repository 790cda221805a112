"""The Variance Gradient Scaler's checkpoints: the seed's state-dict format, old (spatial) ones included.

``VGSCheckpoint`` is the checkpoint half of ``gradmon_ray.vgs.scaler.VarianceGradientScaler``;
``analytic_normalized_variance_of_abs`` is the closed form the VGS tests check against.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

OLD_CHECKPOINT_WARNING = (
    "Loading old VGS checkpoint with spatial variance. "
    "Per-parameter stochastic variance statistics will be reset. "
    "This is expected and recommended. "
    "Consider retraining models for optimal performance."
)
"""The seed's migration warning, word for word."""


class VGSCheckpoint:
    """Mixin: ``state_dict``/``load_state_dict`` over ``VarianceGradientScaler``'s attributes."""

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The seed's state-dict format, plus ``aggregation_method``, ``granularity`` and
        the applied-update counters."""
        spatial = self._spatial_ema.detach().cpu().tolist()
        return {
            "enabled": self.enabled,
            "beta": self.beta,
            "alpha": self.alpha,
            "eps": self.eps,
            "warmup_steps": self.warmup_steps,
            "step_count": self._step_count,
            "aggregation_method": self.aggregation_method,
            "granularity": self.granularity,
            "param_grad_mean_ema": self._mean_ema.detach().cpu().clone(),
            "param_grad_sq_ema": self._sq_ema.detach().cpu().clone(),
            "param_numel": self._param_numel.detach().cpu().clone(),
            "stat_steps": float(self._stat_steps),
            "spatial_steps": float(self._spatial_steps),
            "grad_mean_ema": spatial[0],
            "grad_var_ema": spatial[1],
            "grad_norm_ema": spatial[2],
            "grad_max_ema": spatial[3],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict; an old (spatial) checkpoint warns and resets the statistics.

        Raises ``ValueError`` when the checkpoint's parameter shapes (numels) or granularity
        do not match this scaler's parameters.
        """
        self.enabled = bool(state_dict.get("enabled", self.enabled))
        self.beta = float(state_dict.get("beta", self.beta))
        self.alpha = float(state_dict.get("alpha", self.alpha))
        self.eps = float(state_dict.get("eps", self.eps))
        self.warmup_steps = int(state_dict.get("warmup_steps", self.warmup_steps))
        self._step_count = int(state_dict.get("step_count", 0))
        self._beta_tensor = torch.tensor(self.beta, device=self._device)
        if "param_grad_mean_ema" not in state_dict:
            warnings.warn(OLD_CHECKPOINT_WARNING, UserWarning, stacklevel=2)
            self._reset_statistics()
            legacy = [state_dict.get(k) for k in ("grad_mean_ema", "grad_var_ema", "grad_norm_ema", "grad_max_ema")]
            if all(v is not None for v in legacy):
                self._spatial_ema = torch.tensor([float(v) for v in legacy], device=self._device)
                self._spatial_steps = torch.tensor(1e9, device=self._device)  # already bias-free
            return
        granularity = state_dict.get("granularity", "tensor")
        if granularity != self.granularity:
            raise ValueError(f"VGS checkpoint has granularity {granularity!r}, this scaler uses {self.granularity!r}")
        numel = [int(n) for n in torch.as_tensor(state_dict["param_numel"]).tolist()]
        if numel != self._numel:
            raise ValueError(
                f"VGS checkpoint is for {len(numel)} parameter tensors with sizes {numel[:8]}"
                f"{'...' if len(numel) > 8 else ''}; this scaler has {len(self._numel)} with sizes "
                f"{self._numel[:8]}{'...' if len(self._numel) > 8 else ''}"
            )
        mean_ema = torch.as_tensor(state_dict["param_grad_mean_ema"], dtype=torch.float32)
        if mean_ema.numel() != self._mean_ema.numel():
            raise ValueError(
                f"VGS checkpoint statistics have {mean_ema.numel()} entries, expected {self._mean_ema.numel()}"
            )
        self.aggregation_method = state_dict.get("aggregation_method", self.aggregation_method)
        self._load_statistics(mean_ema, torch.as_tensor(state_dict["param_grad_sq_ema"], dtype=torch.float32))
        # Seed checkpoints count steps, not applied updates: the same thing when none were skipped.
        self._stat_steps = torch.tensor(float(state_dict.get("stat_steps", self._step_count)), device=self._device)
        spatial = [
            float(state_dict.get(k) or 0.0) for k in ("grad_mean_ema", "grad_var_ema", "grad_norm_ema", "grad_max_ema")
        ]
        self._spatial_ema = torch.tensor(spatial, device=self._device)
        self._spatial_steps = torch.tensor(float(state_dict.get("spatial_steps", 1e9)), device=self._device)


def analytic_normalized_variance_of_abs(mean: float, std: float) -> float:
    """The limit of VGS's ``nv`` for i.i.d. gradients ``g ~ N(mean, std^2)`` (eps -> 0).

    ``nv = (E[g^2] - E[|g|]^2) / E[|g|]^2``, the squared coefficient of variation of
    ``|g|``, with the folded-normal moments ``E[|g|] = std*sqrt(2/pi)*
    exp(-mean^2/(2 std^2)) + mean*(1 - 2*Phi(-mean/std))`` and ``E[g^2] = mean^2 + std^2``.
    """
    if std == 0:
        return 0.0
    phi = 0.5 * (1 + math.erf((-mean / std) / math.sqrt(2)))
    e_abs = std * math.sqrt(2 / math.pi) * math.exp(-(mean**2) / (2 * std**2)) + mean * (1 - 2 * phi)
    e_sq = mean**2 + std**2
    return e_sq / e_abs**2 - 1.0
