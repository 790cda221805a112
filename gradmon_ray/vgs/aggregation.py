"""From per-entry statistics to one number and one factor: the aggregation half of the VGS.

``VGSAggregation`` is a mixin of ``gradmon_ray.vgs.scaler.VarianceGradientScaler``; it reads the
scaler's EMA buffers and settings.  The rules for undefined entries are in the scaler's module
docstring (NaN entries are ignored, as ``numpy.nanquantile``/``nanmean`` ignore them).
"""

from __future__ import annotations

import torch

from gradmon_ray.vgs import kernels
from gradmon_ray.vgs.kernels import MIN_SCALE

AGGREGATION_METHODS = ("p90", "mean", "weighted_mean")


class VGSAggregation:
    """The aggregated normalized variance and the scaling factor, as device tensors (no sync)."""

    def _normalized_entries(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Per-entry normalized temporal variance (flat); non-finite entries as NaN."""
        mean_ema = self._mean_ema if index is None else self._mean_ema[index]
        sq_ema = self._sq_ema if index is None else self._sq_ema[index]
        return kernels.normalized_entries(mean_ema, sq_ema, self._stat_steps, self._beta_tensor, self.eps)

    def _sampled_entries(self) -> torch.Tensor:
        """The sampled (or all) entries' normalized variance, gathered without a flat copy."""
        if not self._sample_parts:
            return self._normalized_entries(self._sample)
        means = torch.cat([self._means[i].reshape(-1)[index] for i, index in self._sample_parts])
        squares = torch.cat([self._squares[i].reshape(-1)[index] for i, index in self._sample_parts])
        return kernels.normalized_entries(means, squares, self._stat_steps, self._beta_tensor, self.eps)

    def _aggregate(self) -> torch.Tensor:
        if self.aggregation_method == "p90":
            value = kernels.quantiles(self._sampled_entries(), (0.9,))[0]
        else:
            nv = self._normalized_entries()
            finite = ~torch.isnan(nv)
            if self.aggregation_method == "weighted_mean":
                # Each tensor's mean weighted by its numel = the mean over all finite elements
                # (element granularity); per tensor entries weighted by numel (tensor granularity).
                w = torch.ones_like(nv) if self.granularity == "element" else self._param_numel
                value = (torch.where(finite, nv, 0.0) * w).sum() / (finite * w).sum()
            else:
                value = self._per_tensor_means(nv).nanmean()
        return kernels.no_entry_fallback(value)

    def _per_tensor_means(self, nv: torch.Tensor) -> torch.Tensor:
        """Each parameter tensor's mean finite entry (NaN for a tensor with none)."""
        if self.granularity == "tensor":
            return nv
        return torch.stack([chunk.nanmean() for chunk in nv.split(self._numel)])

    def normalized_variance_tensor(self) -> torch.Tensor:
        """The aggregated normalized variance as a 0-d device tensor (no sync)."""
        if not self.enabled or not self._parameters:
            return torch.zeros((), device=self._device)
        return self._aggregate()

    def scaling_factor_tensor(self) -> torch.Tensor:
        """``clamp(1 / (1 + alpha * nv), 1e-4, 1)`` as a 0-d device tensor (1 during warmup)."""
        if not self.enabled or self.warmup_active or not self._parameters:
            return torch.ones((), device=self._device)
        return torch.clamp(1.0 / (1.0 + self.alpha * self.normalized_variance_tensor()), MIN_SCALE, 1.0)
