"""Variance Gradient Scaler (VGS) on per-parameter *temporal* (stochastic) gradient variance.

For every parameter element ``i`` (``granularity="element"``, two floats per element like
Adam) the scaler keeps EMAs over optimisation steps of ``|g_i|`` and ``g_i^2``,
bias-corrected as in Adam:

    a_i = EMA(|g_i|) / (1 - beta^t),   b_i = EMA(g_i^2) / (1 - beta^t)
    nv_i = max(b_i - a_i^2, 0) / (a_i^2 + eps)          (normalized temporal variance)

``nv`` is aggregated to one number (``p90`` of the finite entries by default, ``mean``, or
``weighted_mean``), capped at 1e6, and every gradient is multiplied by one global factor
``clamp(1 / (1 + alpha * nv), 1e-4, 1)`` once ``warmup_steps`` steps have passed.  A
gradient that does not change over time has ``nv = 0`` however uneven it is across
elements: unlike the seed's code, no spatial spread leaks into the temporal statistic.

``granularity="tensor"`` keeps, per parameter tensor, EMAs of one tensor-level statistic
``s = mean(|g|)`` and of ``s^2`` (two floats per tensor): the temporal variance of the
tensor's mean gradient magnitude.  It is far cheaper and still purely temporal, but it
averages element noise within a tensor, so it reads lower than ``"element"``.

Everything per step runs on the gradients' device with no host synchronisation.  Reporting
getters (``get_normalized_variance``, ``get_scaling_factor``, ``get_metrics``,
``compute_gradient_statistics``) do synchronise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.vgs_checkpoint import (
    OLD_CHECKPOINT_WARNING,
    VGSCheckpoint,
    analytic_normalized_variance_of_abs,
)

AGGREGATION_METHODS = ("p90", "mean", "weighted_mean")
GRANULARITIES = ("element", "tensor")
MAX_NORMALIZED_VARIANCE = 1e6
MIN_SCALE = 1e-4
GRAD_LIMIT = 1e18
"""Gradients are clamped to +-1e18 (NaN -> 0) before entering the EMAs: then g^2 <= 1e36 stays
finite in float32 and every normalized variance is finite by construction."""

# Order of ``metrics_tensor()``; ``vgs/step_count`` and ``vgs/warmup_active`` are host values.
DEVICE_METRICS = mn.VGS_DEVICE_METRICS
HOST_METRICS = mn.VGS_HOST_METRICS


class VarianceGradientScaler(VGSCheckpoint):
    """Global gradient scaling by the temporal variance of the gradients.

    Per training step call ``scale_gradients()`` (updates the statistics, then scales
    ``p.grad`` in place) and ``step()`` (advances the warmup clock), as in the seed.

    Args:
        parameters: the parameters whose ``.grad`` is scaled.
        enabled: False makes every method a no-op (statistics untouched, grads untouched).
        beta: EMA decay per step.
        alpha: scaling strength; the factor is ``1 / (1 + alpha * nv)``.
        eps: added to the squared mean in the normalisation.
        warmup_steps: ``step()`` calls before scaling starts (statistics update from step 1).
        aggregation_method: ``"p90"`` (90th percentile of the finite entries), ``"mean"``
            (mean over parameter tensors of each tensor's mean entry) or ``"weighted_mean"``
            (mean over tensors weighted by numel, i.e. over all elements).
        granularity: ``"element"`` or ``"tensor"`` (see the module docstring).
        quantile_sample_size: with more entries than this, percentiles are taken over a
            fixed uniform sample of this many entries, drawn once with a fixed seed (so every
            replica uses the same sample); below it they are exact.  Sorting millions of
            entries every step would cost more than the rest of VGS together.
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        *,
        enabled: bool = True,
        beta: float = 0.99,
        alpha: float = 0.1,
        eps: float = 1e-8,
        warmup_steps: int = 100,
        aggregation_method: str = "p90",
        granularity: str = "element",
        quantile_sample_size: int = 65536,
    ) -> None:
        if aggregation_method not in AGGREGATION_METHODS:
            raise ValueError(f"aggregation_method must be one of {AGGREGATION_METHODS}, got {aggregation_method!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        if alpha < 0 or eps <= 0 or warmup_steps < 0 or quantile_sample_size < 1:
            raise ValueError("need alpha >= 0, eps > 0, warmup_steps >= 0, quantile_sample_size >= 1")
        self._parameters = [p for p in parameters]
        self.enabled = enabled
        self.beta = float(beta)
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.warmup_steps = int(warmup_steps)
        self.aggregation_method = aggregation_method
        self.granularity = granularity
        self.quantile_sample_size = int(quantile_sample_size)
        self._step_count = 0
        self._device = self._parameters[0].device if self._parameters else torch.device("cpu")
        self._numel = [p.numel() for p in self._parameters]
        self._reset_statistics()

    # --- state ----------------------------------------------------------------------------
    def _reset_statistics(self) -> None:
        dev = self._device
        self._beta_tensor = torch.tensor(self.beta, device=dev)
        self._one = torch.ones((), device=dev)
        size = sum(self._numel) if self.granularity == "element" else len(self._parameters)
        self._mean_ema = torch.zeros(size, device=dev)  # EMA of |g| (or of s = mean|g|)
        self._sq_ema = torch.zeros(size, device=dev)  # EMA of g^2 (or of s^2)
        self._param_numel = torch.tensor(self._numel, dtype=torch.float32, device=dev)
        # Statistics updates that were applied (skipped non-finite steps do not count): on
        # the device, so that a skip decision never has to reach the host.
        self._stat_steps = torch.zeros((), device=dev)
        # Legacy spatial EMAs (mean, var, norm, max of all gradient elements), for logging.
        self._spatial_ema = torch.zeros(4, device=dev)
        self._spatial_steps = torch.zeros((), device=dev)
        # Work buffers, allocated once: at 10M parameters a fresh 40 MB temporary per step
        # costs more (page faults) than all of VGS's arithmetic (bench/vgs.py).
        self._work_flat: torch.Tensor | None = None
        self._work_sq: torch.Tensor | None = None
        size = self._mean_ema.numel()
        if size > self.quantile_sample_size:
            gen = torch.Generator().manual_seed(0)
            self._sample = torch.randperm(size, generator=gen)[: self.quantile_sample_size].sort().values.to(dev)
        else:
            self._sample = None

    @property
    def step_count(self) -> int:
        """``step()`` calls so far (the warmup clock)."""
        return self._step_count

    @property
    def warmup_active(self) -> bool:
        return self._step_count < self.warmup_steps

    # --- per step (no host sync) -------------------------------------------------------------
    @torch.no_grad()
    def update_statistics(self, skip: torch.Tensor | None = None) -> None:
        """Fold the current gradients into the EMAs.

        ``skip`` (0-d tensor, 1.0 = skip) leaves every statistic unchanged, for a step
        whose gradients are not finite; non-finite entries are also zeroed before they can
        reach the EMAs, so a NaN can never poison them.
        """
        if not self.enabled or not self._parameters:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._parameters]
        keep = self._one if skip is None else (1.0 - skip.to(self._device).float())
        weight = (1.0 - self.beta) * keep
        if self.granularity == "element":
            if self._work_flat is None:
                self._work_flat = torch.empty(self._mean_ema.numel(), device=self._device)
                self._work_sq = torch.empty_like(self._work_flat)
            flat, sq = self._work_flat, self._work_sq
            torch.cat([g.reshape(-1).float() for g in grads], out=flat)
            torch.nan_to_num_(flat, nan=0.0, posinf=GRAD_LIMIT, neginf=-GRAD_LIMIT).clamp_(-GRAD_LIMIT, GRAD_LIMIT)
            torch.mul(flat, flat, out=sq)
            # Legacy spatial statistics from the same buffers: mean, var, norm, max|g|.
            n = flat.numel()
            total, total_sq = flat.sum(), sq.sum()
            self._sq_ema.lerp_(sq, weight)
            magnitude = flat.abs_()
            self._mean_ema.lerp_(magnitude, weight)
            spatial = torch.stack([total / n, total_sq / n - (total / n) ** 2, total_sq.sqrt(), magnitude.max()])
        else:
            # Read-only reductions, no large temporaries: measured on CPU, _foreach_norm with
            # ord=1 or inf allocates |g| (16 ms at 10M parameters); vector_norm / aminmax do not.
            l1 = torch.stack([torch.linalg.vector_norm(g, 1) for g in grads]).float()
            l2 = torch.stack(torch._foreach_norm(grads, 2)).float()
            extremes = torch.stack([torch.stack(torch.aminmax(g)) for g in grads]).float()
            linf = torch.maximum(-extremes[:, 0], extremes[:, 1])
            sums = torch.stack([g.sum() for g in grads]).float()
            n = float(sum(self._numel))
            stat = torch.nan_to_num(l1 / self._param_numel, nan=0.0, posinf=GRAD_LIMIT).clamp_(max=GRAD_LIMIT)
            self._mean_ema.lerp_(stat, weight)
            self._sq_ema.lerp_(stat * stat, weight)
            total, total_sq = sums.sum(), (l2 * l2).sum()
            spatial = torch.stack([total / n, total_sq / n - (total / n) ** 2, total_sq.sqrt(), linf.max()])
        spatial = torch.nan_to_num(spatial, nan=0.0, posinf=0.0, neginf=0.0)
        self._spatial_ema.lerp_(spatial, weight)
        self._stat_steps.add_(keep)
        self._spatial_steps.add_(keep)

    def _normalized_entries(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Per-entry normalized temporal variance; non-finite entries as NaN (dropped later)."""
        mean_ema = self._mean_ema if index is None else self._mean_ema[index]
        sq_ema = self._sq_ema if index is None else self._sq_ema[index]
        correction = 1.0 - torch.pow(self._beta_tensor, self._stat_steps)
        a = mean_ema / correction
        b = sq_ema / correction
        a2 = a * a
        nv = torch.clamp(b - a2, min=0.0) / (a2 + self.eps)
        nv = torch.where(torch.isfinite(nv), nv, torch.nan)
        # Before the first update every entry is 0/0: report 0, not NaN.
        return torch.where(self._stat_steps > 0, nv, torch.zeros_like(nv))

    def _aggregate(self) -> torch.Tensor:
        if self.aggregation_method == "p90":
            value = self._quantiles(self._normalized_entries(self._sample), (0.9,))[0]
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
        value = torch.nan_to_num(value, nan=0.0)
        return torch.clamp(value, max=MAX_NORMALIZED_VARIANCE)

    @staticmethod
    def _quantiles(values: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
        """``torch.quantile``'s linear interpolation, by selection (O(n)) instead of a sort.

        Entries are finite by construction (``GRAD_LIMIT``); should one ever be NaN it is
        treated as +inf, so it can raise a high percentile but never hide one.
        """
        n = values.numel()
        if n == 0:
            return torch.zeros(len(qs), device=values.device)
        values = torch.nan_to_num(values, nan=float("inf"))
        out = []
        for q in qs:
            pos = q * (n - 1)
            lo, frac = math.floor(pos), pos - math.floor(pos)
            low = torch.kthvalue(values, lo + 1).values
            if frac == 0.0:
                out.append(low)
            else:
                high = torch.kthvalue(values, min(lo + 2, n)).values
                out.append(low + frac * (high - low))
        return torch.stack(out)

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

    @torch.no_grad()
    def scale_gradients(self, skip: torch.Tensor | None = None) -> torch.Tensor:
        """Update the statistics with the current gradients, then multiply every ``p.grad``
        by the scaling factor (a foreach multiply; nothing during warmup or when disabled).
        Returns the factor applied, as a 0-d device tensor."""
        if not self.enabled:
            return torch.ones((), device=self._device)
        self.update_statistics(skip)
        scale = self.scaling_factor_tensor()
        if not self.warmup_active:
            grads = [p.grad for p in self._parameters if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale)
        return scale

    def step(self) -> None:
        """Advance the warmup clock by one optimisation step."""
        if self.enabled:
            self._step_count += 1

    # --- reporting (these synchronise) --------------------------------------------------------
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
        quantiles = self._quantiles(self._normalized_entries(self._sample), (0.1, 0.5, 0.9))
        mean = self._per_tensor_means(self._normalized_entries()).nanmean()
        correction = 1.0 - torch.pow(self._beta_tensor, self._spatial_steps)
        spatial = torch.where(
            self._spatial_steps > 0, self._spatial_ema / correction, torch.zeros_like(self._spatial_ema)
        )
        # order: norm, mean, var, max (the seed's metric order); scalar views, since a list
        # index is copied host->device first, which synchronises on CUDA
        spatial = torch.stack([spatial[2], spatial[0], spatial[1], spatial[3]])
        head = torch.nan_to_num(torch.cat([quantiles, mean.reshape(1)]), nan=0.0).clamp(max=MAX_NORMALIZED_VARIANCE)
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


__all__ = [
    "AGGREGATION_METHODS",
    "DEVICE_METRICS",
    "GRANULARITIES",
    "HOST_METRICS",
    "OLD_CHECKPOINT_WARNING",
    "VarianceGradientScaler",
    "analytic_normalized_variance_of_abs",
]
