"""``GradmonPPOTorchLearner``: RLlib's PPO torch learner with per-head gradient telemetry.

Per minibatch, everything stays on the learner's device:

1. the PPO loss (``ppo_loss_terms``) keeps the per-head log-probs -> NaN/Inf flags;
2. after backward and before clipping, ``GradientNormPlan`` computes the per-head norms, the
   global norm and exact NaN/Inf element counts;
3. clipping reuses that global norm; the optimizer step is skipped on device when any
   gradient is non-finite (fused Adam reads ``found_inf`` exactly as it does from
   ``torch.amp.GradScaler``); optimizers without that support cost one host sync instead;
4. all of it is added into one packed buffer (``IterationAccumulator``).

Once per training iteration (``after_gradient_based_update``) that buffer crosses to the
host in one copy and becomes RLlib metrics (names in ``gradmon_ray.metric_names``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch
from ray.rllib.algorithms.ppo.ppo import (
    LEARNER_RESULTS_KL_KEY,
    LEARNER_RESULTS_VF_EXPLAINED_VAR_KEY,
    LEARNER_RESULTS_VF_LOSS_UNCLIPPED_KEY,
    PPOConfig,
)
from ray.rllib.algorithms.ppo.ppo_learner import PPOLearner
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.learner import ENTROPY_KEY, POLICY_LOSS_KEY, VF_LOSS_KEY, Learner
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.evaluation.postprocessing import Postprocessing
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import ModuleID, ParamDict, StateDict, TensorType

from gradmon_ray import metric_names as mn
from gradmon_ray.distributed import (
    LearnerCollective,
    NoiseScaleHook,
    ReplicaDivergenceError,
    parameter_checksum,
    reduce_iteration,
)
from gradmon_ray.optim import UPGD
from gradmon_ray.probe.actor import ProbeRequest
from gradmon_ray.probe.analysis import LossSettings
from gradmon_ray.probe.client import ProbeClient
from gradmon_ray.probe.regularizers import resolve_regularizer
from gradmon_ray.rllib.ppo_loss import explained_variance, ppo_loss_from_batch
from gradmon_ray.telemetry import (
    GradientNormPlan,
    GradientNorms,
    IterationAccumulator,
    IterationTelemetry,
    NoiseScaleTracker,
    TelemetryTracker,
    VarianceGradientScaler,
    logp_nonfinite_flags,
)
from gradmon_ray.telemetry.noise_scale import GLOBAL_ENTRY, noise_scale_metrics
from gradmon_ray.telemetry.state_digest import state_digest

logger = logging.getLogger(__name__)

TELEMETRY_STATE_KEY = "gradmon_telemetry"
"""Key of the telemetry state inside ``Learner.get_state()``."""

VGS_STATE_KEY = "gradmon_vgs"
"""Key of the Variance Gradient Scaler's state inside ``Learner.get_state()``."""

NOISE_STATE_KEY = "gradmon_noise_scale"
"""Key of the gradient-noise-scale EMAs inside ``Learner.get_state()`` (2+ learners)."""

PROBE_STATE_KEY = "gradmon_probe"
"""Key of the probe bookkeeping (iteration count, probe counters) inside ``Learner.get_state()``."""

GRADMON_STATE_KEYS = (TELEMETRY_STATE_KEY, VGS_STATE_KEY, NOISE_STATE_KEY, PROBE_STATE_KEY)
"""Everything gradmon adds to the learner's checkpointed state."""

LEARNER_CONFIG_KEY = "gradmon"
"""Key in ``AlgorithmConfig.learner_config_dict`` holding the gradmon learner settings."""


