"""Does the VGS factor reach the parameters?  Per optimizer step, ||dtheta with VGS|| / ||dtheta without||.

For each optimizer (Adam, Adam + a binding global-norm clip, UPGD, plain SGD) and each mode
(``gradient``: the factor scales the gradient before clipping; ``update``: it scales the
optimizer's step), a VGS arm trains on a stream of noisy gradients; before every step a twin
without VGS is set to the VGS arm's exact state (parameters and optimizer moments) and
takes the same step.  The printed ratio of their parameter changes is what the factor
actually did; ``factor`` is what VGS asked for.  In update mode the ratio equals the factor
by construction; in gradient mode Adam's normalisation and the clip undo it.

    python bench/vgs_effect.py [--steps 60] [--alpha 1.0]
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable

import torch

from gradmon_ray.optim import UPGD
from gradmon_ray.optim.scaled_step import UpdateScaler
from gradmon_ray.vgs import VarianceGradientScaler

SHAPES = [(64, 32), (64,), (8, 64), (8,)]
OPTIMIZERS: dict[str, tuple[Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], float | None]] = {
    # name: (factory, global-norm clip or None)
    "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True), None),
    "adam+clip": (lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True), 0.5),
    "upgd": (lambda ps: UPGD(ps, lr=1e-3, sigma=0.01, generator=torch.Generator().manual_seed(0)), None),
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=1e-2), None),
}


def run(name: str, mode: str, steps: int, alpha: float, warmup: int) -> list[tuple[float, float]]:
    """(factor, ||dtheta_vgs|| / ||dtheta_plain||) per step after the warmup."""
    make, clip = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in SHAPES]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, twin_opt = make(params), make(twin)
    vgs = VarianceGradientScaler(params, warmup_steps=warmup, alpha=alpha, compile="off")
    scaler = UpdateScaler([opt])
    mean = [torch.randn(s, generator=gen) * 0.05 for s in SHAPES]  # a fixed signal ...
    out = []
    for step in range(steps):
        grads = [m + 0.2 * torch.randn(m.shape, generator=gen) for m in mean]  # ... under noise
        twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        with torch.no_grad():
            for t, p in zip(twin, params, strict=True):
                t.copy_(p)
        before = [p.detach().clone() for p in params]
        for ps in (params, twin):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
        factor = vgs.observe(scale_gradients=mode == "gradient")
        vgs.step()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
            torch.nn.utils.clip_grad_norm_(twin, clip)
        if mode == "update":
            with scaler.scaled(factor):
                opt.step()
        else:
            opt.step()
        twin_opt.step()
        moved = sum(float((p.detach() - b).pow(2).sum()) for p, b in zip(params, before, strict=True)) ** 0.5
        moved_twin = sum(float((t.detach() - b).pow(2).sum()) for t, b in zip(twin, before, strict=True)) ** 0.5
        if step >= warmup:
            out.append((float(factor), moved / moved_twin))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    print(f"{args.steps} steps, warmup {args.warmup}, alpha {args.alpha}; per step after the warmup:")
    for name in OPTIMIZERS:
        for mode in ("gradient", "update"):
            rows = run(name, mode, args.steps, args.alpha, args.warmup)
            factors = [f for f, _ in rows]
            ratios = [r for _, r in rows]
            gap = [r / f for f, r in rows]
            print(
                f"effect optimizer={name:9s} mode={mode:8s} factor median {statistics.median(factors):.3f} "
                f"dtheta-ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) "
                f"ratio/factor median {statistics.median(gap):.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
