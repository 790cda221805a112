"""One monitored RLModule's telemetry inside a gradmon learner: its heads, buffers and state.

A learner holds one ``ModuleTelemetry`` per monitored module (one for a single-agent
``RLModule``, one per module of a ``MultiRLModule``).  Each has its own heads, bands, latches,
collapse, entropy/KL, noise scale, VGS and checkpointed state; the learner packs all of
them into ONE reduction and ONE host copy per telemetry step (``rllib.reporting``).

Per minibatch, nothing here syncs with the host on an accelerator: ``record_latch_inputs``
(or ``record_logp``) and ``record_head_inputs`` keep references.  The norms of every monitored module come from ONE
``GradientNormPlan`` of the learner (``GradmonMonitor``); a module sees its own slice only
where it needs one (``after_norms``: VGS, the noise-scale hook).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from gradmon_ray import compat
from gradmon_ray.distributed import NoiseScaleHook
from gradmon_ray.optim.scaled_step import UpdateScaler
from gradmon_ray.rllib.head_health import HeadHealthRecorder, head_sizes
from gradmon_ray.rllib.heads import action_heads, declared_value_heads, head_parameter_groups
from gradmon_ray.rllib.settings import GradmonSettings, VGSSettings
from gradmon_ray.telemetry import (
    GradientNorms,
    IterationAccumulator,
    IterationTelemetry,
    NoiseScaleTracker,
    TelemetryTracker,
)
from gradmon_ray.telemetry.bands import BandSet
from gradmon_ray.telemetry.noise_one_learner import EpochGradientSum
from gradmon_ray.telemetry.noise_scale import GLOBAL_ENTRY
from gradmon_ray.vgs import VarianceGradientScaler


@dataclass(frozen=True)
class ModuleSpecOfMonitor:
    """What the learner resolved for one module before building its telemetry."""

    module_id: str
    heads: dict[str, list[Any]]
    """Head name -> its parameters (or ``ParamRows``), from ``rllib.heads.head_parameter_groups``."""
    latch_heads: tuple[str, ...]
    bands: BandSet
    """The module's edges; ``bands.value_heads``: the value heads it declares besides ``value``, ``vf``."""


