"""The per-minibatch gradient path of a gradmon learner: one norm pass for all modules, the step.

After backward (and the cross-learner average: DDP's, or gradmon's own, ``module_sync``), before
any module's clipping (``postprocess_gradients``), ONE ``GradientNormPlan`` measures every
monitored module (per-head norms, global norms, exact NaN/Inf counts); each module then runs
what needs its own slice (VGS, the noise-scale hook). The step (``apply_gradients``) is RLlib's
own, with the non-finite flag handed to fused optimizers as ``found_inf`` (no host read), and
the minibatch's norms of every module are ONE record (``NormRecords``). Nothing here reads the
device from the host, whatever the number of modules (``tests/rllib/test_host_reads.py`` counts
it).

A module without any gradient this minibatch (no rows in it: sparse multi-agent batches; known on
the host, every ``p.grad`` is None) is idle: no ``GradScaler.unscale_``, no VGS (statistics,
warm-up clock, scale), no step preparation, and RLlib does not step its ``GradScaler``; only its
norms (NaN: "missing") go into the record."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from ray.rllib.core.learner.learner import Learner
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import ModuleID, ParamDict

from gradmon_ray import compat
from gradmon_ray.rllib.module_telemetry import FoundInfFlags
from gradmon_ray.telemetry.lane_fold import LaneFold
from gradmon_ray.telemetry.norm_plan import GradientNormPlan, GradientNorms, PackedNorms
from gradmon_ray.telemetry.norm_records import NormRecords
from gradmon_ray.telemetry.param_movement import ParameterMovement


class GradmonGradientPass:
    """Mixin of ``GradmonMonitor``: measure every module at once, then step (needs its ``_monitors``)."""

    def _setup_norm_pass(self) -> None:
        """ONE norm plan and ONE record list for all monitored modules (per minibatch: one pass, one append)."""
        monitors = list(self._monitors.values())
        self._norm_plan = GradientNormPlan.for_modules([(m.groups, m.params) for m in monitors])
        skip = bool(self.config.torch_skip_nan_gradients)
        # Per module, whether a non-finite minibatch counts as skipped here (a GradScaler counts its own).
        skip_mask = torch.tensor([float(skip and m.grad_scaler is None) for m in monitors], device=self.device or "cpu")
        self._norm_records = NormRecords(self._norm_plan.slots, skip_mask)
        self._lane_fold = LaneFold([m.tracker.layout for m in monitors])
        # One copy of the weights a step: how far each head moves (primed again after a restore).
        self._movement = ParameterMovement(self._norm_plan.slots)
        self._movement.prime()
        self._pending_norms: PackedNorms | None = None
        self._idle_modules: set[ModuleID] = set()  # the measured minibatch's monitored modules without any gradient
        self._measured_for_modules = False
        self._postprocessed: set[ModuleID] = set()

    @override(Learner)
    def postprocess_gradients(self, gradients_dict: ParamDict) -> ParamDict:
        if not self._monitors:
            return super().postprocess_gradients(gradients_dict)
        self._pending_norms = self._measure()  # before any module's clipping
        self._measured_for_modules = True
        try:
            return super().postprocess_gradients(gradients_dict)
        finally:
            self._measured_for_modules = False

    @override(Learner)
    def postprocess_gradients_for_module(
        self, *, module_id: ModuleID, config: Any = None, module_gradients_dict: ParamDict
    ) -> ParamDict:
        if module_id in self._monitors and not self._measured_for_modules:
            # Called by an override of postprocess_gradients that skips RLlib's (or directly):
            # measure now, still before this module's clipping, once for all modules (again
            # only when this module comes round a second time without a step in between).
            if self._pending_norms is None or module_id in self._postprocessed:
                self._pending_norms = self._measure()
            self._postprocessed.add(module_id)
        return super().postprocess_gradients_for_module(
            module_id=module_id, config=config, module_gradients_dict=module_gradients_dict
        )

    def _measure(self) -> PackedNorms:
        """Every monitored module's norms in one pass (batched), then each module's own follow-up."""
        self._postprocessed: set[ModuleID] = set()
        # Host-side (RLlib left ``.grad`` None: the module had no rows), never a device read.
        self._idle_modules = {mid for mid, m in self._monitors.items() if all(p.grad is None for p in m.params)}
        for module_id, monitor in self._monitors.items():
            if module_id not in self._idle_modules:  # unscale_ of an optimizer without gradients records no inf check
                monitor.unscale(self._optimizers_of(module_id))
        norms = self._norm_plan.compute_all()
        for module_id, monitor in self._monitors.items():
            if monitor.epoch_sum is not None and self.in_first_epoch(module_id):
                monitor.epoch_sum.add(len(self._norm_records))  # one learner's noise scale: one op
        for index, (module_id, monitor) in enumerate(self._monitors.items()):
            # An idle module's norms are NaN: nothing for VGS (zeros would teach it) or the noise lanes.
            if monitor.needs_own_norms and module_id not in self._idle_modules:
                own = self._module_norms(norms, index) if monitor.noise is not None else None
                monitor.after_norms(norms.flags[index], own)
        return norms

    def _module_norms(self, norms: PackedNorms, index: int) -> GradientNorms:
        """Module ``index``'s norms out of the packed ones (a few kernels: the noise-scale path only)."""
        return GradientNorms(
            self._norm_plan.slots.module_heads(norms.head_norms, index),
            norms.global_norm[index],
            norms.nan_count[index],
            norms.inf_count[index],
        )

    @override(TorchLearner)
    def apply_gradients(self, gradients_dict: ParamDict) -> None:
        if not self._monitors:
            super().apply_gradients(gradients_dict)
            return
        # Measured in postprocess_gradients, unless an override of it skipped RLlib's.
        norms = self._pending_norms if self._pending_norms is not None else self._measure()
        self._pending_norms = None
        self._postprocessed = set()
        skip_nonfinite = bool(self.config.torch_skip_nan_gradients)
        with ExitStack() as stack:
            flags = stack.enter_context(FoundInfFlags())
            dropped: set[int] = set()
            idle_scalers = [mid for mid in self._idle_modules if self._monitors[mid].grad_scaler is not None]
            stack.enter_context(compat.idle_grad_scalers(self, idle_scalers))
            for index, (module_id, monitor) in enumerate(self._monitors.items()):
                if module_id in self._idle_modules:
                    continue  # no gradient: nothing to step, flag or scale
                params = monitor.prepare_step(self._optimizers_of(module_id), skip_nonfinite, flags, norms.flags[index])
                stack.enter_context(monitor.scaled_update())
                for param in params:
                    param.grad = None
                    dropped.add(id(param))
            if dropped:  # RLlib's gradient dicts are keyed by the parameters themselves
                gradients_dict = {ref: g for ref, g in gradients_dict.items() if id(ref) not in dropped}
            super().apply_gradients(gradients_dict)
        if self.gradmon.telemetry:
            self._norm_records.add(norms)  # one record for every module; the skips are derived at the drain
