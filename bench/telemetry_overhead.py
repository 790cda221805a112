"""Update-time overhead of gradmon's telemetry, measured side by side in one process.

Three learners train the same FactoredActorCritic on the same postprocessed batch of real
FactoredOps episodes, one full training-iteration update each (``num_epochs`` x minibatches),
in rotating order so that drift on the machine hits all of them alike:

* ``stock``: RLlib's ``PPOTorchLearner`` (foreach Adam, its per-tensor isfinite checks);
* ``gradmon``: ``GradmonPPOTorchLearner`` with full telemetry;
* ``gradmon-off``: the same learner with telemetry disabled (isolates telemetry's own cost).

Prints the median update time of each and the ratios.  Usage:

    python bench/telemetry_overhead.py [--rounds 30] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID

from gradmon_ray.config import GradmonConfig
from gradmon_ray.rllib.standalone import build_local_learner, sample_episodes, train_batch, update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    cfg = GradmonConfig()  # the default model and batch sizes
    if args.device == "cuda":
        cfg.resources.num_gpus_per_learner = 1.0
    off = copy.deepcopy(cfg)
    off.telemetry.enabled = False
    learners = {
        "stock": build_local_learner(cfg, learner_class=PPOTorchLearner),
        "gradmon": build_local_learner(cfg),
        "gradmon-off": build_local_learner(off),
    }
    weights = learners["gradmon"].module[DEFAULT_MODULE_ID].get_state()
    for learner in learners.values():
        learner.module[DEFAULT_MODULE_ID].set_state(weights)
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
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.warmup + args.rounds):
        order = names[r % 3 :] + names[: r % 3]
        for name in order:
            t = timed(name)
            if r >= args.warmup:
                times[name].append(t)

    med = {n: statistics.median(v) for n, v in times.items()}
    minibatches = learners["gradmon"].last_telemetry.minibatches
    print(
        f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"rounds={args.rounds} minibatches/update={minibatches} model=trunk{cfg.model.trunk_hiddens}"
    )
    for n in names:
        print(f"  {n:12s} median update {med[n] * 1000:8.2f} ms   ({med[n] / minibatches * 1e3:.3f} ms/minibatch)")
    print(f"ratio gradmon/stock       = {med['gradmon'] / med['stock']:.3f}")
    print(f"ratio gradmon/gradmon-off = {med['gradmon'] / med['gradmon-off']:.3f}  (telemetry's own cost)")
    print(f"ratio gradmon-off/stock   = {med['gradmon-off'] / med['stock']:.3f}")


if __name__ == "__main__":
    main()
