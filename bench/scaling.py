"""How telemetry's cost grows with model size and with the number of heads, against memory bandwidth.

For each case, three learners train the same model on the same postprocessed batch of real
episodes, one full update each, in a new random order every round (side by side in one
process; see ``telemetry_overhead.py`` for why not a fixed rotation):

* ``stock``: RLlib's ``PPOTorchLearner``;
* ``gradmon``: ``GradmonPPOTorchLearner``, full telemetry;
* ``gradmon-off``: the same learner with telemetry off (isolates telemetry's own cost).

Cases: the default 8-head env with trunks sized for about 0.1M, 1M and 10M parameters, and
1, 8 and 32 heads (a MultiDiscrete env defined here) at about 1M parameters; then one large
case, about 100M parameters by default (``--large-params``), so that cost growth with model
size is measured, not extrapolated.  The large case runs ``--large-rounds`` rounds per
repetition after one warm-up round, and is skipped with a one-line message when the memory
it needs (3 learners x (parameters + gradients + 2 Adam moments), plus about 3 transient
model copies for sampling and weight copying, float32) exceeds ``MemAvailable`` (CPU, from
``/proc/meminfo``) or the free GPU memory (CUDA).

Rounds: every case runs ``--repeats`` repetitions of ``--rounds`` rounds (after warm-up); each
repetition gives each learner's median update time and the PAIRED ratios gradmon/stock and
gradmon/gradmon-off: per round, one arm's update time over the other's (the two ran within the
same round), and the repetition's ratio is the median over its rounds, so that a slow spell of
the machine hits both sides of a ratio.  The table shows the medians over repetitions, and one
line per ratio gives ``ratio <name> case=<case> median <x> min <y> max <z>``.

Memory bandwidth is measured on the same machine (a sum over a 256 MiB float32 tensor, best of
several; far larger than the last-level cache, so a DRAM figure), and the telemetry's
gradient read (``GradientNormPlan.compute``: per-head norms, global norm, NaN/Inf counts) is
timed alone on the model's gradients and expressed as "passes": its time over the time of
one read of every gradient at that bandwidth.  The plan is timed back to back on the same
gradients, so gradients that fit in the last-level cache (LLC; its size is read from
``/sys/devices/system/cpu/cpu0/cache``, or the GPU's L2) are read from the cache, and for
them "passes" against DRAM bandwidth divides a cache-speed read by a DRAM-speed pass: it
understates the number of passes (flatters the plan).  So each case also says whether its
gradients fit in the LLC (column ``LLC``), and measures the read bandwidth *at the case's own
size* (``bw@size``: a back-to-back sum over a float32 tensor as large as the gradients,
cache-resident when they fit, DRAM when they do not); ``passes@size`` is the plan's time
over one read at that bandwidth, the fair figure for cache-resident cases.  A cache-resident
bandwidth measured below the DRAM one (a busy machine: best-of-many still caught no clean
sample) marks ``passes@size`` with ``*`` and a note line.

    python bench/scaling.py [--rounds 3] [--repeats 3] [--device cpu|cuda] [--large-params 100000000]
    python bench/scaling.py --only-large    # the large case alone
    python bench/scaling.py --quick    # smoke run: 1 round x 3 repetitions, 1 warm-up, no 10M or large case
"""

from __future__ import annotations

import argparse
import copy
import glob
import os
import random
import statistics
import time
import warnings
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.local_learner import build_local_learner, env_spaces, sample_episodes, train_batch, update
from gradmon_ray.telemetry import GradientNormPlan

NHEADS_ENV_ID = "gradmon-bench/NHeads-v0"


