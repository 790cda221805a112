"""``with_gradmon(learner_cls)``: per-head gradient telemetry for any RLlib ``TorchLearner``.

Per minibatch, everything stays on the learner's device (nothing syncs with the host):

1. after the loss, the per-head log-probs of the taken actions -> NaN/Inf flags
   (``heads.per_head_logp``; a subclass with its own loss calls ``record_logp``);
2. after backward (and DDP's all-reduce), before clipping: per-head norms, the global norm,
   exact NaN/Inf element counts (``GradientNormPlan``); VGS scales the gradients; global-norm
   clipping reuses that norm;
3. the step (``rllib.optimizer_step``): with ``torch_skip_nan_gradients=True`` a non-finite
   minibatch is skipped (fused optimizers read ``found_inf`` on the device, as from
   ``torch.amp.GradScaler``; others cost one host sync); with RLlib's default ``False`` the
   gradients go through ``nan_to_num`` and the step is taken, exactly as stock RLlib does; a
   ``GradScaler`` skips on overflow;
4. everything is added into one packed buffer (``IterationAccumulator``).

One telemetry step = ``report_every`` calls of ``Learner.update`` (default: 1, and for the
IMPALA family ``config.broadcast_interval``, the number of updates between two reductions of
the learner thread's metrics).  PPO calls ``update`` once per training iteration; APPO and
IMPALA call it once per train batch, asynchronously, so there a step is one metrics
reduction of the learner thread.  Each step: the buffer is packed with the noise-scale and
checksum lanes, reduced ONCE across learners (one SUM allreduce), copied to the host ONCE,
and logged as RLlib metrics (``window=1``: every value is already that step's aggregate, and
``result["learners"][module_id]`` shows the latest step).  Names: ``gradmon_ray.metric_names``.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.learner import Learner
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import ModuleID, ParamDict

from gradmon_ray.distributed import (
    LearnerCollective,
    NoiseScaleHook,
)
from gradmon_ray.optim.scaled_step import UpdateScaler
from gradmon_ray.rllib import compat
from gradmon_ray.rllib.head_health import HeadHealthRecorder, head_sizes
from gradmon_ray.rllib.heads import action_heads, head_parameter_groups, latch_heads, per_head_logp
from gradmon_ray.rllib.metrics_stats import use_gradmon_metrics_logger
from gradmon_ray.rllib.optimizer_step import MinibatchStep
from gradmon_ray.rllib.reporting import (
    GRADMON_STATE_KEYS,
    NOISE_STATE_KEY,
    PROBE_STATE_KEY,
    TELEMETRY_STATE_KEY,
    VGS_STATE_KEY,
    GradmonReporting,
)
from gradmon_ray.rllib.settings import GradmonSettings
from gradmon_ray.telemetry import (
    GradientNormPlan,
    GradientNorms,
    IterationAccumulator,
    IterationTelemetry,
    NoiseScaleTracker,
    TelemetryTracker,
    VarianceGradientScaler,
)
from gradmon_ray.telemetry.noise_scale import GLOBAL_ENTRY


def global_rank() -> int:
    """This learner's rank in RLlib's torch.distributed world (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class GradmonMonitor(GradmonReporting):
    """The telemetry half of a gradmon learner; ``with_gradmon`` puts it before a ``TorchLearner``."""

    last_telemetry: IterationTelemetry | None = None

    @override(Learner)
    def build(self) -> None:
        compat.check_ray_version()
        self.gradmon = GradmonSettings.from_learner_config(self.config.learner_config_dict)
        # Before RLlib's build hands the logger to anything (IMPALA/APPO threads): a cheaper
        # reduce() walk for gradmon's ~90 metrics, same results (rllib.metrics_stats).
        use_gradmon_metrics_logger(self.metrics)
        if compat.lr_scheduler_classes(self.config):
            raise ValueError(
                f"{type(self).__name__} does not support _torch_lr_scheduler_classes; "
                "use lr schedules via config.training(lr=[[t0, lr0], ...]) instead"
            )
        super().build()
        module_ids = list(self.module.keys())
        if len(module_ids) != 1:
            raise ValueError(f"{type(self).__name__} monitors exactly one RLModule, got {module_ids}")
        self._module_id: ModuleID = module_ids[0]
        rl_module = self.module[self._module_id].unwrapped()
        groups = head_parameter_groups(rl_module, self.gradmon.heads)
        # Mixed precision: RLlib scales the loss; gradients are unscaled right after backward.
        self._grad_scaler = compat.grad_scaler(self, self._module_id)
        self._minibatch_step = MinibatchStep(self._grad_scaler, self.device)
        self._norm_plan = GradientNormPlan(groups, [p for p in rl_module.parameters() if p.requires_grad])
        latches = self.latch_heads_of(rl_module)
        sizes = head_sizes(rl_module, latches)
        self._tracker = TelemetryTracker(
            list(groups), action_heads(groups), bands=self.gradmon.bands, latch_heads=latches, head_sizes=sizes
        )
        self._head_health = HeadHealthRecorder(sizes, self.device)
        self._accumulator = IterationAccumulator(self._tracker.layout, device=self.device)
        self._pending_norms: GradientNorms | None = None
        # This minibatch's [rows, latch heads] log-probs and loss mask (references).
        self._pending_logp: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._no_logp = torch.zeros(1, len(self._tracker.latch_heads), device=self.device)
        self._collective = self._make_collective()
        self._setup_noise_scale(groups)
        self._report_every = self.gradmon.report_every or int(getattr(self.config, "broadcast_interval", 1) or 1)
        self._updates_since_report = 0
        self._hook_handles = self.gradmon.fault_injection.install_grad_hooks(
            groups, global_rank(), lambda: self._tracker.iteration + 1
        )
        self._vgs: VarianceGradientScaler | None = None
        self._update_scaler: UpdateScaler | None = None
        self._vgs_factor: torch.Tensor | None = None  # update mode: this minibatch's factor
        if self.gradmon.vgs.enabled:
            # One scale for the whole module, from gradients DDP has already averaged: every
            # replica sees identical inputs and so applies an identical scale.
            self._vgs = VarianceGradientScaler(self._norm_plan.params, **self.gradmon.vgs.kwargs)
            if self.gradmon.vgs.apply_to == "update":
                optimizers = [opt for _, opt in self.get_optimizers_for_module(self._module_id)]
                self._update_scaler = UpdateScaler(optimizers)

    def latch_heads_of(self, rl_module: Any) -> tuple[str, ...]:
        """The log-prob latches (``heads.latch_heads``); a subclass with its own loss may narrow them."""
        return latch_heads(rl_module)

    def _make_collective(self) -> LearnerCollective:
        import torch.distributed as dist

        reduce = self.gradmon.reduce_telemetry
        if reduce and self.config.num_learners > 1 and dist.is_available() and dist.is_initialized():
            world_size, rank = dist.get_world_size(), dist.get_rank()
        else:
            world_size, rank = 1, 0
        # Every learner must use the same name: build_ppo_config puts a run-unique one in the
        # config; a hand-made config falls back to the DDP world's rendezvous address.
        name = self.gradmon.collective_group or "gradmon-{}-{}".format(
            os.environ.get("MASTER_ADDR", "local"), os.environ.get("MASTER_PORT", "0")
        )
        return LearnerCollective(name, world_size, rank, self.gradmon.collective_backend, torch.device(self.device))

    def _setup_noise_scale(self, groups: dict[str, list[Any]]) -> None:
        """Per-head gradient noise scale (2+ learners): a DDP comm hook adds each bucket's LOCAL
        squared norms into device lanes, then hands the bucket to DDP's own all-reduce."""
        self._noise: NoiseScaleTracker | None = None
        self._noise_hook = NoiseScaleHook(groups, self.device, scale=self._loss_scale)  # lanes always reduced
        active = self.gradmon.noise_scale and self._collective.active
        if active and self._noise_hook.register(self.module[self._module_id]):
            self._noise = NoiseScaleTracker([*groups, GLOBAL_ENTRY], beta=self.gradmon.noise_ema_beta)

    def _loss_scale(self) -> torch.Tensor | None:
        return compat.scale_tensor(self._grad_scaler) if self._grad_scaler is not None else None

    # --- per minibatch ---------------------------------------------------------------
    @override(Learner)
    def compute_loss_for_module(self, *, module_id: ModuleID, config: Any, batch: dict, fwd_out: dict) -> Any:
        loss = super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)
        if self.gradmon.telemetry:
            module = self.module[module_id].unwrapped()
            logits = fwd_out[Columns.ACTION_DIST_INPUTS].detach()
            logp = per_head_logp(module, logits, batch[Columns.ACTIONS], len(self._tracker.latch_heads))
            self.record_logp(logp, batch.get(Columns.LOSS_MASK))
            self.record_head_inputs(logits, batch)
        return loss

    def record_head_inputs(self, logits: torch.Tensor, batch: dict) -> None:
        """Keep references to this minibatch's ``logits``, the sampling policy's logits and the
        loss mask for the step's head health (``rllib.head_health``); no kernel.  Pass ``logits``
        detached: the reference lives until the next minibatch or the drain."""
        self._head_health.record(logits, batch.get(Columns.ACTION_DIST_INPUTS), batch.get(Columns.LOSS_MASK))

    def record_logp(self, per_head_logp: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Keep the minibatch's ``[B, latch heads]`` log-probs and loss mask by reference: the
        accumulator checks the whole iteration's log-probs for NaN/Inf once, at the drain
        (padding rows never latch).  No kernel here; the ``detach`` lets the minibatch's graph
        be freed with the minibatch, not all at once at the drain."""
        self._pending_logp = (per_head_logp.detach(), mask)

    @override(Learner)
    def postprocess_gradients_for_module(
        self, *, module_id: ModuleID, config: Any = None, module_gradients_dict: ParamDict
    ) -> ParamDict:
        optimizers = self.get_optimizers_for_module(module_id)
        if self._grad_scaler is not None:
            for _, optimizer in optimizers:
                self._grad_scaler.unscale_(optimizer)  # in place; records found_inf (no host sync)
        # After backward (and DDP's all-reduce), before clipping.
        norms = self._pending_norms = self._norm_plan.compute()
        if self._noise is not None:
            rows = self._pending_logp[0].shape[0] if self._pending_logp is not None else 0  # host-side shape
            self._noise_hook.add_big(norms.head_norms, norms.global_norm, rows)
        global_norm = norms.global_norm
        if self._vgs is not None:
            # After the telemetry norms (they stay pre-scaling); a skipped (non-finite) step
            # must not teach VGS either.  Gradient mode scales before clipping (a binding
            # global-norm clip then undoes it); update mode scales the optimizer's step.
            if self._update_scaler is None:
                global_norm = global_norm * self._vgs.scale_gradients(skip=norms.found_nonfinite)
            else:
                self._vgs_factor = self._vgs.observe(skip=norms.found_nonfinite, scale_gradients=False)
            self._vgs.step()
        if config.grad_clip is None or config.grad_clip_by != "global_norm" or len(optimizers) != 1:
            # RLlib's own path (its clipping and its `log_gradients` metric).
            return super().postprocess_gradients_for_module(
                module_id=module_id, config=config, module_gradients_dict=module_gradients_dict
            )
        # RLlib's global-norm clipping formula, reusing the norm above instead of a second pass.
        grads = [g for g in module_gradients_dict.values() if g is not None]
        compat.scale_in_place(grads, config.grad_clip / torch.clamp(global_norm + 1e-6, min=config.grad_clip))
        if config.log_gradients:  # RLlib's key and window
            self.metrics.log_value((module_id, f"gradients_{optimizers[0][0]}_global_norm"), global_norm, window=1)
        return dict(module_gradients_dict)

    @override(TorchLearner)
    def apply_gradients(self, gradients_dict: ParamDict) -> None:
        for ref, grad in gradients_dict.items():
            compat.parameter_of(self, ref).grad = grad
        norms = self._pending_norms if self._pending_norms is not None else self._norm_plan.compute()
        found = norms.found_nonfinite
        skip_nonfinite = bool(self.config.torch_skip_nan_gradients)
        optimizers = [opt for _, opt in self.get_optimizers_for_module(self._module_id)]
        with self._scaled_update():
            skipped = self._minibatch_step.take(optimizers, gradients_dict, found, skip_nonfinite)
        if self.gradmon.telemetry:
            logp, mask = self._pending_logp if self._pending_logp is not None else (self._no_logp, None)
            self._accumulator.add_minibatch_logp(norms, logp, skipped, mask)
        self._pending_norms = None
        self._pending_logp = None

    def _scaled_update(self) -> AbstractContextManager[None]:
        """VGS in update mode: the optimizers' steps move by factor x their update."""
        if self._update_scaler is None or self._vgs_factor is None:
            return nullcontext()
        factor, self._vgs_factor = self._vgs_factor, None
        return self._update_scaler.scaled(factor)

    # --- state and lifecycle -----------------------------------------------------------
    @property
    def head_names(self) -> tuple[str, ...]:
        """Reported heads (norms), in order."""
        return self._tracker.reported_heads

    @property
    def collective(self) -> LearnerCollective:
        """This learner's collective group (``world_size == 1`` without remote learners)."""
        return self._collective

    @property
    def vgs(self) -> VarianceGradientScaler | None:
        """The learner's Variance Gradient Scaler (None when disabled)."""
        return self._vgs

    @override(Learner)
    def shutdown(self) -> None:
        try:
            super().shutdown()  # IMPALA/APPO: stops the learner thread first
        finally:  # what build made, also when build failed half-way
            for handle in getattr(self, "_hook_handles", ()):
                handle.remove()
            self._hook_handles = []
            if getattr(self, "_noise_hook", None) is not None:
                self._noise_hook.remove()
            if getattr(self, "_collective", None) is not None:
                self._collective.destroy()


_CACHE: dict[type, type] = {}


def with_gradmon(learner_cls: type) -> type:
    """A subclass of ``learner_cls`` (any RLlib ``TorchLearner`` subclass) with gradmon's telemetry.

    Heads: the module's ``head_parameter_groups()``, else
    ``learner_config_dict["gradmon"]["heads"]`` (head -> regex over ``named_parameters()``
    names); other settings: ``gradmon_ray.rllib.settings.GradmonSettings``.  Log-prob latches:
    see ``gradmon_ray.rllib.heads``; one telemetry step: see this module's docstring.
    The same class is returned for the same ``learner_cls``.
    """
    if not (isinstance(learner_cls, type) and issubclass(learner_cls, TorchLearner)):
        raise TypeError(f"with_gradmon needs an RLlib TorchLearner subclass, got {learner_cls!r}")
    if issubclass(learner_cls, GradmonMonitor):
        return learner_cls
    if learner_cls not in _CACHE:
        name = f"Gradmon{learner_cls.__name__}"
        _CACHE[learner_cls] = type(
            name, (GradmonMonitor, learner_cls), {"__doc__": with_gradmon.__doc__, "__module__": __name__}
        )
    return _CACHE[learner_cls]


__all__ = [
    "GRADMON_STATE_KEYS",
    "NOISE_STATE_KEY",
    "PROBE_STATE_KEY",
    "TELEMETRY_STATE_KEY",
    "VGS_STATE_KEY",
    "GradmonMonitor",
    "global_rank",
    "with_gradmon",
]
