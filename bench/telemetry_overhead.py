"""Update-time overhead of gradmon's telemetry, measured side by side in one process.

Four learners (five with the A/A twin) train the same FactoredActorCritic (same initial
weights) on the same postprocessed batch of real FactoredOps episodes, one full
training-iteration update each (``num_epochs`` x minibatches), in a new random order every
round, so that drift on the machine and the previous arm's memory traffic hit all of them alike:

* ``stock``: RLlib's ``PPOTorchLearner`` as shipped (foreach Adam; with gradmon's
  ``torch_skip_nan_gradients=True``, which every arm shares, RLlib runs no finiteness check);
* ``stock-fused``: the same with fused Adam, as a competent user would configure it
  (``configure_optimizers_for_module`` overridden: ``torch.optim.Adam(params, fused=True)``);
* ``gradmon``: ``GradmonPPOTorchLearner`` with full telemetry (fused Adam, its default);
* ``off``: the same learner with telemetry disabled (``telemetry.enabled: false``): isolates
  telemetry's own cost;
* ``gradmon-twin``: a second ``gradmon``, identical: ``gradmon/gradmon-twin`` is an A/A
  comparison whose distance from 1 is the run's noise floor (``--no-twin`` leaves it out).

The learners are built afresh for every repetition, in a random order (``--keep-learners``
builds them once): where one learner's tensors land in memory can make it a few percent faster
or slower than an identical twin for the life of the object, which no amount of rotation
averages out, and a fixed build order would land them alike in every repetition.

A repetition times ``--rounds`` rounds of one update per learner.  A ratio is paired: per
round, one arm's update time over the other's (the two ran within the same round, under a
second apart), and the repetition's ratio is the median over its rounds: this machine has slow
spells of a few seconds (updates 30-60% slower) that a per-arm median does not cancel.  The
printed median / min / max are over ``--repeats`` repetitions; the per-arm update times are
printed too (medians over rounds, then over repetitions).

``gradmon/off`` is the telemetry's own cost; ``gradmon/stock-fused`` is the fair comparison
with stock RLlib (the two differ in the telemetry, gradmon's loss code path and where the
skip-on-NaN decision is made, not in the optimizer); ``gradmon/stock`` mixes in the
optimizer.  Usage:

    python bench/telemetry_overhead.py [--rounds 25] [--repeats 5] [--trunk 128 128] [--device cpu|cuda] [--agents N]

``--agents N`` trains the multi-agent variant (``gradmon/FactoredOpsMultiAgent-v0``, one module per
agent: N modules in every arm, all of them monitored in ``gradmon``); its lines read
``ratio gradmon/off agents=N median ...``.

``--trunk 400 400 400 400`` is 0.99M parameters (policy and value trunks), ``--trunk 1290 1290 1290 1290``
10.08M.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings
from typing import Any

import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

from gradmon_ray.config import GradmonConfig
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update

RATIOS = [("gradmon", "off"), ("gradmon", "stock"), ("gradmon", "stock-fused")]


class FusedAdamPPOTorchLearner(PPOTorchLearner):
    """Stock PPO with fused Adam: the baseline a user who cares about speed would run."""

    def configure_optimizers_for_module(self, module_id, config=None) -> None:
        params = self.get_parameters(self._module[module_id])
        self.register_optimizer(
            module_id=module_id,
            optimizer=torch.optim.Adam(params, fused=True),
            params=params,
            lr_or_lr_schedule=config.lr,
        )


def build_arms(cfg: GradmonConfig, twin: bool, order: random.Random) -> dict[str, Any]:
    """The arms, freshly built in a random order, all starting from the same weights.

    The build order is drawn anew each time: the allocator places each learner's parameters
    and optimizer state by the allocations before it, and a fixed order would give every
    repetition the same placement, a bias of a percent or more either way (seen as the same
    model code running that much faster in one learner than in its identical twin).
    """
    off = cfg.model_copy(deep=True)
    off.telemetry.enabled = False
    builders = {
        "stock": lambda: build_local_learner(cfg, learner_class=PPOTorchLearner),
        "stock-fused": lambda: build_local_learner(cfg, learner_class=FusedAdamPPOTorchLearner),
        "gradmon": lambda: build_local_learner(cfg),
        "off": lambda: build_local_learner(off),
    }
    if twin:
        builders["gradmon-twin"] = lambda: build_local_learner(cfg)
    built = {name: builders[name]() for name in order.sample(list(builders), len(builders))}
    learners = {name: built[name] for name in builders}  # report in the usual order
    weights = learners["gradmon"].module.get_state()  # every module (one, or one per agent)
    for learner in learners.values():
        learner.module.set_state(weights)
    return learners


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25, help="rounds (one update per learner) per repetition")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--trunk", type=int, nargs="+", default=None, help="trunk widths (default: the config's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--agents", type=int, default=0, help="multi-agent variant with this many modules (0: off)")
    parser.add_argument(
        "--no-twin", dest="twin", action="store_false", help="leave out the A/A arm (a second, identical gradmon)"
    )
    parser.add_argument(
        "--keep-learners",
        dest="fresh",
        action="store_false",
        help="build the learners once, not afresh for every repetition",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    cfg = GradmonConfig()  # the default model and batch sizes
    if args.trunk:
        cfg.model.trunk_hiddens = list(args.trunk)
    if args.device == "cuda":
        cfg.resources.num_gpus_per_learner = 1.0
    if args.agents:
        cfg.env.id = "gradmon/FactoredOpsMultiAgent-v0"
        cfg.env.config = {"num_agents": args.agents}
    order = random.Random(0)
    learners = build_arms(cfg, args.twin, order)
    batch = train_batch(learners["gradmon"], sample_episodes(cfg, learners["gradmon"], cfg.ppo.train_batch_size))

    def timed(name: str) -> float:
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        update(learners[name], batch, cfg)  # RLlib's update ends with a host-side metrics reduce
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    names = list(learners)
    ratios = RATIOS + ([("gradmon", "gradmon-twin")] if args.twin else [])
    per_repeat: list[dict[str, float]] = []
    pair_ratios: list[dict[tuple[str, str], float]] = []
    for repeat in range(args.repeats):
        if args.fresh and repeat > 0:
            # New learner objects each repetition: where their tensors land in memory (cache
            # sets, alignment) is drawn anew, so a lucky or unlucky placement of one arm's
            # buffers cannot bias every repetition of a run the same way.
            for learner in learners.values():
                learner.shutdown()
            learners = build_arms(cfg, args.twin, order)
        for _ in range(args.warmup):
            for name in names:
                timed(name)
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.rounds):
            # A fresh random order every round: a fixed cyclic order (rotation) keeps each
            # arm's predecessor, whose memory traffic it inherits, the same all run long.
            for name in order.sample(names, len(names)):
                times[name].append(timed(name))
        per_repeat.append({n: statistics.median(v) for n, v in times.items()})
        # Paired: each round's two updates ran within one round of each other (well under a
        # second), so a slow spell of the machine hits both; the median over rounds drops the
        # rounds a spell cut in half.
        pair_ratios.append(
            {(a, b): statistics.median(x / y for x, y in zip(times[a], times[b], strict=True)) for a, b in ratios}
        )

    modules = learners["gradmon"].gradmon_modules
    minibatches = next(iter(modules.values())).last_telemetry.minibatches
    params = sum(p.numel() for mid in modules for p in learners["gradmon"].module[mid].parameters())
    label = f" agents={args.agents}" if args.agents else ""
    print(
        f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} modules={len(modules)} "
        f"params={params / 1e6:.3f}M trunk={cfg.model.trunk_hiddens} minibatches/update={minibatches} "
        f"repeats={args.repeats} x rounds={args.rounds} fresh_learners_per_repeat={args.fresh}"
    )
    for n in names:
        meds = [r[n] * 1e3 for r in per_repeat]
        print(
            f"  {n:12s} median update {statistics.median(meds):8.2f} ms (min {min(meds):.2f}, max {max(meds):.2f}); "
            f"{statistics.median(meds) / minibatches:.3f} ms/minibatch"
        )
    extra = statistics.median(
        [
            (r[("gradmon", "off")] - 1.0) * p["off"] / minibatches * 1e3
            for r, p in zip(pair_ratios, per_repeat, strict=True)
        ]
    )
    print(f"  telemetry's own time per minibatch: {extra:.3f} ms (paired ratio x off's update; median of repetitions)")
    for a, b in ratios:
        values = [r[(a, b)] for r in pair_ratios]
        print(
            f"ratio {a}/{b}{label} median {statistics.median(values):.3f} min {min(values):.3f} max {max(values):.3f}",
            flush=True,
        )
    if args.twin:
        print(
            "  (gradmon/gradmon-twin is an A/A comparison of two identical learners: its distance "
            "from 1.000 is this run's noise floor)"
        )


if __name__ == "__main__":
    main()