class ModuleTelemetry:
    """The per-module half of ``GradmonMonitor``: measure, record, and hold the module's state."""

    def __init__(
        self,
        spec: ModuleSpecOfMonitor,
        rl_module: torch.nn.Module,
        *,
        device: torch.device | str,
        grad_scaler: torch.amp.GradScaler | None,
        vgs: VGSSettings,
        optimizers: list[torch.optim.Optimizer],
    ) -> None:
        self.module_id = spec.module_id
        self.device = device
        groups = spec.heads
        self.groups = groups
        self.grad_scaler = grad_scaler
        self.params: list[torch.nn.Parameter] = [p for p in rl_module.parameters() if p.requires_grad]
        """Every trainable parameter of the module (heads and trunk), in ``parameters()`` order."""
        sizes = head_sizes(rl_module, spec.latch_heads)
        self.tracker = TelemetryTracker(
            list(groups),
            action_heads(groups, spec.bands.value_heads),
            bands=spec.bands,
            latch_heads=spec.latch_heads,
            head_sizes=sizes,
        )
        self.head_health = HeadHealthRecorder(sizes, device)
        self.accumulator = IterationAccumulator(self.tracker.layout, device=device)
        self.last_telemetry: IterationTelemetry | None = None
        self._logp_rows = 0  # rows of the minibatch's log-probs (host-side shape), for the noise scale
        self._rl_module = rl_module
        self._latch_inputs: list[tuple[torch.Tensor, Any, torch.Tensor | None]] = []
        self.noise_hook = NoiseScaleHook(groups, device, scale=self._loss_scale)  # lanes always reduced
        self.noise: NoiseScaleTracker | None = None
        self.epoch_sum: EpochGradientSum | None = None
        """One learner: the first epoch's gradients summed (``setup_noise_scale``); None otherwise."""
        self.no_lanes = torch.zeros(0, dtype=torch.float64, device=device)
        self.epoch_sum_lanes = self.no_lanes
        """The drained ``epoch_sum`` of the step (rides the host copy): ``[heads + 1]`` squared norms."""
        """An empty lane segment (a lane group not in use), made once: slicing one each step is an op."""
        self.scaler_lanes = torch.zeros(2, dtype=torch.float64, device=device)
        """[minibatches the GradScaler skipped this step (overflow at its scale), scale of the
        last minibatch]: reported once per telemetry step, then the count is zeroed."""
        self.vgs: VarianceGradientScaler | None = None
        self.update_scaler: UpdateScaler | None = None
        self._vgs_factor: torch.Tensor | None = None  # update mode: this minibatch's factor
        if vgs.enabled:
            # One scale for the whole module, from gradients DDP has already averaged: every
            # replica sees identical inputs and so applies an identical scale.
            self.vgs = VarianceGradientScaler(self.params, **vgs.kwargs)
            if vgs.apply_to == "update":
                self.update_scaler = UpdateScaler(optimizers)

    @property
    def head_names(self) -> tuple[str, ...]:
        """Reported heads (norms), in order."""
        return self.tracker.reported_heads

    def _loss_scale(self) -> torch.Tensor | None:
        return compat.scale_tensor(self.grad_scaler) if self.grad_scaler is not None else None

    def setup_noise_scale(self, ddp_module: Any, settings: GradmonSettings, active: bool, *, averaged: bool) -> None:
        """Per-head gradient noise scale (2+ learners): the LOCAL squared norms go into device
        lanes before the cross-learner average: from a DDP comm hook on each bucket, or, where
        gradmon averages the gradients itself (``averaged``), from that average."""
        if not active and settings.noise_scale_one_learner and settings.telemetry:
            # One learner: the first epoch's minibatches against their mean (``telemetry.noise_one_learner``).
            self.epoch_sum = EpochGradientSum(self.groups, self.params)
            self.epoch_sum_lanes = torch.zeros(len(self.groups) + 1, device=self.device)
            self.noise = NoiseScaleTracker([*self.groups, GLOBAL_ENTRY], beta=settings.noise_ema_beta)
            return
        if not (settings.noise_scale and active):
            return
        if self.noise_hook.enable() if averaged else self.noise_hook.register(ddp_module):
            self.noise = NoiseScaleTracker([*self.groups, GLOBAL_ENTRY], beta=settings.noise_ema_beta)

    # --- per minibatch -------------------------------------------------------------------
    def record_latch_inputs(self, logits: torch.Tensor, actions: Any, mask: torch.Tensor | None) -> None:
        """Keep the minibatch's action-distribution inputs, taken actions and loss mask
        by reference (no kernel): the drain turns the step's into log-prob flags at once
        (``rllib.module_groups``)."""
        self._logp_rows = logits.shape[0]
        self._latch_inputs.append((logits, actions, mask))

    def take_latch_inputs(self) -> list[tuple[torch.Tensor, Any, torch.Tensor | None]]:
        """The step's recorded ``(logits, actions, mask)`` per minibatch; forgets them (the drain
        turns them into log-prob flags: ``rllib.module_groups.latch_flag_blocks``)."""
        inputs, self._latch_inputs = self._latch_inputs, []
        return inputs

    @property
    def rl_module(self) -> torch.nn.Module:
        """The monitored RLModule (unwrapped from DDP)."""
        return self._rl_module

    def record_logp(self, per_head_logp: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Keep the minibatch's ``[B, latch heads]`` log-probs and loss mask by reference (no kernel)."""
        self._logp_rows = per_head_logp.shape[0]
        self.accumulator.add_logp(per_head_logp, mask)  # read at the drain, under no_grad: no detach op

    def record_head_inputs(self, logits: torch.Tensor, sampling_logits: Any, mask: torch.Tensor | None) -> None:
        """Keep references for the step's head health (``rllib.head_health``); no kernel."""
        self.head_health.record(logits, sampling_logits, mask)

    @property
    def needs_own_norms(self) -> bool:
        """Whether ``after_norms`` has work: VGS or the noise-scale hook (2+ learners)."""
        return self.vgs is not None or (self.noise is not None and self.epoch_sum is None)

    def unscale(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """With a ``GradScaler``, unscale the gradients in place before the norms (it records
        ``found_inf`` for its own ``step``, no host sync), so that the norms are the true ones."""
        if self.grad_scaler is not None:
            for optimizer in optimizers:
                self.grad_scaler.unscale_(optimizer)

    def after_norms(self, found: torch.Tensor, norms: GradientNorms | None) -> None:
        """After the norm pass (DDP's all-reduce done, before clipping; ``found``: the module's
        0-d non-finite flag, ``norms``: its norms where the noise scale needs them): the
        noise-scale lanes, then VGS."""
        if self.noise is not None and norms is not None:
            self.noise_hook.add_big(norms.head_norms, norms.global_norm, self._logp_rows)
            self._logp_rows = 0  # a minibatch without this module's log-probs has no rows
        if self.vgs is not None:
            # After the telemetry norms (they stay pre-scaling); a skipped (non-finite) step
            # must not teach VGS either.  Gradient mode scales before RLlib's clipping;
            # update mode scales the optimizer's step.
            if self.update_scaler is None:
                self.vgs.scale_gradients(skip=found)
            else:
                self._vgs_factor = self.vgs.observe(skip=found, scale_gradients=False)
            self.vgs.step()

    def prepare_step(
        self, optimizers: list[torch.optim.Optimizer], skip_nonfinite: bool, flags: FoundInfFlags, found: torch.Tensor
    ) -> list[torch.nn.Parameter]:
        """Before RLlib's optimizer step for this module (``found``: its 0-d non-finite flag):
        the parameters to leave alone.

        ``skip_nonfinite`` (``torch_skip_nan_gradients``): fused optimizers get the flag as
        ``found_inf`` (``torch.amp.GradScaler``'s protocol: the kernel itself skips, no host
        round trip); any other optimizer costs one host sync, and on a non-finite minibatch its
        parameters are returned: the caller drops their gradients, so that its ``step`` leaves
        them alone.  Without it, RLlib's own ``nan_to_num`` and step run untouched.  With a
        ``GradScaler``, ``GradScaler.step`` skips on overflow itself: counted apart (``scaler_lanes``).
        """
        if self.grad_scaler is not None:
            self.scaler_lanes[0].add_(found)
            self.scaler_lanes[1].copy_(compat.scale_tensor(self.grad_scaler).reshape(()))
            return []
        if not skip_nonfinite:
            return []
        dropped: list[torch.nn.Parameter] = []
        for optimizer in optimizers:
            if compat.supports_found_inf(optimizer):
                flags.set(optimizer, found)
            elif bool(found):  # the one tolerated host sync per minibatch (non-fused optimizers only)
                dropped.extend(p for group in optimizer.param_groups for p in group["params"])
        return dropped

    def scaled_update(self) -> AbstractContextManager[None]:
        """VGS in update mode: the optimizers' steps move by factor x their update."""
        if self.update_scaler is None or self._vgs_factor is None:
            return nullcontext()
        factor, self._vgs_factor = self._vgs_factor, None
        return self.update_scaler.scaled(factor)

    # --- state ---------------------------------------------------------------------------
    def parts(self) -> dict[str, Any]:
        """The module's checkpointed pieces by state key suffix (None: not in use)."""
        return {"telemetry": self.tracker, "noise": self.noise, "vgs": self.vgs}


class FoundInfFlags:
    """Sets ``optimizer.found_inf`` on fused optimizers for one step and always removes it again."""

    def __init__(self) -> None:
        self._flagged: list[torch.optim.Optimizer] = []

    def __enter__(self) -> FoundInfFlags:
        return self

    def set(self, optimizer: torch.optim.Optimizer, found: torch.Tensor) -> None:
        compat.set_found_inf(optimizer, found)
        self._flagged.append(optimizer)

    def __exit__(self, *exc: object) -> None:
        for optimizer in self._flagged:
            compat.clear_found_inf(optimizer)
        self._flagged.clear()


def resolve_module(
    module_id: str, rl_module: Any, settings: GradmonSettings, latch_heads: tuple[str, ...]
) -> ModuleSpecOfMonitor:
    """The heads and bands of one module (raises ``ValueError`` naming the module); the bands carry
    the value heads the module and its settings declare (``rllib.heads.declared_value_heads``)."""
    own = settings.for_module(module_id)
    try:
        heads = head_parameter_groups(rl_module, own.heads)
        value_heads = declared_value_heads(rl_module, own.value_heads or (), heads, latch_heads)
    except ValueError as exc:
        raise ValueError(f"module {module_id!r}: {exc}") from None
    bands = own.bands if own.bands is not None else BandSet()
    return ModuleSpecOfMonitor(
        module_id, heads, latch_heads, bands.with_value_heads(value_heads) if value_heads else bands
    )
