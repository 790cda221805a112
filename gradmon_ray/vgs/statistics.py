"""The Variance Gradient Scaler's statistics buffers: allocation, flat views, loading.

``VGSStatistics`` is a mixin of ``gradmon_ray.vgs.scaler.VarianceGradientScaler`` (it reads the
scaler's settings).  ``element`` granularity keeps two EMAs per gradient element: flat buffers
when the step runs uncompiled (``vgs.flat_kernels``), one tensor per parameter when it is
compiled (``vgs.kernels``: a compiled fold reads and writes each in place); ``tensor``
granularity keeps two floats per parameter tensor.
"""

from __future__ import annotations

import torch

from gradmon_ray.vgs import kernels


class VGSStatistics:
    """The EMA buffers, the fixed sample and the counters of a ``VarianceGradientScaler``."""

    def _reset_statistics(self) -> None:
        dev = self._device
        self._beta_tensor = torch.tensor(self.beta, device=dev)
        self._one = torch.ones((), device=dev)
        self._zero = torch.zeros((), device=dev)
        self._active = torch.zeros((), device=dev)  # 1.0 once the warmup is over (a device flag)
        self._active_value = False
        if self._flat:
            self._element_means = torch.zeros(sum(self._numel), device=dev)
            self._element_squares = torch.zeros(sum(self._numel), device=dev)
            size = sum(self._numel)
            # Scratch for the step's cleaned gradients, reused every step (a fresh gradient-sized
            # tensor a step costs an allocation and, on a CPU, page faults), and its per-parameter views.
            self._workspace = torch.empty(size, device=dev)
            self._workspace_views = [
                view.view(p.shape) for view, p in zip(self._workspace.split(self._numel), self._parameters, strict=True)
            ]
        elif self.granularity == "element":
            # One EMA tensor per parameter, shaped like it: a compiled fold then reads and
            # writes each in place (views into one flat buffer would alias the inputs).
            self._means = [torch.zeros(p.shape, device=dev) for p in self._parameters]
            self._squares = [torch.zeros(p.shape, device=dev) for p in self._parameters]
            size = sum(self._numel)
        else:
            self._tensor_mean_ema = torch.zeros(len(self._parameters), device=dev)  # EMA of s = mean|g|
            self._tensor_sq_ema = torch.zeros(len(self._parameters), device=dev)  # EMA of s^2
            size = len(self._parameters)
        self._param_numel = torch.tensor(self._numel, dtype=torch.float32, device=dev)
        # Statistics updates that were applied (skipped non-finite steps do not count): on
        # the device, so that a skip decision never has to reach the host.
        self._stat_steps = torch.zeros((), device=dev)
        # Legacy spatial EMAs (mean, var, norm, max of all gradient elements), for logging.
        self._spatial_ema = torch.zeros(4, device=dev)
        self._spatial_steps = torch.zeros((), device=dev)
        self._sample: torch.Tensor | None = None
        self._sample_parts: list[tuple[int, torch.Tensor]] = []
        if size > self.quantile_sample_size:
            self._sample, parts = kernels.fixed_sample(
                self._numel if self.granularity == "element" else [size], self.quantile_sample_size, dev
            )
            self._sample_parts = parts if self.granularity == "element" and not self._flat else []

    @property
    def _mean_ema(self) -> torch.Tensor:
        """EMA of ``|g|`` (element) or of ``s`` (tensor), flat, in parameter order."""
        if self._flat:
            return self._element_means
        if self.granularity == "element":
            return torch.cat([m.reshape(-1) for m in self._means]) if self._means else torch.zeros(0)
        return self._tensor_mean_ema

    @property
    def _sq_ema(self) -> torch.Tensor:
        """EMA of ``g^2`` (element) or of ``s^2`` (tensor), flat, in parameter order."""
        if self._flat:
            return self._element_squares
        if self.granularity == "element":
            return torch.cat([s.reshape(-1) for s in self._squares]) if self._squares else torch.zeros(0)
        return self._tensor_sq_ema

    def _load_statistics(self, mean_ema: torch.Tensor, sq_ema: torch.Tensor) -> None:
        """Copy flat EMAs (``_mean_ema``'s layout) into this scaler's state."""
        mean_ema, sq_ema = mean_ema.reshape(-1).to(self._device), sq_ema.reshape(-1).to(self._device)
        if self._flat:
            self._element_means.copy_(mean_ema)
            self._element_squares.copy_(sq_ema)
        elif self.granularity == "element":
            for dst, src in zip(self._means, mean_ema.split(self._numel), strict=True):
                dst.copy_(src.reshape(dst.shape))
            for dst, src in zip(self._squares, sq_ema.split(self._numel), strict=True):
                dst.copy_(src.reshape(dst.shape))
        else:
            self._tensor_mean_ema.copy_(mean_ema)
            self._tensor_sq_ema.copy_(sq_ema)
