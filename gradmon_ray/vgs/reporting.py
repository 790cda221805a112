"""The Variance Gradient Scaler's reporting half: its metrics, read on demand (these synchronise).

``VGSReporting`` is a mixin of ``gradmon_ray.vgs.scaler.VarianceGradientScaler``; it reads the
scaler's state and never changes it.
"""

from __future__ import annotations

import torch

from gradmon_ray import metric_names as mn
from gradmon_ray.vgs import kernels

# Order of ``metrics_tensor()``; ``vgs/step_count`` and ``vgs/warmup_active`` are host values.
DEVICE_METRICS = mn.VGS_DEVICE_METRICS
HOST_METRICS = mn.VGS_HOST_METRICS


class VGSReporting:
    """Mixin: the ``vgs/*`` metrics and the seed's reporting getters."""

    def get_normalized_variance(self) -> float:
        """The aggregated normalized temporal variance."""
        return float(self.normalized_variance_tensor())

    def get_scaling_factor(self) -> float:
        """The factor ``scale_gradients`` applies now."""
        return float(self.scaling_factor_tensor())

    @torch.no_grad()
    def compute_gradient_statistics(self) -> dict[str, float]:
        """SPATIAL statistics of the current gradients (across elements, not over time).

        Kept from the seed for logging: ``grad_mean``, ``grad_var`` (population variance of
        all gradient elements), ``grad_norm``, ``grad_max`` (max |g|), ``num_params``.  High
        spatial variance is normal for a network with layers of different scales; it says
        nothing about gradient noise.
        """
        grads = [p.grad.reshape(-1).float() for p in self._parameters if p.grad is not None]
        if not grads:
            return {"grad_mean": 0.0, "grad_var": 0.0, "grad_norm": 0.0, "grad_max": 0.0, "num_params": 0}
        flat = torch.cat(grads)
        stats = torch.stack([flat.mean(), flat.var(unbiased=False), flat.norm(), flat.abs().max()]).tolist()
        return {
            "grad_mean": stats[0],
            "grad_var": stats[1],
            "grad_norm": stats[2],
            "grad_max": stats[3],
            "num_params": flat.numel(),
        }

    @torch.no_grad()
    def metrics_tensor(self) -> torch.Tensor:
        """All device-side metrics, in ``DEVICE_METRICS`` order, as one device tensor, so a
        caller can fold them into its own single device->host copy."""
        dev = self._device
        if not self.enabled or not self._parameters:
            return torch.cat([torch.zeros(len(DEVICE_METRICS) - 1, device=dev), torch.ones(1, device=dev)])
        quantiles = kernels.quantiles(self._sampled_entries(), (0.1, 0.5, 0.9))
        mean = self._per_tensor_means(self._normalized_entries()).nanmean()
        correction = 1.0 - torch.pow(self._beta_tensor, self._spatial_steps)
        spatial = torch.where(
            self._spatial_steps > 0, self._spatial_ema / correction, torch.zeros_like(self._spatial_ema)
        )
        # order: norm, mean, var, max (the seed's metric order); scalar views, since a list
        # index is copied host->device first, which synchronises on CUDA
        spatial = torch.stack([spatial[2], spatial[0], spatial[1], spatial[3]])
        # NaN stays: it says no entry was defined (the factor then uses ``no_entry_fallback``)
        head = torch.cat([quantiles, mean.reshape(1)]).clamp(max=kernels.MAX_NORMALIZED_VARIANCE)
        return torch.cat(
            [head, spatial, self.normalized_variance_tensor().reshape(1), self.scaling_factor_tensor().reshape(1)]
        ).float()

    def host_metrics(self) -> dict[str, float]:
        """``vgs/step_count`` and ``vgs/warmup_active`` (host values, no sync)."""
        return {mn.VGS_STEP_COUNT: float(self._step_count), mn.VGS_WARMUP_ACTIVE: float(self.warmup_active)}

    def get_metrics(self) -> dict[str, float]:
        """Every ``vgs/*`` metric, named as the seed names them."""
        values = self.metrics_tensor().tolist()
        return {**dict(zip(DEVICE_METRICS, values, strict=True)), **self.host_metrics()}
