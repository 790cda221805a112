"""Per-step cost of the VGS against one fused Adam step and the seed's loop, side by side.

One process, the same parameters and gradients for every arm.  A repetition runs every arm
for ``--steps`` timed steps in rotating order (arm A step, arm B step, ...), so drift on the
machine hits all arms alike, and takes each arm's median step time; a ratio is computed per
repetition, and the printed median/min/max are over ``--repeats`` repetitions.

Arms (warmup 0, so every step also computes and applies a factor):

* ``fused-adam``: ``torch.optim.Adam(fused=True).step()`` on the same parameters (what the
  learner runs anyway; the yardstick);
* ``vgs-element``: ``scale_gradients(); step()`` at ``element`` granularity (gradient mode:
  statistics + factor + scaling, the most work VGS does per step); ``compile="auto"``, which
  compiles from 1M parameters (compile time printed, not timed);
* ``vgs-element-update``: ``observe(scale_gradients=False)``: what update mode costs (the factor
  then rides on the optimizer's learning rate, at no extra cost);
* ``vgs-element-eager``: the same as ``vgs-element`` uncompiled (the fallback);
* ``vgs-tensor``: ``tensor`` granularity, gradient mode;
* ``seed``: a faithful copy of the seed's loop (``seed_vgs.py``).

Prints one line per ratio, ``ratio <arm>/<yardstick> size=<params>M median <x> min <y> max <z>``,
and per arm the ops, kernels (ops that launch one on a GPU) and host reads of one step (counted
once, untimed, with ``telemetry.op_counts.OpCounter``; a compiled arm is not counted: a dispatch
mode makes torch.compile fall back to eager).  Models are MLP-shaped parameter lists of about 0.08M, 1M
and 10M parameters.  Usage:

    python bench/vgs.py [--sizes 0 1 10] [--steps 20] [--repeats 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from gradmon_ray.telemetry.op_counts import OpCounter
from gradmon_ray.vgs import VarianceGradientScaler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seed_vgs import SeedVarianceGradientScaler


def _mlp_shapes(width: int, depth: int = 4, inputs: int = 64, outputs: int = 9) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(width, inputs), (width,)]
    for _ in range(depth):
        shapes += [(width, width), (width,)]
    return [*shapes, (outputs, width), (outputs,)]


SHAPES = {0: _mlp_shapes(128), 1: _mlp_shapes(512), 10: _mlp_shapes(1600)}
"""``--sizes`` key -> parameter shapes: 0 is 0.08M parameters (the default model's order: eager, launch-bound
on a GPU), 1 is 1.09M, 10 is 10.36M (both compiled by ``compile="auto"``)."""
RATIOS = [
    ("vgs-element", "fused-adam"),
    ("vgs-element-update", "fused-adam"),
    ("vgs-element-eager", "fused-adam"),
    ("vgs-tensor", "fused-adam"),
    ("vgs-element", "seed"),
    ("vgs-tensor", "seed"),
]


def _arms(params: list[torch.nn.Parameter]) -> tuple[dict[str, Callable[[], object]], dict[str, object]]:
    """(arm -> one step, arm -> its scaler, for the VGS arms)."""
    scalers = {
        "vgs-element": VarianceGradientScaler(params, warmup_steps=0),
        "vgs-element-update": VarianceGradientScaler(params, warmup_steps=0),
        "vgs-element-eager": VarianceGradientScaler(params, warmup_steps=0, compile="off"),
        "vgs-tensor": VarianceGradientScaler(params, warmup_steps=0, granularity="tensor"),
    }

    def vgs_step(vgs: VarianceGradientScaler, scale: bool) -> Callable[[], object]:
        def run() -> None:
            vgs.observe(scale_gradients=scale)
            vgs.step()

        return run

    seed = SeedVarianceGradientScaler(params, warmup_steps=0)

    def seed_step() -> None:
        seed.scale_gradients()
        seed.step()

    adam = torch.optim.Adam(params, fused=True)
    arms = {
        "fused-adam": adam.step,
        **{name: vgs_step(vgs, name != "vgs-element-update") for name, vgs in scalers.items()},
        "seed": seed_step,
    }
    return arms, scalers


def bench(size: int, steps: int, repeats: int, device: str) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in SHAPES[size]]
    n = sum(p.numel() for p in params)
    grad_sets = [[torch.randn(p.shape, device=device) * (0.1 + i) for p in params] for i in range(4)]
    arms, scalers = _arms(params)

    def set_grads(k: int) -> None:
        for p, g in zip(params, grad_sets[k % 4], strict=True):
            p.grad = g.clone()  # every arm scales in place: a fresh copy each step

    def timed(fn: Callable[[], object]) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for name, fn in arms.items():  # untimed: allocations and (where it applies) the compile
        set_grads(0)
        print(f"  first step of {name}: {timed(fn):.2f} s", flush=True)
    for name, fn in arms.items():  # untimed: what one step dispatches (kernels: what a GPU launches)
        if getattr(scalers.get(name), "compiled", False):  # a dispatch mode would make it run eagerly
            print(f"  {name:20s} compiled: one graph (its kernels are not dispatched ops)")
            continue
        set_grads(1)
        with OpCounter() as counter:
            fn()
        print(
            f"  {name:20s} ops/step {counter.ops:5d} kernels/step {counter.kernels:5d} "
            f"host_reads/step {counter.num_host_reads}"
        )
    per_repeat: list[dict[str, float]] = []
    names = list(arms)
    for _ in range(repeats):
        times: dict[str, list[float]] = {k: [] for k in names}
        for step in range(steps):
            order = names[step % len(names) :] + names[: step % len(names)]
            for name in order:
                set_grads(step)
                times[name].append(timed(arms[name]))
        per_repeat.append({k: statistics.median(v) for k, v in times.items()})
    print(f"{n / 1e6:.2f}M parameters in {len(params)} tensors, {device}, {repeats} x {steps} steps per arm")
    for name in names:
        meds = [r[name] * 1e3 for r in per_repeat]
        print(f"  {name:20s} median {statistics.median(meds):8.3f} ms  (min {min(meds):.3f}, max {max(meds):.3f})")
    for arm, yardstick in RATIOS:
        ratios = [r[arm] / r[yardstick] for r in per_repeat]
        print(
            f"ratio {arm}/{yardstick} size={n / 1e6:.2f}M median {statistics.median(ratios):.3f} "
            f"min {min(ratios):.3f} max {max(ratios):.3f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 10], choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}")
    for size in args.sizes:
        bench(size, args.steps, args.repeats, args.device)


if __name__ == "__main__":
    main()
