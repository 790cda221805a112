"""Modules added and removed mid-run (self-play snapshots, leagues): monitored from their first update.

RLlib's ``Algorithm.add_module`` / ``remove_module`` call ``Learner.add_module`` /
``remove_module`` on every learner.  ``ModuleChanges`` (a mixin of ``GradmonMonitor``) then
makes the learner's modules distributed again (``rllib.module_sync``: with 2+ learners the new
module gets its share of the gradient average and rank 0's weights, never RLlib's WORLD-group
DDP) and gives a monitored new module its telemetry (heads, bands, latches, its clock at the
learner's, its state in checkpoints); a removed module's telemetry and state go with it.  The
norm pass is rebuilt for the new set of modules.
"""

from __future__ import annotations

from typing import Any

import torch
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import ModuleID

from gradmon_ray.head_labels import check_name
from gradmon_ray.rllib.module_sync import SparseSafeModuleSync
from gradmon_ray.rllib.module_telemetry import resolve_module


class ModuleChanges:
    """Mixin of ``GradmonMonitor`` (needs its ``_monitors``, ``_wants``, ``_monitor_of``, ``_attach``)."""

    @override(TorchLearner)
    def add_module(self, *, module_id: ModuleID, module_spec: Any, **kwargs: Any) -> Any:
        """RLlib's ``add_module``, then: the module distributed like the others (its own share of
        the gradient average with 2+ learners) and, if monitored, its telemetry from its first
        update on (heads, bands, latches; its clock at the learner's; its state in checkpoints)."""
        if self._wants(module_id):  # before RLlib adds it; RLlib's own check lets "a b" and "a,b" through
            check_name(module_id, "added module id")
        spec = super().add_module(module_id=module_id, module_spec=module_spec, **kwargs)
        self.arrange_gradient_average()
        if self._wants(module_id) and isinstance(self.module[module_id], torch.nn.Module):
            rl_module = self.module[module_id].unwrapped()
            monitor = self._monitor_of(
                resolve_module(module_id, rl_module, self.gradmon, self.latch_heads_of(rl_module))
            )
            monitor.tracker.iteration = self.gradmon_iteration  # every module's clock advances together
            self._monitors[module_id] = monitor
            self._monitors = {mid: self._monitors[mid] for mid in self.module.keys() if mid in self._monitors}  # noqa: SIM118
            self._attach(module_id, monitor)
        self._setup_norm_pass()
        return spec

    @override(TorchLearner)
    def remove_module(self, module_id: ModuleID, **kwargs: Any) -> Any:
        """RLlib's ``remove_module``; the module's telemetry and state go with it."""
        spec = super().remove_module(module_id, **kwargs)
        monitor = self._monitors.pop(module_id, None)
        if monitor is not None:
            monitor.noise_hook.remove()
        self.arrange_gradient_average()
        self._setup_norm_pass()
        return spec

    @override(SparseSafeModuleSync)
    def _local_gradients(self, index: int, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        monitor = self._monitors.get(self._synced_module_ids[index])
        if monitor is not None and monitor.noise is not None:
            monitor.noise_hook.add_local(params, grads)  # the noise scale's local squares, before the average
