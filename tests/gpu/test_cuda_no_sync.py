"""On CUDA, the per-minibatch telemetry path must not synchronise with the host.

``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronising call, so these tests
fail if a ``.item()``, ``.cpu()``, ``bool(tensor)`` or size-dependent indexing sneaks into the
hot path.  Skipped without CUDA (CI has none).
"""

from __future__ import annotations

import pytest
import torch

from gradmon_ray.telemetry import GradientNormPlan, IterationAccumulator, TelemetryTracker, logp_nonfinite_flags

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_norms_flags_accumulate_and_fused_skip_do_not_sync():
    dev = torch.device("cuda")
    heads = {f"h{i}": [torch.nn.Parameter(torch.randn(8, 8, device=dev))] for i in range(3)}
    trunk = torch.nn.Parameter(torch.randn(16, device=dev))
    params = [p for ps in heads.values() for p in ps] + [trunk]
    for p in params:
        p.grad = torch.randn_like(p)
    heads["h1"][0].grad[0, 0] = float("nan")
    plan = GradientNormPlan(heads, params)
    plan.compute()  # first call builds (and caches) the index tensors from host data
    tracker = TelemetryTracker([*heads, "value"][:3], ["h0", "h1"])
    acc = IterationAccumulator(tracker.layout, device=dev)
    opt = torch.optim.Adam(params, fused=True)
    before = [p.detach().clone() for p in params]
    logp = torch.randn(32, 2, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norms = plan.compute()
        nan_flags, inf_flags = logp_nonfinite_flags(logp)
        opt.found_inf = norms.found_nonfinite
        opt.step()
        del opt.found_inf
        acc.add_minibatch(norms, nan_flags, inf_flags, norms.found_nonfinite)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    lanes = acc.drain()[0]
    summary = tracker.finish_iteration(lanes)
    assert summary.skipped == 1 and summary.nan_grad_count == 1
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.detach(), b)  # the fused kernel skipped the NaN step


def test_learner_update_on_cuda_reports_finite_telemetry():
    from gradmon_ray.config import config_from_dict
    from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update

    cfg = config_from_dict(
        {
            "ppo": {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 2},
            "resources": {"num_gpus_per_learner": 1},
        }
    )
    learner = build_local_learner(cfg)
    assert str(learner._device).startswith("cuda")
    update(learner, train_batch(learner, sample_episodes(cfg, learner, 256)), cfg)
    tele = learner.last_telemetry
    assert len(tele.head_norms) == 9 and all(v > 0 for v in tele.head_norms.values())
    assert tele.skipped == 0


