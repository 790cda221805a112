"""Cost per minibatch of averaging gradients across 2 learners: gradmon's multi-module average
against RLlib's per-module DDP, side by side in the same two processes (CPU, gloo).

RLlib wraps each module of a multi-agent learner in its own ``DistributedDataParallel``: every
module's gradients are all-reduced from inside ``backward``, one bucket (or more) per module,
and a learner whose shard holds no sample of a module never joins that module's all-reduce
(``docs/observe_only.md``).  gradmon leaves the modules unwrapped and, after ``backward``,
averages every module in ONE flat all-reduce (``distributed.gradient_average``), with one small
exchange of which parameters got a gradient per update.  Arms, each a full minibatch (forward
of every module on its own rows, one summed loss, ``backward``, the average):

* ``ddp``: one ``DistributedDataParallel`` per module (RLlib's default bucket size; RLlib's
  ``TorchDDPRLModule`` is a ``DistributedDataParallel``);
* ``gradmon``: ``ModuleGradientAverage.average()`` after ``backward`` (``new_update()`` and so
  one presence exchange every ``--minibatches`` minibatches, as per RLlib update);
* ``local``: ``backward`` with no communication: the floor both arms pay.

Both ranks run the same arms in the same (seeded, random) order; a barrier starts each timed
update, and rank 0 reports.  A repetition takes each arm's median update time over
``--rounds`` rounds; the ratios are paired per round.  Printed: per arm the median ms per
minibatch (min, max over repetitions), and ``ratio gradmon/ddp modules=M median x min y max z``
(and ``gradmon/local``, ``ddp/local``).  Usage:

    python bench/gradient_average.py [--modules 1 2 8] [--minibatches 8] [--rounds 5] [--repeats 3]
        [--hidden 256 256] [--rows 128]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradmon_ray.distributed.gradient_average import ModuleGradientAverage

ARMS = ("ddp", "gradmon", "local")
RATIOS = [("gradmon", "ddp"), ("gradmon", "local"), ("ddp", "local")]
OBS, ACTIONS = 32, 12


def _module(hidden: list[int], seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    width = OBS
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.Tanh()]
        width = h
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, ACTIONS + 1))


class _Arm:
    """One arm's modules (the same initial weights in every arm and rank) and its minibatch step."""

    def __init__(self, name: str, args: argparse.Namespace, modules: int) -> None:
        self.name = name
        nets = [_module(args.hidden, seed=m) for m in range(modules)]
        if name == "ddp":
            self.nets: list[Any] = [torch.nn.parallel.DistributedDataParallel(net) for net in nets]
        else:
            self.nets = nets
        self.params = [p for net in nets for p in net.parameters()]
        self.average = ModuleGradientAverage([list(net.parameters()) for net in nets]) if name == "gradmon" else None

    def update(self, batches: list[list[torch.Tensor]]) -> None:
        """``len(batches)`` minibatches (each: every module's rows); gradients only, no optimizer."""
        if self.average is not None:
            self.average.new_update()
        for rows in batches:
            for p in self.params:
                p.grad = None
            loss = sum(net(x).square().mean() for net, x in zip(self.nets, rows, strict=True))
            loss.backward()  # type: ignore[union-attr]
            if self.average is not None:
                self.average.average()


def _worker(rank: int, args: argparse.Namespace, init_file: str, results: Any) -> None:
    torch.set_num_threads(1)  # two ranks on a 2-core machine: one core each
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for modules in args.modules:
            arms = {name: _Arm(name, args, modules) for name in ARMS}
            gen = torch.Generator().manual_seed(1000 * rank + modules)
            batches = [
                [torch.randn(args.rows, OBS, generator=gen) for _ in range(modules)] for _ in range(args.minibatches)
            ]
            order = random.Random(modules)  # the same order on both ranks
            for arm in arms.values():
                arm.update(batches)  # warm-up: DDP's buckets, the presence pattern
            per_repeat: list[dict[str, float]] = []
            pairs: list[dict[tuple[str, str], float]] = []
            for _ in range(args.repeats):
                times: dict[str, list[float]] = {name: [] for name in ARMS}
                for _ in range(args.rounds):
                    for name in order.sample(list(ARMS), len(ARMS)):
                        dist.barrier()
                        start = time.perf_counter()
                        arms[name].update(batches)
                        times[name].append((time.perf_counter() - start) / args.minibatches)
                per_repeat.append({n: statistics.median(v) for n, v in times.items()})
                paired = {(a, b): [x / y for x, y in zip(times[a], times[b], strict=True)] for a, b in RATIOS}
                pairs.append({pair: statistics.median(values) for pair, values in paired.items()})
            if rank == 0:
                results.append((modules, per_repeat, pairs))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--minibatches", type=int, default=8, help="minibatches per update (one presence exchange)")
    parser.add_argument("--rounds", type=int, default=5, help="updates per arm per repetition")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    parser.add_argument("--rows", type=int, default=128, help="rows per module per minibatch")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.list()
        mp.spawn(_worker, args=(args, os.path.join(tmp, "rendezvous"), results), nprocs=2, join=True)
        params = sum(p.numel() for p in _module(args.hidden, 0).parameters())
        print(
            f"2 learners (processes), gloo on CPU, torch={torch.__version__}, {params / 1e3:.1f}k parameters a module, "
            f"{args.rows} rows a module a minibatch, {args.minibatches} minibatches an update, "
            f"repeats={args.repeats} x rounds={args.rounds}"
        )
        for modules, per_repeat, pairs in results:
            for name in ARMS:
                ms = [r[name] * 1e3 for r in per_repeat]
                print(
                    f"  modules={modules} {name:8s} median {statistics.median(ms):.3f} ms/minibatch "
                    f"(min {min(ms):.3f}, max {max(ms):.3f})"
                )
            for a, b in RATIOS:
                values = [p[(a, b)] for p in pairs]
                print(
                    f"ratio {a}/{b} modules={modules} median {statistics.median(values):.3f} "
                    f"min {min(values):.3f} max {max(values):.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
