"""``PPOAnalysisLosses``: gradmon's PPO loss for the analyses that re-run a minibatch.

A mixin of ``GradmonPPOTorchLearner``: the diagnosis of a non-finite event takes each term's
gradient alone (``diagnosis_loss_terms``: unweighted, one masked mean per term), the shared-gradient
analysis each module's whole loss (``module_loss``: coefficients and regularizers, what training
minimises).  Neither records anything for the telemetry (the learner's own
``compute_loss_for_module`` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import ModuleID

from gradmon_ray.losses.ppo import PPOLossTerms, ppo_loss_from_batch
from gradmon_ray.rllib.diagnosis_hooks import GradmonDiagnosis


class PPOAnalysisLosses(GradmonDiagnosis):
    """The PPO learner's losses for the re-runs (needs ``GradmonPPOTorchLearner``'s schedules and regularizers)."""

    def _ppo_terms(
        self,
        module_id: ModuleID,
        module: Any,
        batch: Mapping[str, Any],
        fwd_out: Mapping[str, Any],
        *,
        config: Any = None,
        logits: torch.Tensor | None = None,
        separate: bool = False,
    ) -> PPOLossTerms:
        """gradmon's PPO loss of ``module`` on ``batch``, term by term, with the learner's coefficients
        (``config``: the module's, looked up when not given; ``logits``: the loss's own, see
        ``GradmonPPOTorchLearner.logits_for_loss``)."""
        config = config if config is not None else self.config.get_config_for_module(module_id)
        return ppo_loss_from_batch(
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
            separate_means=separate,  # the diagnosis: each term's gradient alone (a stacked mean mixes NaN in)
        )

    @override(GradmonDiagnosis)
    def module_loss(self, module_id: ModuleID, batch: Mapping[str, Any], fwd_out: Mapping[str, Any]) -> torch.Tensor:
        """gradmon's PPO loss with its coefficients, plus the regularizers (what training minimises)."""
        module = self.module[module_id].unwrapped()
        return self._with_regularizers(self._ppo_terms(module_id, module, batch, fwd_out).total, module, batch, fwd_out)

    def _with_regularizers(
        self, total: torch.Tensor, module: Any, batch: Mapping[str, Any], fwd_out: Mapping[str, Any]
    ) -> torch.Tensor:
        """``total`` plus each configured regularizer times its weight (no op without any)."""
        for spec in self._regularizers:
            total = total + spec.weight * spec.fn(module, batch, fwd_out)
        return total

    @override(GradmonDiagnosis)
    def diagnosis_loss_terms(
        self, module_id: ModuleID, module: Any, batch: Mapping[str, Any], fwd_out: Mapping[str, Any]
    ) -> dict[str, torch.Tensor]:
        """gradmon's PPO loss term by term (unweighted), then each regularizer by its name."""
        terms = self._ppo_terms(module_id, module, batch, fwd_out, separate=True)
        out = {"policy": terms.policy, "value": terms.value, "entropy": terms.entropy}
        if self.config.get_config_for_module(module_id).use_kl_loss:
            out["kl"] = terms.kl
        for spec in self._regularizers:
            out[spec.name] = spec.fn(module, batch, fwd_out)
        return out
