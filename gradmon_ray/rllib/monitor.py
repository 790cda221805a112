"""``with_gradmon(learner_cls)``: per-head gradient telemetry for any RLlib ``TorchLearner``.

Every monitored module of the learner's ``MultiRLModule`` (one for single-agent RLlib; all of
them, or ``gradmon.modules``, for multi-agent) gets a ``ModuleTelemetry``.  Per minibatch,
everything stays on the learner's device (nothing syncs with the host):

1. after the loss, references to the action-distribution inputs and the taken actions: the
   per-head log-probs of the step's actions (``heads.per_head_logp``) -> NaN/Inf flags, once
   per step over all its minibatches (a subclass whose loss has them calls ``record_logp``);
2. after backward (and the cross-learner average, ``rllib.module_sync``), before clipping
   (``postprocess_gradients``): per-head norms, global norms, exact NaN/Inf element counts of
   ALL monitored modules in one pass (``GradientNormPlan.for_modules``); VGS scales the
   gradients; then RLlib's own ``postprocess_gradients_for_module`` per module (its clipping,
   unchanged);
3. the step is RLlib's own ``apply_gradients``: with ``torch_skip_nan_gradients=True`` a
   non-finite minibatch is really skipped (fused optimizers read ``found_inf`` on the device,
   as from ``torch.amp.GradScaler``; others cost one host sync); with RLlib's default
   ``False`` RLlib's ``nan_to_num`` and step run untouched;
4. the minibatch's norms of every module are ONE record (``NormRecords``); the log-probs of each
   module are recorded by its loss (``IterationAccumulator``), by reference.

Observe-only: with VGS off, a learner gets bit-for-bit the weights and optimizer state of
``learner_cls`` (``tests/peer/test_observe_only.py``), except that a non-finite minibatch
under ``torch_skip_nan_gradients=True`` is skipped, where RLlib 2.60 still steps
(``tests/peer/test_observe_only_differences.py``), and that with 2+ learners the modules of a
``MultiRLModule`` with several modules are averaged across learners by gradmon, over the
learners that trained each module (``rllib.module_sync``), where RLlib 2.60's DDP can average
one module's gradients with another's and hangs on a module missing from one learner's shard.

One telemetry step = ``report_every`` calls of ``Learner.update`` (default: 1, and for the
IMPALA family ``config.broadcast_interval``, the number of updates between two reductions of
the learner thread's metrics).  Each step, ALL modules' lanes are packed, reduced ONCE across
learners (one SUM allreduce), copied to the host ONCE, and logged as RLlib metrics under each
module's id (``window=1``): ``result["learners"][module_id]``.  Names: ``gradmon_ray.metric_names``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.learner import Learner
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import ModuleID

from gradmon_ray import compat
from gradmon_ray.distributed import LearnerCollective
from gradmon_ray.rllib.diagnosis_hooks import GradmonDiagnosis
from gradmon_ray.rllib.gradient_pass import GradmonGradientPass
from gradmon_ray.rllib.heads import latch_heads
from gradmon_ray.rllib.module_changes import ModuleChanges
from gradmon_ray.rllib.module_sync import SparseSafeModuleSync
from gradmon_ray.rllib.module_telemetry import ModuleTelemetry, resolve_module
from gradmon_ray.rllib.monitor_step import (
    GRADMON_STATE_KEYS,
    NOISE_STATE_KEY,
    PROBE_STATE_KEY,
    TELEMETRY_STATE_KEY,
    VGS_STATE_KEY,
    GradmonReporting,
)
from gradmon_ray.rllib.settings import GradmonSettings
from gradmon_ray.telemetry import IterationTelemetry
from gradmon_ray.vgs import VarianceGradientScaler


def global_rank() -> int:
    """This learner's rank in RLlib's torch.distributed world (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class GradmonMonitor(
    GradmonDiagnosis,
    compat.DistributedModulesHook,
    ModuleChanges,
    SparseSafeModuleSync,
    GradmonGradientPass,
    GradmonReporting,
):
    """The telemetry half of a gradmon learner; ``with_gradmon`` puts it before a ``TorchLearner``."""

    gradmon_full_learner: ClassVar[bool] = False
    """Whether this class implements the settings only ``GradmonPPOTorchLearner`` reads."""

    @override(Learner)
    def build(self) -> None:
        compat.check_ray_version()
        self.gradmon = GradmonSettings.from_learner_config(
            self.config.learner_config_dict, full_learner=type(self).gradmon_full_learner
        )
        self._monitors: dict[ModuleID, ModuleTelemetry] = {}
        # RLlib's build makes the module, then (``configure_optimizers``) the optimizers: the
        # heads are resolved there, so a bad head fails before IMPALA/APPO start their threads.
        super().build()
        self._setup_diagnosis()
        self._collective = self._make_collective()
        self._hook_handles: list[Any] = []
        for module_id, monitor in self._monitors.items():
            self._attach(module_id, monitor)
        self._report_every = self.gradmon.report_every or int(getattr(self.config, "broadcast_interval", 1) or 1)
        self._updates_since_report = 0

    def _attach(self, module_id: ModuleID, monitor: ModuleTelemetry) -> None:
        """What a monitor needs once the modules are distributed: the noise-scale hook, a subclass's tensor hooks."""
        averaged = self.gradient_average is not None
        monitor.setup_noise_scale(self.module[module_id], self.gradmon, self._collective.active, averaged=averaged)
        self._hook_handles += self.head_gradient_hooks(module_id, monitor.groups)

    def head_gradient_hooks(self, module_id: ModuleID, groups: Mapping[str, Sequence[Any]]) -> list[Any]:
        """Tensor hooks a subclass puts on module ``module_id``'s head parts (``groups``: head name ->
        its ``HeadPart``s) once the modules are distributed; return their handles, which ``shutdown``
        removes.  Default: none (the tests' fault injection, ``tests/rllib/fault_injection.py``, uses it)."""
        return []

    @override(Learner)
    def configure_optimizers(self) -> None:
        super().configure_optimizers()
        self._monitors = self._build_monitors()
        self._setup_norm_pass()

    def _build_monitors(self) -> dict[ModuleID, ModuleTelemetry]:
        """One ``ModuleTelemetry`` per monitored module; every head is resolved first (errors name the module)."""
        module_ids = self._torch_module_ids()
        self.gradmon.check_modules(module_ids)
        self._seen_modules = {str(mid) for mid in self.module.keys()}  # noqa: SIM118 (ModuleChanges.warn_unseen_modules)
        self._unseen_warned = False
        wanted = [mid for mid in module_ids if self._wants(mid)]
        specs = []
        for module_id in wanted:
            rl_module = self.module[module_id].unwrapped()
            specs.append(resolve_module(module_id, rl_module, self.gradmon, self.latch_heads_of(rl_module)))
        return {spec.module_id: self._monitor_of(spec) for spec in specs}

    def _torch_module_ids(self) -> list[ModuleID]:
        return [mid for mid in self.module.keys() if isinstance(self.module[mid], torch.nn.Module)]  # noqa: SIM118 (a MultiRLModule iterates otherwise)

    def _wants(self, module_id: ModuleID) -> bool:
        return self.gradmon.monitors(module_id)

    def _monitor_of(self, spec: Any) -> ModuleTelemetry:
        return ModuleTelemetry(
            spec,
            self.module[spec.module_id].unwrapped(),
            device=self.device,
            grad_scaler=compat.grad_scaler(self, spec.module_id),
            vgs=self.gradmon.vgs,
            optimizers=self._optimizers_of(spec.module_id),
        )

    def latch_heads_of(self, rl_module: Any) -> tuple[str, ...]:
        """The log-prob latches (``heads.latch_heads``); a subclass with its own loss may narrow them."""
        return latch_heads(rl_module)

    def _optimizers_of(self, module_id: ModuleID) -> list[torch.optim.Optimizer]:
        return [optimizer for _, optimizer in self.get_optimizers_for_module(module_id)]

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
        backend, timeout_s = self.gradmon.collective_backend, self.gradmon.collective_timeout_s
        return LearnerCollective(name, world_size, rank, backend, torch.device(self.device), timeout_s)

    # --- per minibatch ---------------------------------------------------------------
    @override(Learner)
    def compute_loss_for_module(self, *, module_id: ModuleID, config: Any, batch: dict, fwd_out: dict) -> Any:
        loss = super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)
        monitor = self._monitors.get(module_id)
        if monitor is not None and self.gradmon.telemetry:
            # References only: the latches' log-probs are computed once per step, over all its
            # minibatches (``rllib.module_groups.latch_flag_blocks``), not once per minibatch.  Not
            # detached (an op a minibatch): the drain reads them under ``torch.no_grad``.
            logits = fwd_out[Columns.ACTION_DIST_INPUTS]
            monitor.record_latch_inputs(logits, batch[Columns.ACTIONS], batch.get(Columns.LOSS_MASK))
            self.record_head_inputs(logits, batch, module_id=module_id)
        return loss

    def record_head_inputs(self, logits: torch.Tensor, batch: dict, *, module_id: ModuleID) -> None:
        """Keep references to this minibatch's ``logits``, the sampling policy's logits and the
        loss mask for the step's head health (``rllib.head_health``), and to the minibatch for a
        diagnosis (``rllib.diagnosis``); no kernel (the references live until the drain, which
        reads them under ``torch.no_grad``)."""
        self.keep_minibatch(module_id, batch)
        self._monitors[module_id].record_head_inputs(
            logits, batch.get(Columns.ACTION_DIST_INPUTS), batch.get(Columns.LOSS_MASK)
        )

    def record_logp(self, per_head_logp: torch.Tensor, mask: torch.Tensor | None, *, module_id: ModuleID) -> None:
        """Keep the minibatch's ``[B, latch heads]`` log-probs and loss mask by reference: the
        accumulator checks the whole step's log-probs for NaN/Inf once, at the drain
        (padding rows never latch).  No kernel here."""
        self._monitors[module_id].record_logp(per_head_logp, mask)

    # --- state and lifecycle -----------------------------------------------------------
    @property
    def gradmon_modules(self) -> dict[ModuleID, ModuleTelemetry]:
        """The monitored modules' telemetry, by module id, in the ``MultiRLModule``'s order."""
        return self._monitors

    def _only_monitor(self) -> ModuleTelemetry:
        if len(self._monitors) != 1:
            raise AttributeError(
                f"this learner monitors {len(self._monitors)} modules {list(self._monitors)}: "
                "use gradmon_modules[module_id]"
            )
        return next(iter(self._monitors.values()))

    @property
    def head_names(self) -> tuple[str, ...]:
        """Reported heads (norms), in order, of the one monitored module."""
        return self._only_monitor().head_names

    @property
    def last_telemetry(self) -> IterationTelemetry | None:
        """The last step's telemetry of the one monitored module."""
        return self._only_monitor().last_telemetry

    @property
    def collective(self) -> LearnerCollective:
        """This learner's collective group (``world_size == 1`` without remote learners)."""
        return self._collective

    @property
    def vgs(self) -> VarianceGradientScaler | None:
        """The one monitored module's Variance Gradient Scaler (None when disabled)."""
        return self._only_monitor().vgs

    @override(Learner)
    def shutdown(self) -> None:
        try:
            super().shutdown()  # IMPALA/APPO: stops the learner thread first
        finally:  # what build made, also when build failed half-way
            for handle in getattr(self, "_hook_handles", ()):
                handle.remove()
            self._hook_handles = []
            for monitor in getattr(self, "_monitors", {}).values():
                monitor.noise_hook.remove()
            if getattr(self, "_collective", None) is not None:
                self._collective.destroy()


_CACHE: dict[type, type] = {}


def with_gradmon(learner_cls: type) -> type:
    """A subclass of ``learner_cls`` (any RLlib ``TorchLearner`` subclass) with gradmon's telemetry.

    Heads, per module: the module's ``head_parameter_groups()``, else
    ``learner_config_dict["gradmon"]["per_module"][module_id]["heads"]`` or
    ``learner_config_dict["gradmon"]["heads"]`` (head -> regex over ``named_parameters()``
    names), else the zero-config heads of RLlib's default modules (``rllib.heads``); other
    settings: ``gradmon_ray.rllib.settings.GradmonSettings``.  One telemetry step: see this
    module's docstring.  The same class is returned for the same ``learner_cls``.
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
