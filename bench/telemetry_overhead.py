"""Update-time overhead of gradmon's telemetry, measured side by side in one process.

Up to six learners (``--arms``; by default all six, the A/A twin included) train the same
FactoredActorCritic (same initial weights) on the same postprocessed batch of real FactoredOps episodes, one full
training-iteration update each (``num_epochs`` x minibatches), in a new random order every
round, so that drift on the machine and the previous arm's memory traffic hit all of them alike:

* ``stock``: RLlib's ``PPOTorchLearner`` as shipped (foreach Adam; with gradmon's
  ``torch_skip_nan_gradients=True``, which every arm shares, RLlib runs no finiteness check);
* ``stock-fused``: the same with fused Adam, as a competent user would configure it
  (``configure_optimizers_for_module`` overridden: ``torch.optim.Adam(params, fused=True)``);
* ``gradmon``: ``GradmonPPOTorchLearner`` with full telemetry (fused Adam, its default);
* ``off``: the same learner with telemetry disabled (``telemetry.enabled: false``): isolates
  telemetry's own cost;
* ``dropin``: ``with_gradmon(FusedAdamPPOTorchLearner)``, the drop-in a user of their own RLlib
  learner writes: ``stock-fused`` with gradmon's telemetry attached, built from the same run
  config, its ``learner_config_dict["gradmon"]`` stripped of the keys only the full learner reads
  (``settings_parsing.drop_in_settings``: optimizer, regularizers, probe, the opt-ins ...; the drop-in keeps
  its learner's loss and optimizer);
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
optimizer.  ``dropin/stock-fused`` isolates what ``with_gradmon`` costs a stock learner: the
two arms differ only in gradmon's telemetry attached through ``with_gradmon`` (same learner
class underneath, same loss, same fused Adam, same weights, same batch).  Usage:

    python bench/telemetry_overhead.py [--rounds 25] [--repeats 5] [--trunk 128 128] [--device cpu|cuda] \\
        [--agents N] [--arms stock-fused dropin gradmon ...] [--no-twin] [--no-counts] [--counts-only]

``--agents N`` trains the multi-agent variant (``gradmon/FactoredOpsMultiAgent-v0``, one module per
agent: N modules in every arm, all of them monitored in ``gradmon`` and ``dropin``); its lines
read ``ratio gradmon/off agents=N median ...`` (``ratio dropin/stock-fused agents=N median ...``).

Besides its time, every arm's ops, kernels and host reads per minibatch are printed, one line
per arm::

    arm gradmon update_ms 133.13 ops/minibatch 502 kernels/minibatch 281 host_reads/minibatch 1 \\
        update_ops/minibatch 555.29 update_host_reads/minibatch 1.82

then, per arm that wraps stock RLlib, ``added dropin/stock-fused ops/minibatch 10
update_ops/minibatch 14.09``: the ops it adds inside the minibatches and over the whole update
(the once-per-update drain spread over the minibatches).  These lines come after the ratio lines,
so a run cut short by a time cap still printed its ratios.

``update_ms`` is the arm's median update time (as in the per-arm time lines above it);
``ops/minibatch`` counts every aten op dispatched inside ``Learner._update`` (one call per
minibatch: forward, loss, backward, telemetry, optimizer step), ``kernels/minibatch`` the ones
that launch a kernel on a GPU (not views, detaches or allocations: ``OpCounter.kernels``) and
``host_reads/minibatch`` the ones that read device data on the host or copy pageable host data to
the device (``.item()``, ``bool(t)``, ``data[bool_mask]``, ``.cpu()``, ``.tolist()``,
``torch.tensor(..., device=)``: a sync on a GPU, free on a CPU; ``telemetry.op_counts``).  They are counted
with ``telemetry.op_counts.OpCounter`` once per arm, outside the timed rounds (counting slows
every op down, so it never runs inside them): on the last repetition's learners after their
timed rounds, one extra ``update`` under ``counting_calls(learner, "_update", counter)``, divided
by ``counter.calls`` (the minibatches of that update).  ``--counts-only`` builds the arms, warms
each up with one update (which builds cached index tensors), prints the count lines (without
``update_ms``) and exits without timing: fast, for docs and CI smoke (single-agent: seconds;
``--agents 8`` spends minutes sampling the episodes, as the timed runs do).

On a CPU every ``.item()`` counts as a host read, also of a tensor that lives on the host on a
GPU too: ``stock``'s foreach Adam reads each parameter's step counter (one per parameter tensor
and minibatch, on top of ``stock-fused``'s), which on a GPU is no sync.  Fused Adam keeps its
steps on the device: ``stock-fused``, ``dropin`` and ``gradmon`` compare like with like.

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
from gradmon_ray.rllib import with_gradmon
from gradmon_ray.rllib.local_learner import (
    build_local_learner,
    local_ppo_config,
    module_spaces,
    sample_episodes,
    train_batch,
    update,
)
from gradmon_ray.rllib.settings_parsing import drop_in_settings
from gradmon_ray.telemetry.op_counts import OpCounter, counting_calls

RATIOS = [("gradmon", "off"), ("gradmon", "stock"), ("gradmon", "stock-fused"), ("dropin", "stock-fused")]


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


def build_drop_in(cfg: GradmonConfig) -> Any:
    """``with_gradmon(FusedAdamPPOTorchLearner)`` from the run config, its gradmon settings stripped
    of the keys only ``GradmonPPOTorchLearner`` reads (as ``tests/rllib/test_host_reads.py``)."""
    config = local_ppo_config(cfg, with_gradmon(FusedAdamPPOTorchLearner))
    settings = drop_in_settings(config.learner_config_dict["gradmon"])
    return config.learners(learner_config_dict={"gradmon": settings}).build_learner(spaces=module_spaces(cfg))


ARMS = ("stock", "stock-fused", "gradmon", "off", "dropin", "gradmon-twin")


def build_arms(cfg: GradmonConfig, arms: list[str], order: random.Random) -> dict[str, Any]:
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
        "dropin": lambda: build_drop_in(cfg),
        "gradmon-twin": lambda: build_local_learner(cfg),
    }
    built = {name: builders[name]() for name in order.sample(arms, len(arms))}
    learners = {name: built[name] for name in ARMS if name in built}  # report in the usual order
    weights = learners["gradmon"].module.get_state()  # every module (one, or one per agent)
    for learner in learners.values():
        learner.module.set_state(weights)
    return learners


def count_per_minibatch(learner: Any, batch: Any, cfg: GradmonConfig) -> dict[str, float]:
    """Ops, kernels and host reads per minibatch of one ``update`` of ``learner`` on ``batch``:
    inside ``Learner._update`` (one call per minibatch), and of the whole ``update`` divided by
    its minibatches (``update_ops``: what the once-per-update work adds, spread over them).  Not
    for the timed rounds: the counting mode slows every op down."""
    counter = OpCounter()
    with counting_calls(learner, "_update", counter), OpCounter() as whole:
        update(learner, batch, cfg)
    return {
        "ops": counter.ops / counter.calls,
        "update_ops": whole.ops / counter.calls,
        "kernels": counter.kernels / counter.calls,
        "host_reads": counter.num_host_reads / counter.calls,
        "update_host_reads": whole.num_host_reads / counter.calls,
    }


def _num(x: float) -> str:
    return f"{x:.0f}" if x == int(x) else f"{x:.2f}"


def print_counts(counts: dict[str, dict[str, float]], update_ms: dict[str, float] | None = None) -> None:
    """One ``arm NAME [update_ms T] ops/minibatch X kernels/minibatch Y host_reads/minibatch Z
    update_ops/minibatch U update_host_reads/minibatch R`` line per arm, then for the arms that
    wrap stock RLlib the ops they add a minibatch (``added NAME/stock-fused ...``)."""
    for name, c in counts.items():
        time_field = f" update_ms {update_ms[name]:.2f}" if update_ms is not None and name in update_ms else ""
        print(
            f"arm {name}{time_field} ops/minibatch {_num(c['ops'])} kernels/minibatch {_num(c['kernels'])} "
            f"host_reads/minibatch {_num(c['host_reads'])} update_ops/minibatch {_num(c['update_ops'])} "
            f"update_host_reads/minibatch {_num(c['update_host_reads'])}",
            flush=True,
        )
    base = counts.get("stock-fused")
    for name in ("dropin", "gradmon"):
        if base is not None and name in counts:
            c = counts[name]
            print(
                f"added {name}/stock-fused ops/minibatch {_num(c['ops'] - base['ops'])} "
                f"update_ops/minibatch {_num(c['update_ops'] - base['update_ops'])}",
                flush=True,
            )


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25, help="rounds (one update per learner) per repetition")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--trunk", type=int, nargs="+", default=None, help="trunk widths (default: the config's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--agents", type=int, default=0, help="multi-agent variant with this many modules (0: off)")
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=ARMS,
        default=list(ARMS),
        help="the arms to run (gradmon always runs; a ratio needs both of its arms)",
    )
    parser.add_argument(
        "--no-twin", dest="twin", action="store_false", help="leave out the A/A arm (a second, identical gradmon)"
    )
    parser.add_argument(
        "--no-counts", dest="counts", action="store_false", help="time only: no op counts after the ratios"
    )
    parser.add_argument(
        "--keep-learners",
        dest="fresh",
        action="store_false",
        help="build the learners once, not afresh for every repetition",
    )
    parser.add_argument(
        "--counts-only",
        action="store_true",
        help="build the arms, print their ops/kernels/host reads per minibatch and exit without timing",
    )
    return parser.parse_args()


def _count_all(learners: dict[str, Any], batch: Any, cfg: GradmonConfig) -> dict[str, dict[str, float]]:
    """Every arm's counts but the twin's (gradmon again)."""
    return {name: count_per_minibatch(lrn, batch, cfg) for name, lrn in learners.items() if name != "gradmon-twin"}


def _time_arms(
    args: argparse.Namespace, cfg: GradmonConfig, arms: list[str], learners: dict[str, Any], batch: Any, order: Any
) -> tuple[dict[str, Any], list[dict[str, float]], list[dict[tuple[str, str], float]], list[tuple[str, str]]]:
    """(the last repetition's learners, per repetition each arm's median update time, per repetition
    each ratio's median over its rounds, the ratios)."""

    def timed(name: str) -> float:
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        update(learners[name], batch, cfg)  # RLlib's update ends with a host-side metrics reduce
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    names = list(learners)
    ratios = [(a, b) for a, b in [*RATIOS, ("gradmon", "gradmon-twin")] if a in learners and b in learners]
    per_repeat: list[dict[str, float]] = []
    pair_ratios: list[dict[tuple[str, str], float]] = []
    for repeat in range(args.repeats):
        if args.fresh and repeat > 0:
            # New learner objects each repetition: where their tensors land in memory (cache
            # sets, alignment) is drawn anew, so a lucky or unlucky placement of one arm's
            # buffers cannot bias every repetition of a run the same way.
            for learner in learners.values():
                learner.shutdown()
            learners = build_arms(cfg, arms, order)
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
        paired = {(a, b): [x / y for x, y in zip(times[a], times[b], strict=True)] for a, b in ratios}
        pair_ratios.append({pair: statistics.median(values) for pair, values in paired.items()})
    return learners, per_repeat, pair_ratios, ratios


def _print_times(
    args: argparse.Namespace,
    cfg: GradmonConfig,
    learners: dict[str, Any],
    per_repeat: list[dict[str, float]],
    pair_ratios: list[dict[tuple[str, str], float]],
    ratios: list[tuple[str, str]],
    label: str,
) -> None:
    """The header, each arm's update time, telemetry's own time and the ratio lines."""
    modules = learners["gradmon"].gradmon_modules
    minibatches = next(iter(modules.values())).last_telemetry.minibatches
    params = sum(p.numel() for mid in modules for p in learners["gradmon"].module[mid].parameters())
    print(
        f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} modules={len(modules)} "
        f"params={params / 1e6:.3f}M trunk={cfg.model.trunk_hiddens} minibatches/update={minibatches} "
        f"repeats={args.repeats} x rounds={args.rounds} fresh_learners_per_repeat={args.fresh}"
    )
    for n in learners:
        meds = [r[n] * 1e3 for r in per_repeat]
        print(
            f"  {n:12s} median update {statistics.median(meds):8.2f} ms (min {min(meds):.2f}, max {max(meds):.2f}); "
            f"{statistics.median(meds) / minibatches:.3f} ms/minibatch"
        )
    if "off" in learners:
        extra = statistics.median(
            [
                (r[("gradmon", "off")] - 1.0) * p["off"] / minibatches * 1e3
                for r, p in zip(pair_ratios, per_repeat, strict=True)
            ]
        )
        print(
            f"  telemetry's own time per minibatch: {extra:.3f} ms (paired ratio x off's update; median of repetitions)"
        )
    for a, b in ratios:
        values = [r[(a, b)] for r in pair_ratios]
        print(
            f"ratio {a}/{b}{label} median {statistics.median(values):.3f} min {min(values):.3f} max {max(values):.3f}",
            flush=True,
        )
    if "gradmon-twin" in learners:
        print(
            "  (gradmon/gradmon-twin is an A/A comparison of two identical learners: its distance "
            "from 1.000 is this run's noise floor)",
            flush=True,
        )