class GradmonPPOTorchLearner(PPOTorchLearner):
    """PPO torch learner that reports per-head gradient health every training iteration.

    The RLModule must expose ``head_parameter_groups()`` (``FactoredActorCritic`` does).
    Settings come from ``config.learner_config_dict["gradmon"]``: ``telemetry`` (bool,
    default True), ``fused_optimizer`` (bool, default True: fused Adam, which also makes
    the skip-on-NaN decision on the device), ``optimizer`` (``"adam"`` or ``"upgd"``),
    ``upgd`` (UPGD's hyperparameters), ``vgs`` (``VarianceGradientScaler`` keyword
    arguments plus ``enabled``; off when absent), ``collective_group`` /
    ``collective_backend`` / ``replica_check_every`` (the cross-learner reduction),
    ``regularizers`` (``{"name", "fn", "weight", "enabled"}`` entries added to the loss),
    ``probe`` (``{"actor_name", "every"}``: rank 0 hands the GradientProbe actor the
    pre-update weights and the batch every ``every`` iterations), and
    ``fault_injection`` (tests only: ``{"nan_logits": {"rank", "head", "iteration"}}`` makes
    that head's logits NaN on that rank in that iteration; ``{"grad": [{"rank", "head",
    "iteration", "value"}]}`` writes ``value`` (``"nan"`` or ``"inf"``) into one element of the
    head's first parameter's gradient on that rank, before DDP's all-reduce).
    """

    @override(PPOTorchLearner)
    def build(self) -> None:
        if self.config._torch_lr_scheduler_classes:
            raise ValueError(
                "GradmonPPOTorchLearner does not support _torch_lr_scheduler_classes; "
                "use lr schedules via config.training(lr=[[t0, lr0], ...]) instead"
            )
        settings = dict(self.config.learner_config_dict.get(LEARNER_CONFIG_KEY, {}))
        self._telemetry_enabled = bool(settings.get("telemetry", True))
        self._fused_optimizer = bool(settings.get("fused_optimizer", True))
        self._optimizer_name = settings.get("optimizer", "adam")
        if self._optimizer_name not in ("adam", "upgd"):
            raise ValueError(f"optimizer must be 'adam' or 'upgd', got {self._optimizer_name!r}")
        self._upgd_settings = dict(settings.get("upgd", {}))
        vgs_settings = dict(settings.get("vgs", {}))
        vgs_settings.pop("accept_old_checkpoint", None)  # checked before training (rllib.preflight)
        self._replica_check_every = int(settings.get("replica_check_every", 10))
        self._fault_injection = dict(settings.get("fault_injection", {}))
        self._regularizers = [resolve_regularizer(**dict(r)) for r in settings.get("regularizers", ())]
        self._regularizers = [r for r in self._regularizers if r.enabled]
        probe_settings = dict(settings.get("probe") or {})
        super().build()
        module_ids = list(self.module.keys())
        if len(module_ids) != 1:
            raise ValueError(f"GradmonPPOTorchLearner trains exactly one RLModule, got {module_ids}")
        self._module_id: ModuleID = module_ids[0]
        # Mixed precision (config.experimental(_torch_grad_scaler_class=...)): RLlib scales the
        # loss; we unscale right after backward so every statistic sees the true gradients.
        self._grad_scaler = self._grad_scalers[self._module_id] if self._grad_scalers is not None else None
        # [minibatches the scaler skipped (overflow at its scale), scale of the last minibatch]
        self._scaler_acc = torch.zeros(2, dtype=torch.float64, device=self._device)
        rl_module = self.module[self._module_id].unwrapped()
        if not hasattr(rl_module, "head_parameter_groups"):
            raise TypeError(
                f"{type(rl_module).__name__} has no head_parameter_groups(); use gradmon_ray.rllib.FactoredActorCritic "
                "or add that method to your RLModule"
            )
        groups = rl_module.head_parameter_groups()
        action_heads = [h for h in groups if h != "value"]
        self._norm_plan = GradientNormPlan(groups, [p for p in rl_module.parameters() if p.requires_grad])
        from gradmon_ray.telemetry.bands import BandSet  # health band edges (config telemetry.bands)

        self._tracker = TelemetryTracker(list(groups), action_heads, bands=BandSet.from_dict(settings.get("bands")))
        self._accumulator = IterationAccumulator(self._tracker.layout, device=self._device)
        self._pending_norms: GradientNorms | None = None
        self._pending_logp_flags: tuple[torch.Tensor, torch.Tensor] | None = None
        self._zero_flags = torch.zeros(len(action_heads), device=self._device)
        self.last_telemetry: IterationTelemetry | None = None
        self._collective = self._make_collective(settings)
        self._setup_noise_scale(
            groups, float(settings.get("noise_ema_beta", 0.9)), enabled=bool(settings.get("noise_scale", True))
        )
        self._iterations_done = 0
        self._probe: ProbeClient | None = None
        self._probe_snapshot: dict[str, Any] | None = None
        if probe_settings.get("every", 0) > 0 and self._global_rank() == 0:
            # Rank 0's shard stands for the batch: the other shards come from the same policy.
            self._probe = ProbeClient(probe_settings["actor_name"], int(probe_settings["every"]))
        self._install_grad_faults(groups)
        self._vgs: VarianceGradientScaler | None = None
        if vgs_settings.pop("enabled", False):
            # One scale for the whole module, computed from gradients that DDP has already
            # averaged: every replica sees identical inputs and so applies an identical scale.
            self._vgs = VarianceGradientScaler(self._norm_plan.params, **vgs_settings)

    def _install_grad_faults(self, groups: dict[str, list[torch.nn.Parameter]]) -> None:
        """Fault injection (tests): a tensor hook per poisoned head, armed per iteration.

        A tensor hook on a leaf runs before gradient accumulation, so before DDP's all-reduce:
        the poisoned element reaches every replica the way a real local overflow would.
        """
        for fault in self._fault_injection.get("grad", ()):
            if fault["value"] not in ("nan", "inf"):
                raise ValueError(f"fault_injection.grad.value must be 'nan' or 'inf', got {fault['value']!r}")
            if fault["rank"] != self._global_rank():
                continue

            def poison(grad: torch.Tensor, fault: dict[str, Any] = fault) -> torch.Tensor:
                if self._tracker.iteration + 1 != fault["iteration"]:
                    return grad
                poisoned = grad.clone()
                poisoned.view(-1)[0] = float(fault["value"])
                return poisoned

            groups[fault["head"]][0].register_hook(poison)

    @staticmethod
    def _global_rank() -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def head_names(self) -> tuple[str, ...]:
        """Reported heads: the action heads in logits order, then ``"value"``."""
        return self._tracker.reported_heads

    def _make_collective(self, settings: dict[str, Any]) -> LearnerCollective:
        import torch.distributed as dist

        reduce = bool(settings.get("reduce_telemetry", True))
        if reduce and self.config.num_learners > 1 and dist.is_available() and dist.is_initialized():
            world_size, rank = dist.get_world_size(), dist.get_rank()
        else:
            world_size, rank = 1, 0
        # Every learner must use the same name: build_ppo_config puts a run-unique one in the
        # config; a hand-made config falls back to the DDP world's rendezvous address.
        name = settings.get("collective_group") or "gradmon-{}-{}".format(
            os.environ.get("MASTER_ADDR", "local"), os.environ.get("MASTER_PORT", "0")
        )
        return LearnerCollective(
            name, world_size, rank, settings.get("collective_backend", "auto"), torch.device(self._device)
        )

    def _setup_noise_scale(self, groups: dict[str, list[Any]], beta: float, enabled: bool = True) -> None:
        """Per-head gradient noise scale (needs 2+ learners: local vs all-reduced gradients).

        A DDP comm hook (``NoiseScaleHook``) adds each bucket's LOCAL per-head squared norms
        (before the all-reduce) into device lanes and then hands the bucket to DDP's own
        ``allreduce_hook``, which still does the averaging.
        """
        self._noise: NoiseScaleTracker | None = None
        # The hook's lanes ride in every iteration's reduction (zeros without 2+ learners).
        self._noise_hook = NoiseScaleHook(groups, self._device, scale=self._loss_scale)
        self._last_rows = 0
        if not (enabled and self._collective.active):
            return
        if self._noise_hook.register(self.module[self._module_id]):
            self._noise = NoiseScaleTracker([*groups, GLOBAL_ENTRY], beta=beta)

    def _loss_scale(self) -> torch.Tensor | None:
        """The GradScaler's current scale (0-d, on the device), None without one."""
        return self._grad_scaler._get_scale_async() if self._grad_scaler is not None else None

    @property
    def collective(self) -> LearnerCollective:
        """This learner's collective group (``world_size == 1`` without remote learners)."""
        return self._collective

    @override(Learner)
    def shutdown(self) -> None:
        self._collective.destroy()
        super().shutdown()

    @override(TorchLearner)
    def configure_optimizers_for_module(self, module_id: ModuleID, config: PPOConfig = None) -> None:
        params = self.get_parameters(self._module[module_id])
        optimizer: torch.optim.Optimizer
        if self._optimizer_name == "upgd":
            # Seeded noise: every replica draws the same perturbation, so DDP replicas stay identical.
            generator = torch.Generator(device=self._device).manual_seed(int(config.seed or 0))
            initial_lr = 0.0 if isinstance(config.lr, list) else float(config.lr)  # a schedule sets it later
            optimizer = UPGD(params, lr=initial_lr, generator=generator, **self._upgd_settings)
        else:
            # Fused Adam accepts `found_inf` (torch.amp.GradScaler's protocol), so a non-finite
            # minibatch is skipped inside the kernel without a host round trip.
            dev_type = torch.device(self._device).type if self._device is not None else "cpu"
            fused = self._fused_optimizer and dev_type in ("cpu", "cuda")
            optimizer = torch.optim.Adam(params, fused=fused) if fused else torch.optim.Adam(params)
        self.register_optimizer(module_id=module_id, optimizer=optimizer, params=params, lr_or_lr_schedule=config.lr)

    @override(PPOTorchLearner)
    def compute_loss_for_module(
        self,
        *,
        module_id: ModuleID,
        config: PPOConfig,
        batch: dict[str, Any],
        fwd_out: dict[str, TensorType],
    ) -> TensorType:
        module = self.module[module_id].unwrapped()
        logits = fwd_out[Columns.ACTION_DIST_INPUTS]
        fault = self._fault_injection.get("nan_logits")
        if fault and fault["rank"] == self._collective.rank and fault["iteration"] == self._tracker.iteration + 1:
            logits = self._with_nan_head(logits, module, fault["head"])
        mask = batch.get(Columns.LOSS_MASK)
        self._last_rows = int(batch[Columns.OBS].shape[0])  # host-side shape: no sync
        terms = ppo_loss_from_batch(
            module,
            batch,
            fwd_out,
            logits=logits,
            clip_param=config.clip_param,
            vf_clip_param=config.vf_clip_param,
            vf_loss_coeff=config.vf_loss_coeff,
            entropy_coeff=self.entropy_coeff_schedulers_per_module[module_id].get_current_value(),
            kl_coeff=self.curr_kl_coeffs_per_module[module_id],
            use_kl_loss=config.use_kl_loss,
            use_critic=config.use_critic,
        )
        total = terms.total
        for spec in self._regularizers:
            total = total + spec.weight * spec.fn(module, batch, fwd_out)
        if self._telemetry_enabled:
            logp = terms.per_head_logp
            if mask is not None:
                logp = torch.where(mask.unsqueeze(-1), logp, 0.0)  # padding rows never latch
            self._pending_logp_flags = logp_nonfinite_flags(logp)
        # Same keys and window as RLlib's PPO learner (its KL-coefficient update reads them).
        self.metrics.log_dict(
            {
                POLICY_LOSS_KEY: terms.policy,
                VF_LOSS_KEY: terms.value,
                LEARNER_RESULTS_VF_LOSS_UNCLIPPED_KEY: terms.value_unclipped,
                LEARNER_RESULTS_VF_EXPLAINED_VAR_KEY: explained_variance(
                    batch[Postprocessing.VALUE_TARGETS], terms.values
                )
                if config.use_critic
                else torch.zeros((), device=terms.total.device),
                ENTROPY_KEY: terms.entropy,
                LEARNER_RESULTS_KL_KEY: terms.kl,
            },
            key=module_id,
            window=1,
        )
        return total

    @staticmethod
    def _with_nan_head(logits: torch.Tensor, module: Any, head: str) -> torch.Tensor:
        """Fault injection (tests): the logits of ``head`` set to NaN."""
        layout = module.head_layout
        start = sum(layout.sizes[: layout.names.index(head)])
        stop = start + layout.sizes[layout.names.index(head)]
        poisoned = logits.clone()
        poisoned[..., start:stop] = float("nan")
        return poisoned

    @override(Learner)
    def postprocess_gradients_for_module(
        self,
        *,
        module_id: ModuleID,
        config: PPOConfig | None = None,
        module_gradients_dict: ParamDict,
    ) -> ParamDict:
        if self._grad_scaler is not None:
            for optimizer in self._optimizer_parameters:
                # In place, on the device; records found_inf for scaler.step (no host sync).
                self._grad_scaler.unscale_(optimizer)
        # TELE-320/310/300/301 are read here: after backward (and DDP's all-reduce), before clipping.
        norms = self._norm_plan.compute()
        self._pending_norms = norms
        if self._noise is not None:
            self._noise_hook.add_big(norms.head_norms, norms.global_norm, self._last_rows)
        global_norm = norms.global_norm
        if self._vgs is not None:
            # After the telemetry norms (they stay pre-scaling), before clipping and the step.
            # A non-finite step is skipped by the optimizer; VGS must not learn from it either.
            scale = self._vgs.scale_gradients(skip=norms.found_nonfinite)
            self._vgs.step()
            global_norm = global_norm * scale  # one uniform factor: the post-VGS norm, exactly
        if config.grad_clip is None:
            return dict(module_gradients_dict)
        if config.grad_clip_by == "global_norm":
            # RLlib's clip_gradients formula, reusing the norm computed above instead of a second pass.
            grads = [g for g in module_gradients_dict.values() if g is not None]
            coeff = config.grad_clip / torch.clamp(global_norm + 1e-6, min=config.grad_clip)
            torch._foreach_mul_(grads, coeff)
            return dict(module_gradients_dict)
        grads_dict = dict(module_gradients_dict)
        self._get_clip_function()(grads_dict, grad_clip=config.grad_clip, grad_clip_by=config.grad_clip_by)
        return grads_dict

    @override(TorchLearner)
    def apply_gradients(self, gradients_dict: ParamDict) -> None:
        for pid, grad in gradients_dict.items():
            self._params[pid].grad = grad
        norms = self._pending_norms
        if norms is None:  # e.g. a module with all parameters frozen
            norms = self._norm_plan.compute()
        found_nonfinite = norms.found_nonfinite
        if self._grad_scaler is not None:
            self._step_with_scaler(found_nonfinite)
            found_nonfinite = torch.zeros_like(found_nonfinite)  # the scaler's skip, counted apart
        for optimizer in self._optimizer_parameters if self._grad_scaler is None else ():
            # Per param group, not `defaults`: loading another optimizer's state can change it.
            if all(group.get("fused") for group in optimizer.param_groups):
                optimizer.found_inf = found_nonfinite  # read by the fused kernel, as from GradScaler
                try:
                    optimizer.step()
                finally:
                    del optimizer.found_inf
            elif not bool(found_nonfinite):  # the one tolerated host sync per minibatch
                optimizer.step()
        if self._telemetry_enabled:
            nan_flags, inf_flags = self._pending_logp_flags or (self._zero_flags, self._zero_flags)
            self._accumulator.add_minibatch(norms, nan_flags, inf_flags, found_nonfinite)
        self._pending_norms = None
        self._pending_logp_flags = None

    def _step_with_scaler(self, found_nonfinite: torch.Tensor) -> None:
        """``GradScaler.step`` (skips on the found_inf its ``unscale_`` recorded) and ``update``.

        With a scaler, non-finite gradients are what an overflow at the current scale looks
        like: the scaler skips the step and backs off.  They count as scaler skips
        (``update/scaler_skipped``), not as ``update/skipped``, and never touch the log-prob
        latches; the NaN/Inf element counts still report what the unscaled gradients held.
        """
        scaler = self._grad_scaler
        for optimizer in self._optimizer_parameters:
            scaler.step(optimizer)  # fused Adam reads found_inf on the device; others sync once
        self._scaler_acc[0].add_(found_nonfinite)
        self._scaler_acc[1].copy_(scaler._get_scale_async().reshape(()))
        scaler.update()

    @override(PPOLearner)
    def after_gradient_based_update(self, *, timesteps: dict[str, Any]) -> None:
        super().after_gradient_based_update(timesteps=timesteps)
        self._iterations_done += 1
        metrics: dict[str, float] = {}
        if self._probe is not None:
            self._send_probe()
            metrics.update(self._probe.metrics())
        if not self._telemetry_enabled and self._vgs is None:
            self._log_metrics_dict(metrics)
            return
        lanes, checksum_ok = self._reduce_iteration()
        if self._telemetry_enabled:
            summary = self._tracker.finish_iteration(lanes["telemetry"])
            self.last_telemetry = summary
            metrics.update(summary.to_metrics())
            metrics.update(self._noise_scale_metrics(lanes["noise"], summary.minibatches))
        if self._vgs is not None:
            metrics.update(zip(mn.VGS_DEVICE_METRICS, lanes["vgs"].tolist(), strict=True))
            metrics.update(self._vgs.host_metrics())
        if self._grad_scaler is not None:
            metrics[mn.SCALER_SKIPPED_UPDATES], metrics[mn.GRAD_SCALE] = (float(v) for v in lanes["scaler"])
        if checksum_ok is not None:
            metrics[mn.REPLICA_CHECKSUM_OK] = float(checksum_ok)
        self._log_metrics_dict(metrics)
        if checksum_ok is False:
            raise ReplicaDivergenceError(
                f"learner replicas hold different parameters after iteration {self._tracker.iteration} "
                f"(detected on rank {self._collective.rank} of {self._collective.world_size}); "
                "the run cannot be trusted: restore the last checkpoint"
            )

    def _log_metrics_dict(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.metrics.log_value((self._module_id, name), value, window=1)

    @override(Learner)
    def _make_batch_if_necessary(self, training_data: Any) -> Any:
        # The one place that sees the whole postprocessed batch (GAE done) before the first
        # minibatch: snapshot it and the pre-update weights for the probe, on device, no sync.
        batch = super()._make_batch_if_necessary(training_data)
        probe = self._probe
        if probe is not None and batch is not None and probe.due(self._iterations_done + 1) and probe.reserve():
            mid = self._module_id
            module = self.module[mid].unwrapped()
            self._probe_snapshot = {
                "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
                "batch": {k: v for k, v in batch.policy_batches[mid].items() if k != "weights_seq_no"},
                "entropy_coeff": self.entropy_coeff_schedulers_per_module[mid].get_current_value(),
                "kl_coeff": torch.as_tensor(self.curr_kl_coeffs_per_module[mid]).detach().clone(),
            }
        return batch

    def _send_probe(self) -> None:
        """Hand the snapshot to the probe actor (once per probed iteration; the copy to host is here)."""
        snapshot, self._probe_snapshot = self._probe_snapshot, None
        if snapshot is None:
            self._probe.poll()
            return
        import tree

        module = self.module[self._module_id].unwrapped()
        config = self.config.get_config_for_module(self._module_id)
        to_host = lambda t: t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)  # noqa: E731
        self._probe.submit(
            ProbeRequest(
                iteration=self._iterations_done,
                module_spec=RLModuleSpec(
                    module_class=type(module),
                    observation_space=module.observation_space,
                    action_space=module.action_space,
                    model_config=module.model_config,
                ),
                weights={k: to_host(v) for k, v in snapshot["weights"].items()},
                batch={k: tree.map_structure(to_host, v) for k, v in snapshot["batch"].items()},
                loss=LossSettings(
                    clip_param=float(config.clip_param),
                    vf_clip_param=float(config.vf_clip_param),
                    vf_loss_coeff=float(config.vf_loss_coeff),
                    entropy_coeff=float(snapshot["entropy_coeff"]),
                    kl_coeff=float(snapshot["kl_coeff"]),
                    use_kl_loss=bool(config.use_kl_loss),
                ),
            )
        )

    def _reduce_iteration(self) -> tuple[dict[str, np.ndarray], bool | None]:
        """Pack, reduce ONCE across learners, copy to the host ONCE; then unpack.

        Reduced part: the telemetry lanes, the two checksum digits (zeros unless this is a
        check iteration) and the noise-scale lanes.  Unreduced part (identical on every
        replica, or rank-local): VGS metrics and this rank's own checksum digits.
        """
        collective = self._collective
        k = collective.world_size
        check = (
            collective.active
            and self._replica_check_every > 0
            and (self._tracker.iteration + 1) % self._replica_check_every == 0
        )
        digits = (
            parameter_checksum(list(self._norm_plan.params)).to(self._device)
            if check
            else torch.zeros(2, dtype=torch.float64, device=self._device)
        )
        vgs = self._vgs.metrics_tensor() if self._vgs is not None else None
        scaler = self._scaler_acc if self._grad_scaler is not None else self._scaler_acc[:0]
        local = torch.cat([scaler, digits]) if vgs is None else torch.cat([scaler, vgs.double(), digits])
        self._scaler_acc[0].zero_()
        reduced = reduce_iteration(
            self._accumulator, collective, checksum=digits, noise=self._noise_hook.lanes, local=local
        )
        self._noise_hook.zero_()
        local_host = reduced.local
        checksum_ok = bool(np.array_equal(reduced.checksum, k * local_host[-2:])) if check else None
        n_scaler = scaler.numel()
        lanes_out = {"telemetry": reduced.lanes, "vgs": local_host[n_scaler:-2], "noise": reduced.noise}
        lanes_out["scaler"] = local_host[:n_scaler]
        return lanes_out, checksum_ok

    def _noise_scale_metrics(self, noise: np.ndarray, minibatches: int) -> dict[str, float]:
        """B_simple per head and global from the reduced noise lanes of one iteration."""
        rows = self._noise_hook.take_rows()
        if self._noise is None:
            return {}
        return noise_scale_metrics(
            self._noise, noise, world_size=self._collective.world_size, minibatches=minibatches, rows=rows
        )

    def gradmon_state_digest(self) -> str:
        """SHA-256 of this learner's gradmon state (latches, prev values, counters, VGS, noise, probe)."""
        state = self.get_state(components=list(GRADMON_STATE_KEYS))
        return state_digest({k: v for k, v in state.items() if k in GRADMON_STATE_KEYS})

    def telemetry_state(self) -> dict[str, Any]:
        """The persistent telemetry state (latches, prev values, counters)."""
        return self._tracker.state_dict()

    @override(Learner)
    def get_state(self, components: Any = None, *, not_components: Any = None, **kwargs: Any) -> StateDict:
        state = super().get_state(components, not_components=not_components, **kwargs)
        if self._check_component(TELEMETRY_STATE_KEY, components, not_components):
            state[TELEMETRY_STATE_KEY] = self._tracker.state_dict()
        if self._check_component(PROBE_STATE_KEY, components, not_components):
            state[PROBE_STATE_KEY] = {
                "iterations_done": self._iterations_done,
                "counters": self._probe.state_dict() if self._probe is not None else {},
            }
        if self._noise is not None and self._check_component(NOISE_STATE_KEY, components, not_components):
            state[NOISE_STATE_KEY] = self._noise.state_dict()
        if self._vgs is not None and self._check_component(VGS_STATE_KEY, components, not_components):
            state[VGS_STATE_KEY] = self._vgs.state_dict()
        return state

    @override(Learner)
    def set_state(self, state: StateDict) -> None:
        super().set_state(state)
        if TELEMETRY_STATE_KEY in state:
            self._tracker.load_state_dict(state[TELEMETRY_STATE_KEY])
        if PROBE_STATE_KEY in state:
            self._iterations_done = int(state[PROBE_STATE_KEY].get("iterations_done", 0))
            if self._probe is not None:
                self._probe.load_state_dict(state[PROBE_STATE_KEY].get("counters", {}))
        if NOISE_STATE_KEY in state and self._noise is not None:
            self._noise.load_state_dict(state[NOISE_STATE_KEY])
        if VGS_STATE_KEY in state and self._vgs is not None:
            self._vgs.load_state_dict(state[VGS_STATE_KEY])

    @property
    def vgs(self) -> VarianceGradientScaler | None:
        """The learner's Variance Gradient Scaler (None when disabled)."""
        return self._vgs
