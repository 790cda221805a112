"""Variance Gradient Scaler (VGS) on per-parameter *temporal* (stochastic) gradient variance.

For every parameter element ``i`` (``granularity="element"``, two floats per element like
Adam) the scaler keeps EMAs over optimisation steps of ``|g_i|`` and ``g_i^2``,
bias-corrected as in Adam:

    a_i = EMA(|g_i|) / (1 - beta^t),   b_i = EMA(g_i^2) / (1 - beta^t)
    nv_i = max(b_i - a_i^2, 0) / (a_i^2 + eps)          (normalized temporal variance)

``nv`` is aggregated to one number (``p90`` by default, ``mean``, or ``weighted_mean``), capped
at 1e6, and every gradient is multiplied by one global factor ``clamp(1 / (1 + alpha * nv),
1e-4, 1)`` once ``warmup_steps`` steps have passed.

Undefined entries: an entry's ``nv`` above 1e6 (+Inf included) counts as 1e6; a NaN entry (an
``inf - inf`` after an overflow, a NaN in a restored state) is ignored by every aggregation,
as ``numpy.nanquantile`` / ``nanmean`` ignore it.  With no entry left, the aggregate is 1e6, the
most cautious factor (``vgs.kernels.no_entry_fallback``), and the ``vgs/stochastic_var_*``
metrics are NaN, so the fallback shows in MLflow.  A
gradient that does not change over time has ``nv = 0`` however uneven it is across
elements: unlike the seed's code, no spatial spread leaks into the temporal statistic.

``granularity="tensor"`` keeps, per parameter tensor, EMAs of one tensor-level statistic
``s = mean(|g|)`` and of ``s^2`` (two floats per tensor): the temporal variance of the
tensor's mean gradient magnitude.  It is far cheaper and still purely temporal, but it
averages element noise within a tensor, so it reads lower than ``"element"``.

Everything per step runs on the gradients' device with no host synchronisation; with
``p90`` (the default) over a fixed sample, one step is one pass over the gradients and the
two EMA buffers (``vgs.kernels``), compiled into one fused loop per tensor for large models;
uncompiled (small models), ``element`` keeps its EMAs flat and a step is a fixed handful of
kernels whatever the number of tensors (``vgs.flat_kernels``).  Reporting
getters (``get_normalized_variance``, ``get_scaling_factor``, ``get_metrics``,
``compute_gradient_statistics``) do synchronise.

Where the factor acts (on the gradient, or on the optimizer's update) is the learner's
choice: ``observe(scale_gradients=False)`` only returns it (``optim.scaled_step`` applies it to the update).

A step in which no parameter has a gradient at all (every ``p.grad`` is None: a module absent
from a sparse multi-agent minibatch) is left out entirely: no statistics update, no warmup step
(the ``step()`` after it does not count), nothing scaled; ``observe`` returns 1.  Known on the
host, so no sync.  A parameter without a gradient beside others that have one still counts as 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gradmon_ray import compat
from gradmon_ray.vgs import flat_kernels, kernels
from gradmon_ray.vgs.aggregation import AGGREGATION_METHODS, VGSAggregation
from gradmon_ray.vgs.checkpoint import (
    OLD_CHECKPOINT_WARNING,
    VGSCheckpoint,
    analytic_normalized_variance_of_abs,
)
from gradmon_ray.vgs.kernels import GRAD_LIMIT
from gradmon_ray.vgs.reporting import DEVICE_METRICS, HOST_METRICS, VGSReporting
from gradmon_ray.vgs.statistics import VGSStatistics

GRANULARITIES = ("element", "tensor")


class VarianceGradientScaler(VGSStatistics, VGSAggregation, VGSReporting, VGSCheckpoint):
    """Global gradient scaling by the temporal variance of the gradients.

    Per training step call ``scale_gradients()`` (updates the statistics, then scales
    ``p.grad`` in place) and ``step()`` (advances the warmup clock), as in the seed; or
    ``observe(scale_gradients=False)`` to get the factor without touching the gradients.

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
            replica uses the same sample); below it they are exact.  4096 entries put the
            sampled p90 within about half a percentile point of the exact one (binomial
            standard error sqrt(0.9 * 0.1 / 4096)); gathering and selecting them costs a
            fraction of the pass over the gradients, where 65536 cost more than the pass.
            At element granularity the legacy spatial statistics come from the same sample
            then (sums extrapolated to all elements; the max is the sample's).
        compile: ``"auto"`` (compile the per-step pass from 1M parameters), ``"on"`` or
            ``"off"``; see ``vgs.kernels``.
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
        quantile_sample_size: int = 4096,
        compile: str = "auto",
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
        self._idle = False  # the last observation had no gradient at all: the next step() does not count
        self._device = self._parameters[0].device if self._parameters else torch.device("cpu")
        self._numel = [p.numel() for p in self._parameters]
        compiled = kernels.wants_compile(compile, sum(self._numel))
        # Uncompiled (small models), the element EMAs are flat and a step is a fixed handful of
        # kernels (``vgs.flat_kernels``); compiled, one tensor per parameter, folded in place.
        self._flat = self.granularity == "element" and not compiled
        options = kernels.inductor_options(self._device)
        self._element_step = kernels.Kernel(kernels.element_step, compile=compiled, options=options)
        self._fold_elements = kernels.Kernel(kernels.fold_elements, compile=compiled, options=options)
        self._fold_tensors = kernels.Kernel(kernels.fold_tensors, compile=compiled, options=options)
        self._spatial_sums = kernels.Kernel(kernels.spatial_sums, compile=compiled, options=options)
        self._reset_statistics()

    @property
    def compiled(self) -> bool:
        """Whether the per-step pass runs compiled (known after the first step)."""
        kernels_ = (self._element_step, self._fold_elements, self._fold_tensors, self._spatial_sums)
        return any(k.compiled for k in kernels_)

    @property
    def step_count(self) -> int:
        """``step()`` calls so far (the warmup clock)."""
        return self._step_count

    @property
    def warmup_active(self) -> bool:
        return self._step_count < self.warmup_steps

    # --- per step (no host sync) -------------------------------------------------------------
    def _no_gradient(self) -> bool:
        """Whether no parameter has a gradient (host-side; remembered for the next ``step()``)."""
        self._idle = all(p.grad is None for p in self._parameters)
        return self._idle

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._parameters]

    def _weight(self, skip: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(1 - skip, the EMA weight ``(1 - beta) * (1 - skip)``)."""
        keep = self._one if skip is None else (1.0 - skip.to(self._device).float())
        return keep, (1.0 - self.beta) * keep

    def _fold(self, grads: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
        """Fold without scaling; returns the spatial sums over all elements."""
        if self._flat:
            return flat_kernels.fold_elements_flat(
                grads, self._workspace, self._workspace_views, self._element_means, self._element_squares, weight
            )
        if self.granularity == "element":
            sums = self._spatial_sums(grads)
            self._fold_elements(grads, self._means, self._squares, weight, None)
            return sums
        return self._fold_tensors(grads, self._tensor_mean_ema, self._tensor_sq_ema, self._param_numel, weight)

    def _record(self, keep: torch.Tensor, weight: torch.Tensor, sums: torch.Tensor) -> None:
        kernels.record_spatial(
            self._spatial_ema, self._spatial_steps, self._stat_steps, sums, keep, weight, sum(self._numel)
        )

    @torch.no_grad()
    def update_statistics(self, skip: torch.Tensor | None = None) -> None:
        """Fold the current gradients into the EMAs.

        ``skip`` (0-d tensor, 1.0 = skip) leaves every statistic unchanged, for a step
        whose gradients are not finite; non-finite entries are also cleaned before they can
        reach the EMAs, so a NaN can never poison them.
        """
        if not self.enabled or not self._parameters or self._no_gradient():
            return
        keep, weight = self._weight(skip)
        self._record(keep, weight, self._fold(self._grads(), weight))

    @torch.no_grad()
    def observe(self, skip: torch.Tensor | None = None, *, scale_gradients: bool) -> torch.Tensor:
        """Fold the current gradients into the statistics and return this step's factor as a
        0-d device tensor (1 during warmup); with ``scale_gradients`` also multiply every
        ``p.grad`` by it (in the same pass where it can: element granularity, ``p90``)."""
        if not self.enabled or not self._parameters or self._no_gradient():
            return torch.ones((), device=self._device)
        grads = self._grads()
        sampled = self._sample_parts or (self._flat and self._sample is not None)
        if sampled and self.aggregation_method == "p90":
            if self._active_value != (not self.warmup_active):  # flips once, when the warmup ends
                self._active_value = not self.warmup_active
                self._active.fill_(float(self._active_value))
            step, buffers = (
                (
                    flat_kernels.element_step_flat,
                    (
                        self._workspace,
                        self._workspace_views,
                        self._element_means,
                        self._element_squares,
                        self._sample,
                    ),
                )
                if self._flat
                else (self._element_step, (self._means, self._squares, self._sample_parts))
            )
            return step(
                grads,
                *buffers,
                (self._spatial_ema, self._spatial_steps, self._stat_steps),
                self._zero if skip is None else skip.to(self._device).float(),
                self._active,
                self._beta_tensor,
                self.eps,
                self.alpha,
                scale_gradients,
            )
        keep, weight = self._weight(skip)
        self._record(keep, weight, self._fold(grads, weight))
        factor = self.scaling_factor_tensor()
        if scale_gradients and not self.warmup_active:
            compat.foreach_mul_([p.grad for p in self._parameters if p.grad is not None], factor)
        return factor

    def scale_gradients(self, skip: torch.Tensor | None = None) -> torch.Tensor:
        """Update the statistics with the current gradients, then multiply every ``p.grad``
        by the scaling factor (nothing during warmup or when disabled).
        Returns the factor applied, as a 0-d device tensor."""
        return self.observe(skip, scale_gradients=True)

    def step(self) -> None:
        """Advance the warmup clock by one optimisation step (not after an observation without gradients)."""
        if self.enabled and not self._idle:
            self._step_count += 1
        self._idle = False


__all__ = [
    "AGGREGATION_METHODS",
    "DEVICE_METRICS",
    "GRAD_LIMIT",
    "GRANULARITIES",
    "HOST_METRICS",
    "OLD_CHECKPOINT_WARNING",
    "VarianceGradientScaler",
    "analytic_normalized_variance_of_abs",
]
