"""The Variance Gradient Scaler's per-step arithmetic, as plain functions over tensor lists.

``fold_elements`` and ``fold_tensors`` are the part whose cost grows with the model: they
read every gradient once, update the EMAs in place and (``fold_elements`` with a factor)
scale the gradients in the same loop.  Eagerly each line is its own pass over memory;
``torch.compile`` fuses a whole fold into one pass per tensor (Inductor's C++/OpenMP code on
CPU, Triton on CUDA), which is what keeps VGS near the cost of one fused Adam step
(``bench/vgs.py``).  ``Kernel`` compiles lazily, on first use, and falls back to eager
(with one warning) where compiling fails (``telemetry.compiled``), so the compile cost lands only on runs that ask
for it (``VarianceGradientScaler(compile=...)``); the eager and the compiled fold are the
same function, and the tests check both against the same worked answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# The lazy compile with an eager fallback serves the norm plan too: it lives in ``compiled``.
from gradmon_ray.compile_on_demand import AUTO_COMPILE_MIN_PARAMETERS, COMPILE_MODES, Kernel, wants_compile

GRAD_LIMIT = 1e18
"""Gradients are clamped to +-1e18 (NaN -> 0) before entering the EMAs: then g^2 <= 1e36 stays
finite in float32 and every normalized variance is finite by construction."""

MAX_NORMALIZED_VARIANCE = 1e6
MIN_SCALE = 1e-4


def inductor_options(device: torch.device) -> dict[str, bool] | None:
    """Inductor's options for the compiled step on ``device``.  On CPU Inductor already puts the
    per-tensor loops of a step into a fixed handful of C++ kernels (``tests/vgs/test_launches.py``
    counts them); on CUDA it writes one Triton kernel per tensor and loop unless ``combo_kernels``
    fuses them horizontally, so the launches do not grow with the number of tensors
    (not measured on a GPU yet: docs/BENCHMARKS.md)."""
    return {"combo_kernels": True} if device.type == "cuda" else None


def clean(grad: torch.Tensor) -> torch.Tensor:
    """The gradient as float32 with NaN -> 0 and +-Inf (and anything beyond) -> +-``GRAD_LIMIT``.

    ``x == x`` rather than ``nan_to_num``: Inductor's C++ code tests ``isnan`` one element at
    a time, but vectorises the comparison."""
    x = grad.float()
    return torch.where(x == x, x, 0.0).clamp(-GRAD_LIMIT, GRAD_LIMIT)


def fold_elements(
    grads: Sequence[torch.Tensor],
    means: Sequence[torch.Tensor],
    squares: Sequence[torch.Tensor],
    weight: torch.Tensor,
    factor: torch.Tensor | None,
) -> None:
    """Per element: ``mean <- lerp(mean, |g|, weight)``, ``square <- lerp(square, g^2, weight)``
    (``g`` cleaned), then ``g <- g * factor`` when a factor is given.  ``means[i]`` and
    ``squares[i]`` are tensors shaped like ``grads[i]``.  No reductions: a sum over millions
    of elements in the same loop would cost as much as the rest of the pass (bench/vgs.py)."""
    for grad, mean, square in zip(grads, means, squares, strict=True):
        x = clean(grad)
        mean.lerp_(x.abs(), weight)
        square.lerp_(x * x, weight)
        if factor is not None:
            grad.mul_(factor.to(grad.dtype))


def spatial_sums(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[sum x, sum x^2, max |x|]`` over the cleaned ``values`` (the spatial statistics' inputs)."""
    cleaned = [clean(v) for v in values]
    totals = torch.stack([x.sum() for x in cleaned]).sum()
    squared = torch.stack([(x * x).sum() for x in cleaned]).sum()
    peak = torch.stack([x.abs().amax() for x in cleaned]).amax()
    return torch.stack([totals, squared, peak])


