"""Per-step cost and memory of the VGS, against a faithful copy of the seed's loop.

Same gradients for every variant, one process, rotating order; per-step call sequence is the
seed's ``scale_gradients(); step()`` with warmup 0 (so every step also scales).  Models are
MLP-shaped parameter lists of about 1M and 10M parameters.  Usage:

    python bench/vgs.py [--sizes 1 10] [--steps 20] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from gradmon_ray.telemetry import VarianceGradientScaler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seed_vgs import SeedVarianceGradientScaler

SHAPES = {
    1: [
        (512, 64),
        (512,),
        (512, 512),
        (512,),
        (512, 512),
        (512,),
        (512, 512),
        (512,),
        (512, 512),
        (512,),
        (9, 512),
        (9,),
    ],
    10: [
        (1600, 64),
        (1600,),
        (1600, 1600),
        (1600,),
        (1600, 1600),
        (1600,),
        (1600, 1600),
        (1600,),
        (1600, 1600),
        (1600,),
        (9, 1600),
        (9,),
    ],
}


def _state_bytes(vgs) -> int:
    if isinstance(vgs, SeedVarianceGradientScaler):
        return sum(
            t.numel() * t.element_size() for t in (vgs._param_grad_mean_ema, vgs._param_grad_sq_ema, vgs._param_numel)
        )
    tensors = [vgs._mean_ema, vgs._sq_ema, vgs._param_numel, vgs._spatial_ema]
    if vgs._sample is not None:
        tensors.append(vgs._sample)
    return sum(t.numel() * t.element_size() for t in tensors)


def bench(size: int, steps: int, device: str) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in SHAPES[size]]
    n = sum(p.numel() for p in params)
    grad_sets = [[torch.randn(p.shape, device=device) * (0.1 + i) for p in params] for i in range(4)]
    variants = {
        "seed": SeedVarianceGradientScaler(params, warmup_steps=0),
        "element": VarianceGradientScaler(params, warmup_steps=0, granularity="element"),
        "tensor": VarianceGradientScaler(params, warmup_steps=0, granularity="tensor"),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for step in range(steps + 3):
        order = names[step % 3 :] + names[: step % 3]
        for name in order:
            for p, g in zip(params, grad_sets[step % 4], strict=True):
                p.grad = g.clone()
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            variants[name].scale_gradients()
            variants[name].step()
            if device == "cuda":
                torch.cuda.synchronize()
            if step >= 3:
                times[name].append(time.perf_counter() - start)
    # Context: one fused Adam step on the same parameters (what the learner runs anyway).
    adam = torch.optim.Adam(params, fused=True)
    adam_times = []
    for step in range(steps + 3):
        for p, g in zip(params, grad_sets[step % 4], strict=True):
            p.grad = g.clone()
        start = time.perf_counter()
        adam.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= 3:
            adam_times.append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    adam_med = statistics.median(adam_times)
    print(f"{n / 1e6:.2f}M parameters in {len(params)} tensors, {device}, {steps} steps (median per step):")
    for name in names:
        kib = _state_bytes(variants[name]) / 1024
        print(f"  {name:8s} {med[name] * 1e3:9.2f} ms   persistent state {kib:12.1f} KiB")
    print(f"  (fused Adam step on the same parameters: {adam_med * 1e3:.2f} ms)")
    print(f"  speed-up vs seed: element {med['seed'] / med['element']:.2f}x, tensor {med['seed'] / med['tensor']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 10], choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for size in args.sizes:
        bench(size, args.steps, args.device)


if __name__ == "__main__":
    main()
