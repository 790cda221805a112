"""``GradmonPPOTorchLearner``: ``with_gradmon(PPOTorchLearner)`` plus what gradmon's PPO needs.

The telemetry (norms, latches, skip-on-non-finite, VGS, the once-per-iteration reduction)
is ``gradmon_ray.rllib.monitor``.  Here, PPO's hooks only: the PPO loss term by term with
the per-head log-probs kept (``ppo_loss``), regularizers added to the loss, the optimizer
choice (fused Adam or UPGD), and the hand-off of the pre-update weights and the batch to the
GradientProbe actor.  The module must be a ``FactoredActorCritic`` (or any RLModule with
``head_parameter_groups()`` whose action distribution is a ``FactoredCategorical``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from ray.rllib.algorithms.ppo.ppo import (
    LEARNER_RESULTS_KL_KEY,
    LEARNER_RESULTS_VF_EXPLAINED_VAR_KEY,
    LEARNER_RESULTS_VF_LOSS_UNCLIPPED_KEY,
    PPOConfig,
)
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.learner import ENTROPY_KEY, POLICY_LOSS_KEY, VF_LOSS_KEY, Learner
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.evaluation.postprocessing import Postprocessing
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import ModuleID, StateDict, TensorType

from gradmon_ray import compat
from gradmon_ray.losses.ppo import explained_variance
from gradmon_ray.losses.regularizers import resolve_regularizer
from gradmon_ray.optim import UPGD
from gradmon_ray.probe.client import LossSettings, ModuleProbe, ProbeClient, ProbeRequest
from gradmon_ray.rllib.monitor import (
    GRADMON_STATE_KEYS,
    NOISE_STATE_KEY,
    PROBE_STATE_KEY,
    TELEMETRY_STATE_KEY,
    VGS_STATE_KEY,
    global_rank,
    with_gradmon,
)
from gradmon_ray.rllib.monitor_step import GradmonReporting
from gradmon_ray.rllib.ppo_analysis_losses import PPOAnalysisLosses
from gradmon_ray.rllib.settings import LEARNER_CONFIG_KEY

logger = logging.getLogger(__name__)

__all__ = [
    "GRADMON_STATE_KEYS",
    "LEARNER_CONFIG_KEY",
    "NOISE_STATE_KEY",
    "PROBE_STATE_KEY",
    "TELEMETRY_STATE_KEY",
    "VGS_STATE_KEY",
    "GradmonPPOTorchLearner",
]


class GradmonPPOTorchLearner(PPOAnalysisLosses, with_gradmon(PPOTorchLearner)):
    """PPO torch learner that reports per-head gradient health every training iteration.

    Settings: ``learner_config_dict["gradmon"]`` (``gradmon_ray.rllib.settings.GradmonSettings``);
    besides the monitor's, ``optimizer`` (``"adam"``: fused Adam unless ``fused_optimizer`` is
    False; ``"upgd"`` with ``upgd``'s hyperparameters), ``regularizers`` (terms added to the
    loss) and ``probe`` (rank 0 hands the GradientProbe actor the pre-update weights and the
    batch every ``probe.every`` iterations).  ``build_ppo_config`` sets
    ``torch_skip_nan_gradients=True``: a non-finite minibatch is skipped, not zeroed.
    With several modules, each gets this loss, and each monitored module (or each in
    ``probe.modules``) with rows in a probed iteration's batch is probed (its metrics named
    ``module/<id>/...``).
    """

    gradmon_full_learner = True

    @override(PPOTorchLearner)
    def build(self) -> None:
        super().build()
        self._regularizers = [resolve_regularizer(**dict(r)) for r in self.gradmon.regularizers]
        self._regularizers = [r for r in self._regularizers if r.enabled]
        probe = self.gradmon.probe
        self._probe: ProbeClient | None = None
        self._probe_snapshot: dict[str, Any] | None = None
        if probe.every > 0 and global_rank() == 0:
            # Rank 0's shard stands for the batch: the other shards come from the same policy.
            self._probe = ProbeClient(probe.actor_name, probe.every)

    @override(TorchLearner)
    def configure_optimizers_for_module(self, module_id: ModuleID, config: PPOConfig = None) -> None:
        params = self.get_parameters(self.module[module_id])
        optimizer: torch.optim.Optimizer
        if self.gradmon.optimizer == "upgd":
            # Seeded noise: every replica draws the same perturbation, so DDP replicas stay identical.
            generator = torch.Generator(device=self.device).manual_seed(int(config.seed or 0))
            initial_lr = 0.0 if isinstance(config.lr, list) else float(config.lr)  # a schedule sets it later
            optimizer = UPGD(params, lr=initial_lr, generator=generator, **self.gradmon.upgd)
        else:
            # Fused Adam accepts `found_inf` (torch.amp.GradScaler's protocol), so a non-finite
            # minibatch is skipped inside the kernel without a host round trip.
            dev_type = torch.device(self.device).type if self.device is not None else "cpu"
            fused = self.gradmon.fused_optimizer and dev_type in ("cpu", "cuda")
            optimizer = torch.optim.Adam(params, fused=fused) if fused else torch.optim.Adam(params)
        self.register_optimizer(module_id=module_id, optimizer=optimizer, params=params, lr_or_lr_schedule=config.lr)

    @property
    def probe_client(self) -> ProbeClient | None:
        """Rank 0's client of the GradientProbe actor (None: probe off, or another rank)."""
        return self._probe

    def logits_for_loss(self, module_id: ModuleID, logits: torch.Tensor) -> torch.Tensor:
        """The action-distribution inputs module ``module_id``'s loss (and its per-head log-probs)
        uses this minibatch: the module's own by default.  A subclass may replace them (the tests'
        fault injection makes one head's NaN, ``tests/rllib/fault_injection.py``)."""
        return logits

    @override(PPOTorchLearner)
    def compute_loss_for_module(
        self, *, module_id: ModuleID, config: PPOConfig, batch: dict[str, Any], fwd_out: dict[str, TensorType]
    ) -> TensorType:
        # Replaces PPO's loss (same formula, guarded by tests/losses/test_ppo.py) to keep
        # the per-head log-probs it computes on the way.
        module = self.module[module_id].unwrapped()
        logits = fwd_out[Columns.ACTION_DIST_INPUTS]
        logits = self.logits_for_loss(module_id, logits)
        terms = self._ppo_terms(module_id, module, batch, fwd_out, config=config, logits=logits)
        total = self._with_regularizers(terms.total, module, batch, fwd_out)
        if self.gradmon.telemetry and module_id in self.gradmon_modules:
            self.record_logp(terms.per_head_logp, batch.get(Columns.LOSS_MASK), module_id=module_id)
            self.record_head_inputs(logits, batch, module_id=module_id)
        # Same keys and window as RLlib's PPO learner (its KL-coefficient update reads them).
        explained = (
            explained_variance(batch[Postprocessing.VALUE_TARGETS], terms.values)
            if config.use_critic
            else torch.zeros((), device=terms.total.device)
        )
        self.metrics.log_dict(
            {
                POLICY_LOSS_KEY: terms.policy,
                VF_LOSS_KEY: terms.value,
                LEARNER_RESULTS_VF_LOSS_UNCLIPPED_KEY: terms.value_unclipped,
                LEARNER_RESULTS_VF_EXPLAINED_VAR_KEY: explained,
                ENTROPY_KEY: terms.entropy,
                LEARNER_RESULTS_KL_KEY: terms.kl,
            },
            key=module_id,
            window=1,
        )
        return total

    @override(compat.TrainBatchHook)
    def on_train_batch(self, batch: Any) -> None:
        # The one place that sees the whole postprocessed batch (GAE done) before the first
        # minibatch: snapshot it and the pre-update weights for the probe, on device, no sync.
        super().on_train_batch(batch)
        probe = self._probe
        if probe is None or batch is None or not probe.due(self.gradmon_iteration + 1):
            return
        # The modules monitored NOW (one added mid-run is probed from its first probed iteration,
        # a removed one no more), those with rows in this batch (a sparse agent may have none),
        # and of those the ones in probe.modules when it is set.
        present = [  # probe.modules: only those it names, by id or pattern (None: every monitored module)
            mid for mid in self.gradmon_modules if mid in batch.policy_batches and self.gradmon.probe.probes(mid)
        ]
        if not present or not probe.reserve():
            return
        try:
            self._probe_snapshot = {
                "per_module_names": len(self.gradmon_modules) > 1,
                "modules": {mid: self._probe_module_snapshot(mid, batch.policy_batches[mid]) for mid in present},
            }
        except Exception as exc:  # the probe is an observer: a snapshot it cannot take is a counted failure
            probe.record_failure(f"snapshot: {type(exc).__name__}: {exc}")

    def _probe_module_snapshot(self, module_id: ModuleID, batch: Any) -> dict[str, Any]:
        """One module's pre-update weights, batch and PPO coefficients (device tensors, copied)."""
        module = self.module[module_id].unwrapped()
        return {
            "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "batch": {k: v for k, v in batch.items() if k != "weights_seq_no"},
            "entropy_coeff": self.entropy_coeff_schedulers_per_module[module_id].get_current_value(),
            "kl_coeff": torch.as_tensor(self.curr_kl_coeffs_per_module[module_id]).detach().clone(),
        }

    @override(GradmonReporting)
    def gradmon_extra_metrics(self) -> dict[str, float]:
        """The probe hand-off (once per probed iteration; the copy to the host is here) and its counters."""
        if self._probe is None:
            return {}
        snapshot, self._probe_snapshot = self._probe_snapshot, None
        try:
            if snapshot is None:
                self._probe.poll()
            else:
                self._probe.submit(self._probe_request(snapshot))
        except Exception as exc:  # the probe is an observer: whatever breaks in it is counted, training goes on
            self._probe.record_failure(f"hand-off: {type(exc).__name__}: {exc}")
        return self._probe.metrics()

    def _probe_request(self, snapshot: dict[str, Any]) -> ProbeRequest:
        """The probe request of one snapshot (``on_train_batch``), as plain numpy on the host."""
        return ProbeRequest(
            iteration=self.gradmon_iteration + 1,
            modules=[self._module_probe(mid, part) for mid, part in snapshot["modules"].items()],
            per_module_names=snapshot["per_module_names"],
        )

    def _module_probe(self, module_id: ModuleID, part: dict[str, Any]) -> ModuleProbe:
        import tree

        module = self.module[module_id].unwrapped()
        config = self.config.get_config_for_module(module_id)
        to_host = lambda t: t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)  # noqa: E731
        return ModuleProbe(
            module_id=str(module_id),
            module_spec=RLModuleSpec(
                module_class=type(module),
                observation_space=module.observation_space,
                action_space=module.action_space,
                model_config=module.model_config,
            ),
            weights={k: to_host(v) for k, v in part["weights"].items()},
            batch={k: tree.map_structure(to_host, v) for k, v in part["batch"].items()},
            loss=LossSettings(
                clip_param=float(config.clip_param),
                vf_clip_param=float(config.vf_clip_param),
                vf_loss_coeff=float(config.vf_loss_coeff),
                entropy_coeff=float(part["entropy_coeff"]),
                kl_coeff=float(part["kl_coeff"]),
                use_kl_loss=bool(config.use_kl_loss),
            ),
        )

    @override(Learner)
    def get_state(self, components: Any = None, *, not_components: Any = None, **kwargs: Any) -> StateDict:
        state = super().get_state(components, not_components=not_components, **kwargs)
        if compat.wants_component(self, PROBE_STATE_KEY, components, not_components):
            state[PROBE_STATE_KEY] = {
                "iterations_done": self.gradmon_iteration,
                "counters": self._probe.state_dict() if self._probe is not None else {},
            }
        return state

    @override(Learner)
    def set_state(self, state: StateDict) -> None:
        super().set_state(state)
        if PROBE_STATE_KEY in state and self._probe is not None:
            self._probe.load_state_dict(state[PROBE_STATE_KEY].get("counters", {}))
