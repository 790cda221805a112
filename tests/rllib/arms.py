"""The learners the op-count tests compare on one batch (``test_host_reads.py``, ``test_op_budget.py``):
stock PPO with fused Adam, ``with_gradmon`` of it (the drop-in) and ``GradmonPPOTorchLearner``,
their small run config, and the counting of one update."""

from __future__ import annotations

from typing import Any

from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

from gradmon_ray.config import GradmonConfig
from gradmon_ray.rllib import with_gradmon
from gradmon_ray.rllib.local_learner import build_local_learner, local_ppo_config, module_spaces, update
from gradmon_ray.rllib.settings_parsing import drop_in_settings
from gradmon_ray.telemetry.op_counts import OpCounter, counting_calls
from tests.peer.pairs import fused_adam

FusedAdamPPOTorchLearner = fused_adam(PPOTorchLearner)
"""Stock PPO with fused Adam (as ``bench/telemetry_overhead.py``'s ``stock-fused`` arm)."""


def small_config(modules: int, *, minibatches: int, epochs: int = 1, vgs: bool = False) -> GradmonConfig:
    """A 32-unit trunk, ``minibatches`` minibatches of 32 rows per epoch, one module per agent."""
    cfg = GradmonConfig()
    cfg.ppo.minibatch_size, cfg.ppo.train_batch_size, cfg.ppo.num_epochs = 32, 32 * minibatches, epochs
    cfg.model.trunk_hiddens = [32]
    cfg.vgs.enabled = vgs
    if modules > 1:
        cfg.env.id = "gradmon/FactoredOpsMultiAgent-v0"
        cfg.env.config = {"num_agents": modules}
    return cfg


def drop_in(cfg: GradmonConfig, learner_class: type = FusedAdamPPOTorchLearner) -> Any:
    """``with_gradmon(learner_class)`` with the run config's gradmon settings a drop-in reads."""
    config = local_ppo_config(cfg, with_gradmon(learner_class))
    settings = drop_in_settings(config.learner_config_dict["gradmon"])
    return config.learners(learner_config_dict={"gradmon": settings}).build_learner(spaces=module_spaces(cfg))


ARMS = {
    "stock-fused": lambda cfg: build_local_learner(cfg, learner_class=FusedAdamPPOTorchLearner),
    "drop-in": drop_in,
    "gradmon": build_local_learner,
}


def count_update(learner: Any, batch: Any, cfg: GradmonConfig) -> tuple[OpCounter, OpCounter, OpCounter]:
    """Ops inside every ``_update`` call (the minibatches), inside gradmon's norm pass (``_measure``;
    empty for stock) and of the whole ``update``, for a second update on ``batch`` (the first
    builds the norm pass's buffers)."""
    update(learner, batch, cfg)
    per_minibatch, norm_pass = OpCounter(), OpCounter()
    with counting_calls(learner, "_update", per_minibatch), OpCounter() as whole:
        if hasattr(learner, "_measure"):
            with counting_calls(learner, "_measure", norm_pass):
                update(learner, batch, cfg)
        else:
            update(learner, batch, cfg)
    return per_minibatch, norm_pass, whole