class NHeadsEnv(gym.Env):
    """MultiDiscrete([6] * num_heads): reward = fraction of heads matching the observed targets."""

    def __init__(self, config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.num_heads = int({**(config or {}), **kwargs}.get("num_heads", 8))  # gym.make passes kwargs
        self.observation_space = gym.spaces.Box(0.0, 1.0, (6 * self.num_heads,), np.float32)
        self.action_space = gym.spaces.MultiDiscrete([6] * self.num_heads)
        self._t = 0
        self._target = np.zeros(self.num_heads, np.int64)

    def _obs(self) -> np.ndarray:
        obs = np.zeros((self.num_heads, 6), np.float32)
        obs[np.arange(self.num_heads), self._target] = 1.0
        return obs.reshape(-1)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        self._target = self.np_random.integers(0, 6, self.num_heads)
        return self._obs(), {}

    def step(self, action):
        reward = float(np.mean(np.asarray(action) == self._target))
        self._t += 1
        self._target = self.np_random.integers(0, 6, self.num_heads)
        return self._obs(), reward, False, self._t >= 16, {}


def memory_bandwidth_gbs(device: str) -> float:
    """Best-of-N read bandwidth: sum over 256 MiB of float32 (one read of every element)."""
    x = torch.ones(64 * 1024 * 1024, device=device)
    best = float("inf")
    for _ in range(7):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        x.sum()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def last_level_cache_bytes(device: str) -> tuple[int, str]:
    """Size and description of the last-level cache (CPU: highest cache level of cpu0; CUDA: L2)."""
    if device == "cuda":
        size = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0))
        return size, "GPU L2"
    best = (0, 0, "unknown")
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(index, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        units = {"K": 1024, "M": 1024**2, "G": 1024**3}
        size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        best = max(best, (level, size, f"L{level} {kind}"))
    return best[1], best[2]


def bandwidth_at_size_gbs(numel: int, device: str, min_total_s: float = 0.25) -> float:
    """Best-of-N read bandwidth of back-to-back sums over ``numel`` float32 (warm: cache-resident if it fits)."""
    x = torch.ones(max(numel, 1), device=device)
    x.sum()
    best = float("inf")
    spent = 0.0
    samples = 0
    while samples < 7 or (spent < min_total_s and samples < 5000):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        x.sum()
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        best, spent, samples = min(best, elapsed), spent + elapsed, samples + 1
    return x.numel() * 4 / best / 1e9


BYTES_PER_PARAM_RESIDENT = 3 * 4 * 4
"""3 learners x (parameters + gradients + Adam's two moments) x 4 bytes (float32)."""
BYTES_PER_PARAM_TRANSIENT = 3 * 4
"""About 3 more float32 model copies at peak: the sampling EnvRunner's module, the weights
copied between the learners, the module counted while sizing the trunk."""


def memory_needed_bytes(num_params: int) -> int:
    """Estimated peak memory of one case with ``num_params`` parameters (3 learners)."""
    return num_params * (BYTES_PER_PARAM_RESIDENT + BYTES_PER_PARAM_TRANSIENT)


def memory_available_bytes(device: str) -> int | None:
    """``MemAvailable`` (CPU) or the free GPU memory (CUDA); None when it cannot be read."""
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def _num_params(cfg) -> int:
    from gradmon_ray.rllib.config import build_ppo_config

    obs, act = env_spaces(cfg)
    spec = build_ppo_config(cfg).rl_module_spec
    spec.observation_space, spec.action_space = obs, act
    return sum(p.numel() for p in spec.build().parameters())


def trunk_for(target_params: int, env: str | None, num_heads: int | None, device: str) -> int:
    """Two-layer trunk width whose model has about ``target_params`` parameters (counted, not guessed)."""
    lo, hi = 8, 8192
    while hi - lo > 8:
        mid = (lo + hi) // 2
        if _num_params(_case_config(mid, env, num_heads, device)) < target_params:
            lo = mid
        else:
            hi = mid
    return hi


def _case_config(trunk: int, env: str | None, num_heads: int | None, device: str):
    data: dict[str, Any] = {
        "seed": 0,
        "ppo": {"train_batch_size": 1024, "minibatch_size": 256, "num_epochs": 1},
        "model": {"trunk_hiddens": [trunk, trunk]},
    }
    if env is not None:
        data["env"] = {"id": env, "config": {"num_heads": num_heads}}
        data["model"]["head_names"] = [f"h{i}" for i in range(num_heads)]
    if device == "cuda":
        data["resources"] = {"num_gpus_per_learner": 1.0}
    return config_from_dict(data)


def run_case(label: str, cfg, rounds: int, repeats: int, warmup: int, device: str, bandwidth: float) -> dict[str, Any]:
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
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        update(learners[name], batch, cfg)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    names = list(learners)
    order = random.Random(0)
    for _ in range(warmup):
        for name in order.sample(names, len(names)):
            timed(name)
    per_repeat: list[dict[str, float]] = []
    paired: dict[str, list[float]] = {"gradmon/stock": [], "gradmon/gradmon-off": []}
    for _ in range(repeats):
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(rounds):
            for name in order.sample(names, len(names)):  # a fresh random order every round
                times[name].append(timed(name))
        per_repeat.append({n: statistics.median(v) for n, v in times.items()})
        for key in paired:
            a, b = key.split("/")
            paired[key].append(statistics.median(x / y for x, y in zip(times[a], times[b], strict=True)))
    med = {n: statistics.median([p[n] for p in per_repeat]) for n in names}

    # The telemetry's read of the gradients, alone, on the gradients the last update left.
    module = learners["gradmon"].module[DEFAULT_MODULE_ID].unwrapped()
    params = [p for p in module.parameters() if p.requires_grad]
    num_params = sum(p.numel() for p in params)
    plan = GradientNormPlan(module.head_parameter_groups(), params)
    for p in params:
        if p.grad is None:
            p.grad = torch.randn_like(p)
    grads = [p.grad for p in params]

    def median_time(fn) -> float:
        samples = []
        for _ in range(30):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    plan_s = median_time(plan.compute)
    norms_s = median_time(lambda: torch._foreach_norm(grads))  # the norms alone: one read of every gradient
    one_pass_s = num_params * 4 / (bandwidth * 1e9)
    bandwidth_here = bandwidth_at_size_gbs(num_params, device)
    one_pass_here_s = num_params * 4 / (bandwidth_here * 1e9)
    minibatches = learners["gradmon"].last_telemetry.minibatches
    heads = len(learners["gradmon"].head_names) - 1
    return {
        "label": label,
        "params": num_params,
        "heads": heads,
        "stock_ms": med["stock"] * 1e3,
        "gradmon_ms": med["gradmon"] * 1e3,
        "off_ms": med["gradmon-off"] * 1e3,
        "minibatches": minibatches,
        "plan_ms": plan_s * 1e3,
        "passes": plan_s / one_pass_s,
        "norm_passes": norms_s / one_pass_s,
        "grad_bytes": num_params * 4,
        "bandwidth_at_size": bandwidth_here,
        "passes_at_size": plan_s / one_pass_here_s,
        "ratios": paired,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per repetition")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions (>= 3: min and max mean something)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--large-params", type=int, default=None, help="parameters of the large case (default 100M; 0: none)"
    )
    parser.add_argument("--large-rounds", type=int, default=3, help="rounds per repetition of the large case")
    parser.add_argument("--only-large", action="store_true", help="run the large case alone")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 round x 3 repetitions, 1 warm-up, no 10M/large case"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    gym.register(NHEADS_ENV_ID, entry_point=NHeadsEnv)
    rounds = 1 if args.quick else args.rounds
    default_large = 0 if args.quick and not args.only_large else 100_000_000
    large = args.large_params if args.large_params is not None else default_large

    bandwidth = memory_bandwidth_gbs(args.device)
    llc, llc_kind = last_level_cache_bytes(args.device)
    print(
        f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} rounds={rounds} "
        f"repeats={args.repeats}"
    )
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s (sum over 256 MiB float32, best of 7)")
    print(
        f"last-level cache: {llc / 2**20:.0f} MiB ({llc_kind}); gradients that fit are read from the cache: "
        "see 'LLC' and 'passes@size' (bandwidth measured at the gradients' own size)"
    )
    warmup = 1 if args.quick else 2
    sizes = [100_000, 1_000_000] + ([] if args.quick else [10_000_000])
    cases = [(f"size {n / 1e6:g}M", n, None, None, rounds, warmup) for n in sizes]
    cases += [(f"{n} heads 1M", 1_000_000, NHEADS_ENV_ID, n, rounds, warmup) for n in (1, 8, 32)]
    if args.only_large:
        cases = []
    if large:
        cases.append((f"size {large / 1e6:g}M", large, None, None, args.large_rounds, 1))
    print(
        "case            params  heads  stock ms  gradmon ms  off ms  gradmon/stock  gradmon/off  "
        "telemetry ms/mb  norm-plan ms  passes  (norms alone)  grads MiB  LLC  bw@size GB/s  passes@size"
    )
    for label, target, env, heads, case_rounds, case_warmup in cases:
        needed, available = memory_needed_bytes(target), memory_available_bytes(args.device)
        if available is not None and needed > available:
            print(
                f"{label}: skipped: needs about {needed / 1e9:.1f} GB (3 learners x (params + grads + Adam "
                f"moments) + copies), {available / 1e9:.1f} GB available",
                flush=True,
            )
            continue
        trunk = trunk_for(target, env, heads, args.device)
        cfg = _case_config(trunk, env, heads, args.device)
        r = run_case(label, cfg, case_rounds, args.repeats, case_warmup, args.device, bandwidth)
        ratios = {k: statistics.median(v) for k, v in r["ratios"].items()}
        per_mb = (ratios["gradmon/gradmon-off"] - 1.0) * r["off_ms"] / r["minibatches"]  # as telemetry_overhead.py
        fits = "?" if llc == 0 else "yes" if r["grad_bytes"] <= llc else "no"
        # A cache-resident read slower than DRAM is not physical: the machine was busy.
        suspect = "*" if fits == "yes" and r["bandwidth_at_size"] < bandwidth else " "
        print(
            f"{r['label']:14s} {r['params'] / 1e6:6.2f}M {r['heads']:5d} {r['stock_ms']:9.1f} {r['gradmon_ms']:11.1f} "
            f"{r['off_ms']:7.1f} {ratios['gradmon/stock']:14.3f} {ratios['gradmon/gradmon-off']:12.3f} "
            f"{per_mb:16.3f} {r['plan_ms']:13.3f} {r['passes']:7.2f} {r['norm_passes']:14.2f} "
            f"{r['grad_bytes'] / 2**20:10.1f} {fits:>4s} {r['bandwidth_at_size']:13.1f} "
            f"{r['passes_at_size']:11.2f}{suspect}",
            flush=True,
        )
        for name, values in r["ratios"].items():
            print(
                f"ratio {name} case={label.replace(' ', '_')} median {statistics.median(values):.3f} "
                f"min {min(values):.3f} max {max(values):.3f}",
                flush=True,
            )
        if suspect == "*":
            print(
                f"  * {label}: cache-resident read measured below DRAM bandwidth (best of many): other work held "
                "the cores (descheduled intra-op threads); passes@size means nothing here, rerun on a quiet machine",
                flush=True,
            )


if __name__ == "__main__":
    main()