def cleaned_sums(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``spatial_sums`` of one tensor that is ``clean`` already: ``[scale * sum x, scale * sum x^2,
    max |x|]`` (``scale`` extrapolates a sample's sums to the whole population)."""
    return torch.stack([scale * x.sum(), scale * (x * x).sum(), x.abs().amax()])


def fold_tensors(
    grads: Sequence[torch.Tensor],
    mean_ema: torch.Tensor,
    sq_ema: torch.Tensor,
    numel: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """Per tensor: ``s = mean |g|`` into ``mean_ema``/``sq_ema`` (``s`` and ``s^2``).

    Read-only reductions of the raw gradients, no gradient-sized temporaries (eagerly, 4
    passes; compiled, one); a non-finite ``s`` enters as 0 (``GRAD_LIMIT`` for +Inf).
    Returns the spatial sums ``[sum g, sum g^2, max |g|]``.
    """
    l1 = torch.stack([torch.linalg.vector_norm(g, 1) for g in grads]).float()
    l2 = torch.stack([torch.linalg.vector_norm(g, 2) for g in grads]).float()
    peaks = torch.stack([torch.linalg.vector_norm(g, math.inf) for g in grads]).float()
    sums = torch.stack([g.sum() for g in grads]).float()
    stat = torch.nan_to_num(l1 / numel, nan=0.0, posinf=GRAD_LIMIT).clamp(max=GRAD_LIMIT)
    mean_ema.lerp_(stat, weight)
    sq_ema.lerp_(stat * stat, weight)
    return torch.stack([sums.sum(), (l2 * l2).sum(), peaks.amax()])


def normalized_entries(
    mean_ema: torch.Tensor, sq_ema: torch.Tensor, steps: torch.Tensor, beta: torch.Tensor, eps: float
) -> torch.Tensor:
    """Bias-corrected ``max(b - a^2, 0) / (a^2 + eps)`` per entry, capped at
    ``MAX_NORMALIZED_VARIANCE`` (+Inf included: the noisiest entry there is); NaN where it is
    undefined (``inf - inf`` after an overflow, a NaN in a restored EMA); all zeros before the
    first update (``steps == 0``)."""
    correction = 1.0 - torch.pow(beta, steps)
    a = mean_ema / correction
    b = sq_ema / correction
    a2 = a * a
    nv = torch.clamp(b - a2, min=0.0) / (a2 + eps)
    nv = nv.clamp(max=MAX_NORMALIZED_VARIANCE)  # NaN stays NaN
    return torch.where(steps > 0, nv, torch.zeros_like(nv))


def quantiles(values: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """``numpy.nanquantile(values, qs)`` (linear interpolation), by selection (O(n)) instead of a
    sort, with no host sync: NaN entries are ignored; NaN when every entry is NaN.

    Entries must be finite or NaN (``normalized_entries`` caps +Inf): the interpolation then
    never meets ``inf - inf``.  The position among the ``m`` non-NaN entries depends on ``m``,
    a device value, while ``kthvalue`` needs its rank ``k`` on the host: ``k`` is the rank
    with no NaN at all, and ``k - lo`` of the NaN entries are moved below every value (the
    others above), so that rank ``k`` of the whole is rank ``lo`` of the non-NaN entries.  Its
    upper neighbour is the same value when enough entries tie with it, else the smallest entry
    above it (two cheap reductions, not a second selection).
    """
    n = values.numel()
    if n == 0:
        return torch.zeros(len(qs), device=values.device)
    nan = torch.isnan(values)
    m = n - nan.sum()  # non-NaN entries, on the device
    nan_rank = torch.cumsum(nan.int(), 0)  # 1, 2, ... over the NaN entries, in index order
    out = []
    for q in qs:
        k = math.floor(q * (n - 1))
        pos = q * (m - 1).to(values.dtype)  # the position in the entries' own precision
        lo = torch.floor(pos)
        frac = pos - lo
        below = nan & (nan_rank <= k - lo)  # the NaN entries that go under every value
        filled = torch.where(nan, torch.where(below, -math.inf, math.inf), values)
        low = torch.kthvalue(filled, k + 1).values
        above = torch.where(filled > low, filled, math.inf).amin()
        high = torch.where((filled <= low).sum() >= k + 2, low, above)
        # frac == 0 exactly when low is the answer; high may then be +inf, and where() drops the NaN of 0 * inf
        value = torch.where(frac > 0, low + frac * (high - low), low)
        out.append(torch.where(m > 0, value, torch.nan))
    return torch.stack(out)


def record_spatial(
    spatial_ema: torch.Tensor,
    spatial_steps: torch.Tensor,
    stat_steps: torch.Tensor,
    sums: torch.Tensor,
    keep: torch.Tensor,
    weight: torch.Tensor,
    numel: int,
) -> None:
    """Count an applied update (``keep``) and fold the spatial statistics (mean, var, norm,
    max of all gradient elements) from a fold's ``[sum g, sum g^2, max |g|]``."""
    mean = sums[0] / numel
    spatial = torch.stack([mean, sums[1] / numel - mean * mean, sums[1].sqrt(), sums[2]])
    spatial_ema.lerp_(torch.nan_to_num(spatial, nan=0.0, posinf=0.0, neginf=0.0), weight)
    stat_steps.add_(keep)
    spatial_steps.add_(keep)


def element_step(
    grads: Sequence[torch.Tensor],
    means: Sequence[torch.Tensor],
    squares: Sequence[torch.Tensor],
    sample: Sequence[tuple[int, torch.Tensor]],
    counters: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    skip: torch.Tensor,
    active: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    alpha: float,
    scale_gradients: bool,
) -> torch.Tensor:
    """One whole element-granularity step with ``p90`` over a fixed sample; returns the factor.

    The sampled entries' normalized variance is computed first as it WILL be after this
    step's fold (from the sampled gradient elements only), so the factor is known before the
    single pass that folds every gradient and, with ``scale_gradients``, scales it.
    ``sample``: (tensor index, flat indices inside that tensor); ``counters``: (spatial EMA,
    spatial steps, statistics steps), updated in place; ``skip``: 1.0 leaves every
    statistic unchanged; ``active``: 1.0 once the warmup is over (else the factor is 1).
    """
    stat_steps = counters[2]
    keep = 1.0 - skip
    weight = (1.0 - beta) * keep
    picked = clean(torch.cat([grads[i].reshape(-1)[index] for i, index in sample]))
    sampled_means = torch.cat([means[i].reshape(-1)[index] for i, index in sample])
    sampled_squares = torch.cat([squares[i].reshape(-1)[index] for i, index in sample])
    factor = sampled_factor(picked, sampled_means, sampled_squares, weight, stat_steps + keep, beta, eps, alpha, active)
    fold_elements(grads, means, squares, weight, factor if scale_gradients else None)
    record_sampled_spatial(picked, sum(g.numel() for g in grads), counters, keep, weight)
    return factor


def sampled_factor(
    picked: torch.Tensor,
    sampled_means: torch.Tensor,
    sampled_squares: torch.Tensor,
    weight: torch.Tensor,
    steps: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    alpha: float,
    active: torch.Tensor,
) -> torch.Tensor:
    """The factor from the sampled entries as they WILL be after this step's fold: their EMAs
    (``sampled_means``/``sampled_squares``) lerped towards the cleaned sampled gradient elements
    ``picked``, their p90 normalized variance, ``scaling_factor``."""
    sampled_means = sampled_means.lerp(picked.abs(), weight)
    sampled_squares = sampled_squares.lerp(picked * picked, weight)
    nv = normalized_entries(sampled_means, sampled_squares, steps, beta, eps)
    return scaling_factor(no_entry_fallback(quantiles(nv, (0.9,))[0]), alpha, active)


def record_sampled_spatial(
    picked: torch.Tensor,
    numel: int,
    counters: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    keep: torch.Tensor,
    weight: torch.Tensor,
) -> None:
    """The spatial statistics from the sampled elements: their sums extrapolated to all ``numel``
    elements (mean, variance and norm are then unbiased estimates), the max over the sample."""
    spatial_ema, spatial_steps, stat_steps = counters
    sums = cleaned_sums(picked, scale=numel / picked.numel())
    record_spatial(spatial_ema, spatial_steps, stat_steps, sums, keep, weight, numel)


def no_entry_fallback(value: torch.Tensor) -> torch.Tensor:
    """The aggregated normalized variance to scale by: NaN (no entry was defined) becomes
    ``MAX_NORMALIZED_VARIANCE``, the smallest factor: with no statistic to vouch for the
    gradients' noise, VGS takes the most cautious step, and the ``vgs/stochastic_var_*``
    metrics report NaN, never a silent factor of 1."""
    return torch.nan_to_num(value, nan=MAX_NORMALIZED_VARIANCE).clamp(max=MAX_NORMALIZED_VARIANCE)


def scaling_factor(value: torch.Tensor, alpha: float, active: torch.Tensor) -> torch.Tensor:
    """``clamp(1 / (1 + alpha * value), MIN_SCALE, 1)`` once ``active``, else 1."""
    factor = torch.clamp(1.0 / (1.0 + alpha * value), MIN_SCALE, 1.0)
    return torch.where(active > 0, factor, torch.ones_like(factor))


def fixed_sample(
    numels: Sequence[int], size: int, device: torch.device
) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """``size`` distinct flat entry indices, uniform, sorted, from a fixed seed (the same on every
    replica), and the same entries as (tensor index, indices inside that tensor) for tensors of
    ``numels`` entries: the per-step sample is gathered in place, never from a flat copy."""
    sample = torch.randperm(sum(numels), generator=torch.Generator().manual_seed(0))[:size].sort().values
    offsets = torch.tensor([0, *numels]).cumsum(0)
    owner = torch.bucketize(sample, offsets[1:], right=True)
    parts = [(i, (sample[owner == i] - offsets[i]).to(device)) for i in range(len(numels)) if (owner == i).any()]
    return sample.to(device), parts


__all__ = [
    "AUTO_COMPILE_MIN_PARAMETERS",
    "COMPILE_MODES",
    "GRAD_LIMIT",
    "MAX_NORMALIZED_VARIANCE",
    "MIN_SCALE",
    "Kernel",
    "clean",
    "cleaned_sums",
    "element_step",
    "fixed_sample",
    "fold_elements",
    "fold_tensors",
    "inductor_options",
    "no_entry_fallback",
    "normalized_entries",
    "quantiles",
    "record_sampled_spatial",
    "record_spatial",
    "sampled_factor",
    "scaling_factor",
    "spatial_sums",
    "wants_compile",
]