def main() -> None:
    args = _parse_args()
    warnings.filterwarnings("ignore")
    cfg = GradmonConfig()  # the default model and batch sizes
    if args.trunk:
        cfg.model.trunk_hiddens = list(args.trunk)
    if args.device == "cuda":
        cfg.resources.num_gpus_per_learner = 1.0
    if args.agents:
        cfg.env.id = "gradmon/FactoredOpsMultiAgent-v0"
        cfg.env.config = {"num_agents": args.agents}
    arms = [a for a in ARMS if (a in args.arms or a == "gradmon") and (args.twin or a != "gradmon-twin")]
    order = random.Random(0)
    learners = build_arms(cfg, arms, order)
    batch = train_batch(learners["gradmon"], sample_episodes(cfg, learners["gradmon"], cfg.ppo.train_batch_size))
    label = f" agents={args.agents}" if args.agents else ""

    if args.counts_only:
        for learner in learners.values():
            update(learner, batch, cfg)  # the first update builds cached index tensors: count the second
        modules = learners["gradmon"].gradmon_modules
        print(
            f"device={args.device} torch={torch.__version__} modules={len(modules)}{label} "
            f"trunk={cfg.model.trunk_hiddens} minibatches/update="
            f"{next(iter(modules.values())).last_telemetry.minibatches} counts only (no timing)"
        )
        print_counts(_count_all(learners, batch, cfg))
        for learner in learners.values():
            learner.shutdown()
        return

    learners, per_repeat, pair_ratios, ratios = _time_arms(args, cfg, arms, learners, batch, order)
    _print_times(args, cfg, learners, per_repeat, pair_ratios, ratios, label)
    if args.counts:
        # After the ratios (a run cut short by a cap still printed them), on the last
        # repetition's warmed-up learners: the extra update each runs under the counting mode
        # cannot perturb a timing.
        print_counts(
            _count_all(learners, batch, cfg), {n: statistics.median(r[n] for r in per_repeat) * 1e3 for n in learners}
        )


if __name__ == "__main__":
    main()
