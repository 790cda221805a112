"""Users' own RLlib learners that the peer tests wrap with ``with_gradmon``."""

from __future__ import annotations

from typing import Any

import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import ModuleID, ParamDict


class RecordingPPOLearner(PPOTorchLearner):
    """A user's learner: both gradient hooks call super and record that they ran; its
    postprocessing halves the gradients, so a twin matches only if that result is applied."""

    @property
    def calls(self) -> dict[str, int]:
        """How often each override ran."""
        if not hasattr(self, "_calls"):
            self._calls = {"postprocess_gradients_for_module": 0, "apply_gradients": 0}
        return self._calls

    @override(PPOTorchLearner)
    def postprocess_gradients_for_module(
        self, *, module_id: ModuleID, config: Any = None, module_gradients_dict: ParamDict
    ) -> ParamDict:
        self.calls["postprocess_gradients_for_module"] += 1
        grads = super().postprocess_gradients_for_module(
            module_id=module_id, config=config, module_gradients_dict=module_gradients_dict
        )
        return {ref: grad * 0.5 for ref, grad in grads.items()}

    @override(PPOTorchLearner)
    def apply_gradients(self, gradients_dict: ParamDict) -> None:
        self.calls["apply_gradients"] += 1
        super().apply_gradients(gradients_dict)


class FusedAdamPPOLearner(PPOTorchLearner):
    """A user's learner with fused Adam (its ``step`` reads ``found_inf``: gradmon's device-side skip)."""

    @override(PPOTorchLearner)
    def configure_optimizers_for_module(self, module_id: ModuleID, config: Any = None) -> None:
        params = self.get_parameters(self.module[module_id])
        self.register_optimizer(
            module_id=module_id,
            optimizer=torch.optim.Adam(params, fused=True),
            params=params,
            lr_or_lr_schedule=config.lr,
        )
