"""With 2+ learners, a ``MultiRLModule``'s modules are averaged across learners by gradmon, not DDP.

RLlib 2.60 wraps every module in ``TorchDDPRLModule`` on the default (WORLD) process group.
Two things then go wrong in multi-agent training (``docs/observe_only.md``):

- each module's DDP reducer launches its all-reduces in the order its backward hooks fire,
  which differs between learners, so module A's gradients on one learner can be summed with
  module B's on another (silently, when their shapes match);
- a learner whose shard holds no sample of a module never runs that module's backward, so it
  never joins the module's all-reduce: the other learners wait forever.

``SparseSafeModuleSync`` (with ``compat.DistributedModulesHook`` before it, which calls its
``after_modules_distributed`` and ``update_context``) takes over from DDP for a learner with several torch modules (from
its build, or from the ``add_module`` that gives it a second one): the modules stay RLlib's
``TorchDDPRLModule`` (whose constructor gives every replica rank 0's weights), every update runs
with DDP's communication off (``no_sync()``, as RLlib's own IMPALA learner does for multi-agent),
and after ``backward`` every module's gradients are averaged in ONE all-reduce over the
learners that trained the module this update (``distributed.gradient_average``).  A learner
with one module keeps RLlib's DDP as it is; so does a config that sets its own
``torch_ddp_kwargs["process_group"]``.

With mixed precision (``_torch_grad_scaler_class``) the average is of scaled gradients, as DDP's
is, so every learner's ``GradScaler`` of a module must hold the same scale: they all start when
the average is arranged (``_start_grad_scalers``), not at the module's first loss on each
learner, and then see the same averaged gradient, so they skip and back off together.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from ray.rllib.core.learner.learner import Learner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import ModuleID, ParamDict

from gradmon_ray import compat
from gradmon_ray.distributed.gradient_average import ModuleGradientAverage


class SparseSafeModuleSync:
    """Mixin of ``GradmonMonitor`` (before the RLlib learner in the MRO); see the module docstring."""

    _gradient_average: ModuleGradientAverage | None = None
    _partially_trained: set[ModuleID] | None = None

    @property
    def gradient_average(self) -> ModuleGradientAverage | None:
        """The cross-learner gradient average of this learner's modules (None: RLlib's DDP, or one learner)."""
        return self._gradient_average

    def after_modules_distributed(self) -> None:
        """RLlib has wrapped the modules in DDP at the end of the build: ``arrange_gradient_average``."""
        self.arrange_gradient_average()

    def update_context(self) -> AbstractContextManager[Any]:
        """While gradmon averages the modules' gradients, DDP's communication is off during every
        update: ``no_sync()`` on every DDP-wrapped module, RLlib's own IMPALA multi-agent recipe
        (the average runs after ``backward``, in ``compute_gradients``)."""
        if self._gradient_average is None:
            return nullcontext()
        stack = ExitStack()
        module = self.module  # type: ignore[attr-defined]
        for mid in module.keys():  # noqa: SIM118 (a MultiRLModule iterates otherwise)
            if isinstance(module[mid], torch.nn.parallel.DistributedDataParallel):
                stack.enter_context(module[mid].no_sync())
        return stack

    def arrange_gradient_average(self) -> None:
        """Average the modules' gradients here (DDP's communication off) when this learner has
        2+ learners and several torch modules, or already averages (a module was removed).

        Runs after RLlib's DDP wrapping at the end of the build (``after_modules_distributed``)
        and again after every ``add_module``/``remove_module``, the same on every learner (RLlib
        calls those on all); DDP's constructor already gave every replica rank 0's weights."""
        from ray.rllib.core.rl_module.multi_rl_module import MultiRLModule
        from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule

        module = self.module  # type: ignore[attr-defined]
        config = self.config  # type: ignore[attr-defined]
        torch_ids = [mid for mid in module.keys() if isinstance(module[mid].unwrapped(), TorchRLModule)]  # noqa: SIM118
        several = isinstance(module, MultiRLModule) and len(torch_ids) > 1
        own_group = "process_group" in (config.torch_ddp_kwargs or {})
        if config.num_learners <= 1 or own_group or not (several or self._gradient_average is not None):
            return
        for mid in torch_ids:
            if isinstance(module[mid], torch.nn.parallel.DistributedDataParallel):
                # DDP broadcasts its buffers at its first forward (later ones run under no_sync and
                # skip it): on a module only some learners train, that broadcast would meet another
                # collective on the others.  Its constructor has synced the buffers already.
                module[mid].require_forward_param_sync = False
        self._gradient_average = ModuleGradientAverage(
            [[p for p in module[mid].unwrapped().parameters() if p.requires_grad] for mid in torch_ids],
            names=torch_ids,
            timeout_s=self.gradmon.collective_timeout_s,  # type: ignore[attr-defined]
            follows=self._gradient_average,  # a learner this change missed still meets an exchange of its size
        )
        self._synced_module_ids = torch_ids
        self._start_grad_scalers()

    def _start_grad_scalers(self) -> None:
        """Mixed precision (``_torch_grad_scaler_class``): every averaged module's ``GradScaler``
        starts now, on every learner at once, so that all learners' scalers of a module hold ONE
        scale.  RLlib's start lazily, at the module's first loss on that learner: a learner with
        none of the module's samples would hold no scale (``unscale_``/``step`` of the gradient
        it is handed raise) or, starting later than the others, another scale (the average would
        sum gradients scaled by 2^16 with ones scaled by 2^15).  Started together, they stay
        together: every learner unscales the same averaged gradient by the same scale, so all
        find the same overflow, skip the same steps and back off or grow alike."""
        average = self._gradient_average
        if average is None:
            return
        for mid, params in zip(self._synced_module_ids, average.modules, strict=True):
            scaler = compat.grad_scaler(self, mid)
            if scaler is not None and params:
                scaler.scale(torch.zeros((), device=params[0].device))  # starts it; no-op once started

    @override(Learner)
    def compute_gradients(self, loss_per_module: dict[ModuleID, Any], **kwargs: Any) -> ParamDict:
        grads = super().compute_gradients(loss_per_module, **kwargs)  # type: ignore[misc]
        average = self._gradient_average
        if average is None:
            return grads
        # Also with no loss here (RLlib then returns {}): the other learners wait for this one.
        filled = average.average(self._local_gradients)
        if filled:
            grads = {**grads, **{self.get_param_ref(p): p.grad for p in filled}}  # type: ignore[attr-defined]
        return grads

    def _local_gradients(self, index: int, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Module ``index``'s local gradients just before the average (default: nothing)."""

    @property
    def partially_trained(self) -> set[ModuleID]:
        """Modules that some but not all learners trained in an update since the last telemetry
        step (the reporting clears it): their gradient noise scale is undefined for the step."""
        if self._partially_trained is None:
            self._partially_trained = set()
        return self._partially_trained

    @override(Learner)
    def after_gradient_based_update(self, *, timesteps: dict[str, Any]) -> None:
        average = self._gradient_average
        if average is not None and average.presence is not None:  # before the step's report (super)
            world = torch.distributed.get_world_size(average.group)
            for module_id, count in zip(self._synced_module_ids, average.presence.module_counts, strict=True):
                if 0 < count < world:
                    self.partially_trained.add(module_id)
        super().after_gradient_based_update(timesteps=timesteps)  # type: ignore[misc]
        if average is not None:
            average.new_update()  # which learners train which module may change
