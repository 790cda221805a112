"""A faithful copy of the seed's VGS (seed 002), kept ONLY as a baseline to compare against.

Per-tensor EMAs of ``grad.abs().mean()`` and ``grad.pow(2).mean()`` with a ``.item()`` per
tensor per statistic, plus the legacy spatial statistics over a concatenation of all
gradients every step, exactly as the seed's ``update_statistics`` does.  Its flaws are the
point: spatial spread inside a tensor leaks into the "temporal" variance, and it syncs with
the host twice per tensor.  Do not use it for training.
"""

from __future__ import annotations

import torch


class SeedVarianceGradientScaler:
    def __init__(
        self, parameters, enabled=True, beta=0.99, alpha=0.1, eps=1e-8, warmup_steps=100, aggregation_method="p90"
    ):
        self._parameters = list(parameters)
        self.enabled, self.beta, self.alpha, self.eps = enabled, beta, alpha, eps
        self.warmup_steps, self.aggregation_method = warmup_steps, aggregation_method
        self._step_count = 0
        self._param_grad_mean_ema = None
        self._param_grad_sq_ema = None
        self._param_numel = None
        self._grad_mean_ema = None
        self._grad_var_ema = None

    def _initialize_per_param_stats(self):
        n = len(self._parameters)
        device = self._parameters[0].device
        self._param_grad_mean_ema = torch.zeros(n, device=device)
        self._param_grad_sq_ema = torch.zeros(n, device=device)
        self._param_numel = torch.tensor([p.numel() for p in self._parameters], device=device, dtype=torch.float32)

    @torch.no_grad()
    def compute_gradient_statistics(self):
        grads = [p.grad.reshape(-1) for p in self._parameters if p.grad is not None]
        if not grads:
            return {"grad_mean": 0.0, "grad_var": 0.0, "grad_norm": 0.0, "grad_max": 0.0, "num_params": 0}
        flat = torch.cat(grads)
        return {
            "grad_mean": flat.mean().item(),
            "grad_var": flat.var().item(),
            "grad_norm": flat.norm().item(),
            "grad_max": flat.abs().max().item(),
            "num_params": flat.numel(),
        }

    @torch.no_grad()
    def update_statistics(self):
        if self._param_grad_mean_ema is None:
            self._initialize_per_param_stats()
        for i, param in enumerate(self._parameters):
            if param.grad is None:
                continue
            grad = param.grad.data
            grad_abs_mean = grad.abs().mean().item()
            grad_sq_mean = grad.pow(2).mean().item()
            if self._step_count == 1:
                self._param_grad_mean_ema[i] = grad_abs_mean
                self._param_grad_sq_ema[i] = grad_sq_mean
            else:
                self._param_grad_mean_ema[i] = (
                    self.beta * self._param_grad_mean_ema[i] + (1 - self.beta) * grad_abs_mean
                )
                self._param_grad_sq_ema[i] = self.beta * self._param_grad_sq_ema[i] + (1 - self.beta) * grad_sq_mean
        stats = self.compute_gradient_statistics()
        if stats["num_params"] > 0:
            if self._grad_mean_ema is None:
                self._grad_mean_ema, self._grad_var_ema = stats["grad_mean"], stats["grad_var"]
            else:
                self._grad_mean_ema = self.beta * self._grad_mean_ema + (1 - self.beta) * stats["grad_mean"]
                self._grad_var_ema = self.beta * self._grad_var_ema + (1 - self.beta) * stats["grad_var"]

    @torch.no_grad()
    def get_normalized_variance(self):
        if self._param_grad_mean_ema is None or self._step_count == 0:
            return 0.0
        bias_correction = 1.0 - self.beta**self._step_count
        mean_corrected = self._param_grad_mean_ema / bias_correction
        sq_corrected = self._param_grad_sq_ema / bias_correction
        variance = torch.clamp(sq_corrected - mean_corrected.pow(2), min=0.0)
        denominator = torch.clamp(mean_corrected.pow(2), min=1e-12) + self.eps
        normalized_var = variance / denominator
        normalized_var = torch.where(torch.isfinite(normalized_var), normalized_var, torch.zeros_like(normalized_var))
        if self.aggregation_method == "mean":
            global_var = normalized_var.mean().item()
        elif self.aggregation_method == "weighted_mean":
            global_var = ((normalized_var * self._param_numel).sum() / self._param_numel.sum()).item()
        else:
            global_var = torch.quantile(normalized_var, 0.9).item()
        return float(min(global_var, 1e6))

    def get_scaling_factor(self):
        if not self.enabled or self._step_count < self.warmup_steps:
            return 1.0
        return float(min(max(1.0 / (1.0 + self.alpha * self.get_normalized_variance()), 1e-4), 1.0))

    @torch.no_grad()
    def scale_gradients(self):
        if not self.enabled:
            return 1.0
        self.update_statistics()
        scale = self.get_scaling_factor()
        if scale != 1.0:
            for p in self._parameters:
                if p.grad is not None:
                    p.grad.data.mul_(scale)
        return scale

    def step(self):
        self._step_count += 1