@pytest.mark.parametrize("granularity", ["element", "tensor"])
@pytest.mark.parametrize("aggregation", ["p90", "mean", "weighted_mean"])
def test_vgs_update_and_scale_do_not_sync(granularity, aggregation):
    from gradmon_ray.vgs import VarianceGradientScaler

    dev = torch.device("cuda")
    params = [torch.nn.Parameter(torch.randn(64, 64, device=dev)), torch.nn.Parameter(torch.randn(64, device=dev))]
    vgs = VarianceGradientScaler(
        params, warmup_steps=0, granularity=granularity, aggregation_method=aggregation, quantile_sample_size=512
    )
    for p in params:
        p.grad = torch.randn_like(p)
    vgs.scale_gradients()  # first call allocates work buffers
    skip = torch.zeros((), device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            vgs.update_statistics(skip)
            vgs.scale_gradients(skip)
            vgs.step()
            vgs.metrics_tensor()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert 0.0 < vgs.get_scaling_factor() <= 1.0


# --- The whole learner update, attributed -------------------------------------------------------
# RLlib's own update loop synchronises a few times per minibatch (its metrics logger, the stock
# PPO loss's bookkeeping), which gradmon cannot change, so "error" mode cannot run a full update.
# Instead "warn" mode reports every synchronising call, each is attributed to the innermost
# gradmon_ray or ray frame on the Python stack, and gradmon's own share is checked: none inside
# a per-minibatch hook, and what remains is a fixed number per iteration.

_PER_MINIBATCH_HOOKS = frozenset(
    {"compute_loss_for_module", "postprocess_gradients", "postprocess_gradients_for_module", "apply_gradients"}
)


def _record_syncs(fn) -> list[tuple[str, str, bool]]:
    """(owner, 'file:line function', inside a per-minibatch hook) for each synchronising call."""
    import traceback
    import warnings

    syncs: list[tuple[str, str, bool]] = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        owner, site = "other", f"{filename}:{lineno}"
        for frame in reversed(stack):
            if "/gradmon_ray/" in frame.filename or "/tests/gpu/" in frame.filename:
                owner, site = "gradmon", f"{frame.filename.split('/')[-1]}:{frame.lineno} {frame.name}"
                break
            if "/ray/" in frame.filename:
                owner, site = "ray", f"{frame.filename.split('/ray/')[-1]}:{frame.lineno} {frame.name}"
                break
        in_hook = any(f.name in _PER_MINIBATCH_HOOKS and "/gradmon_ray/" in f.filename for f in stack)
        syncs.append((owner, site, in_hook))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return syncs


def _deliberate_sync() -> None:
    torch.ones(1, device="cuda").item()


def test_the_sync_recorder_sees_a_planted_item_call():
    syncs = _record_syncs(_deliberate_sync)
    assert [(owner, "_deliberate_sync" in site) for owner, site, _ in syncs] == [("gradmon", True)]


def _warm_cuda_learner(minibatch_size: int, *, vgs: bool, scaler: bool, modules: int = 1):
    """A CUDA learner, a real batch and its config, after one warm-up update (which builds the
    cached index tensors).  ``scaler``: RLlib's mixed-precision hook with a real CUDA GradScaler;
    ``modules`` > 1: the multi-agent FactoredOps, one module per agent."""
    import functools

    from gradmon_ray.config import config_from_dict
    from gradmon_ray.rllib.local_learner import local_ppo_config, module_spaces, sample_episodes, train_batch, update

    env = {"id": "gradmon/FactoredOpsMultiAgent-v0", "config": {"num_agents": modules}} if modules > 1 else {}
    cfg = config_from_dict(
        {
            "ppo": {"train_batch_size": 512, "minibatch_size": minibatch_size, "num_epochs": 2},
            "resources": {"num_gpus_per_learner": 1},
            "vgs": {"enabled": vgs, "warmup_steps": 0},
            **({"env": env} if env else {}),
        }
    )
    config = local_ppo_config(cfg)
    if scaler:
        config = config.experimental(
            _torch_grad_scaler_class=functools.partial(torch.amp.GradScaler, "cuda", init_scale=1024.0)
        )
    learner = config.build_learner(spaces=module_spaces(cfg))
    batch = train_batch(learner, sample_episodes(cfg, learner, 512))
    update(learner, batch, cfg)
    return learner, batch, cfg


@pytest.mark.parametrize("features", ["telemetry", "telemetry+vgs", "telemetry+vgs+scaler"])
def test_gradmon_adds_no_host_sync_per_minibatch_to_a_learner_update(features):
    from collections import Counter

    from gradmon_ray.rllib.local_learner import update

    def gradmon_syncs(minibatch_size: int) -> tuple[Counter, int]:
        learner, batch, cfg = _warm_cuda_learner(minibatch_size, vgs="vgs" in features, scaler="scaler" in features)
        syncs = _record_syncs(lambda: update(learner, batch, cfg))
        minibatches = learner.last_telemetry.minibatches
        in_hooks = [s for s in syncs if s[0] == "gradmon" and s[2]]
        assert not in_hooks, f"gradmon synchronises inside a per-minibatch hook: {in_hooks}"
        sites = Counter(site for owner, site, _ in syncs if owner == "gradmon")
        others = sum(1 for owner, _, _ in syncs if owner != "gradmon")
        print(
            f"\n[{features}] {minibatches} minibatches: gradmon syncs {sum(sites.values())} {dict(sites)}; "
            f"RLlib/other syncs {others}"
        )
        return sites, minibatches

    few_sites, few_mb = gradmon_syncs(256)
    many_sites, many_mb = gradmon_syncs(64)
    assert many_mb >= 3 * few_mb  # (RLlib pads episodes, so not exactly 4x)
    assert many_sites == few_sites  # per-iteration syncs only: 3x+ the minibatches, the same sites and count
    assert sum(many_sites.values()) <= 4


def test_cuda_and_cpu_learners_report_the_same_norms_for_the_same_step():
    """The accelerator path (device-side counts) and the CPU path agree on one real update."""
    import copy

    from ray.rllib.core import DEFAULT_MODULE_ID

    from gradmon_ray import metric_names as mn
    from gradmon_ray.config import config_from_dict
    from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch

    data = {"seed": 3, "ppo": {"train_batch_size": 256, "minibatch_size": 256, "num_epochs": 1}}
    cpu = build_local_learner(config_from_dict(data))
    gpu = build_local_learner(config_from_dict({**data, "resources": {"num_gpus_per_learner": 1}}))
    gpu.module[DEFAULT_MODULE_ID].set_state(cpu.module[DEFAULT_MODULE_ID].get_state())
    episodes = sample_episodes(config_from_dict(data), cpu, 256)

    def logged(learner) -> dict[str, float]:
        batch = train_batch(learner, copy.deepcopy(episodes))
        results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        return {k: float(v.peek()) for k, v in results[DEFAULT_MODULE_ID].items() if "/" in k}

    on_cpu, on_gpu = logged(cpu), logged(gpu)
    for head in cpu.head_names:
        name = mn.head_metric(mn.HEAD_GRAD_NORM, head)
        assert on_gpu[name] == pytest.approx(on_cpu[name], rel=1e-3), head
    assert on_gpu[mn.GLOBAL_GRAD_NORM] == pytest.approx(on_cpu[mn.GLOBAL_GRAD_NORM], rel=1e-3)
    assert on_gpu[mn.NAN_GRAD_COUNT] == on_cpu[mn.NAN_GRAD_COUNT] == 0.0


@pytest.mark.parametrize(
    ("scaler", "modules", "vgs"),
    [(False, 1, True), (True, 1, True), (False, 2, False), (False, 2, True), (False, 8, False), (False, 8, True)],
    ids=["fp32", "grad-scaler", "2-modules", "2-modules-vgs", "8-modules", "8-modules-vgs"],
)
def test_gradient_hooks_of_a_real_update_run_under_sync_debug_error(scaler, modules, vgs, monkeypatch):
    """gradmon's per-minibatch gradient hooks, wrapped in ``"error"`` mode inside a real update,
    with 1, 2 and 8 modules (one norm pass for all of them), VGS on and off.

    ``postprocess_gradients`` (unscale, the norm pass of every module, noise lanes, VGS, RLlib's
    clipping) and ``apply_gradients`` (fused skip-on-NaN step, the record) run in ``"error"``
    mode (the loss, where RLlib's metrics logger runs too, is covered by the "warn" test above), so any
    synchronising call of gradmon's raises and fails the update.  The one exception is RLlib's own
    ``TorchLearner.apply_gradients``, which gradmon calls through ``super()`` (observe-only): with a
    GradScaler it syncs by itself in stock RLlib too (``scaler.step`` reads ``found_inf`` on the
    host, ``scaler.get_scale()`` is a float), so with the scaler it runs in ``"default"`` mode.
    """
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner

    from gradmon_ray.rllib.local_learner import update

    rllib_apply = TorchLearner.apply_gradients

    def rllib_own_code(self, gradients_dict):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return rllib_apply(self, gradients_dict)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    if scaler:  # in fp32 RLlib's step path (torch_skip_nan_gradients) stays under "error" too
        monkeypatch.setattr(TorchLearner, "apply_gradients", rllib_own_code)
    learner, batch, cfg = _warm_cuda_learner(64, vgs=vgs, scaler=scaler, modules=modules)
    calls = {"postprocess_gradients": 0, "apply_gradients": 0}

    def strict(name: str):
        hook = getattr(learner, name)

        def wrapped(*args, **kwargs):
            calls[name] += 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                return hook(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        setattr(learner, name, wrapped)

    for name in calls:
        strict(name)
    update(learner, batch, cfg)
    telemetry = [m.last_telemetry for m in learner.gradmon_modules.values()]
    minibatches = telemetry[0].minibatches
    assert minibatches >= 12 // modules
    assert calls == {"postprocess_gradients": minibatches, "apply_gradients": minibatches}
    assert all(t.skipped == 0 and t.minibatches == minibatches for t in telemetry)


def test_norms_and_counts_on_cuda_are_exact_and_do_not_sync():
    """The seven-op norm pass on CUDA: exact counts, per-head norms as the reference formula, no sync."""
    from gradmon_ray.telemetry import per_head_grad_norms

    dev = torch.device("cuda")
    heads = {f"h{i}": [torch.nn.Parameter(torch.randn(64, 32, device=dev))] for i in range(3)}
    trunk = torch.nn.Parameter(torch.randn(4096, device=dev))
    params = [p for ps in heads.values() for p in ps] + [trunk]
    for p in params:
        p.grad = torch.randn_like(p)
    plan = GradientNormPlan(heads, params)
    plan.compute()  # builds and caches the pattern's buffers and index
    trunk.grad[7] = float("nan")
    trunk.grad[9] = float("inf")
    heads["h2"][0].grad[1, 1] = float("-inf")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norms = plan.compute()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (norms.nan_count.item(), norms.inf_count.item()) == (1, 2)
    torch.testing.assert_close(norms.head_norms[:2], per_head_grad_norms(heads)[:2])
    assert torch.isinf(norms.head_norms[2]) and torch.isnan(norms.global_norm)
