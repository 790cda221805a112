"""A stock RLlib learner and its ``with_gradmon`` twin, built from one config, fed the same batches.

Everything runs in-process (``config.build_learner``, an EnvRunner in this process); the IMPALA
family's learner thread ``ray.put``s its weights, so those tests take the ``ray_session`` fixture.
Nothing here uses gradmon's own code except ``with_gradmon`` and ``compat.make_train_batch``:
the comparisons read RLlib's state (module ``state_dict``, optimizers' ``state_dict``, KL
coefficients, torch lr schedulers) directly.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
from ray.rllib.algorithms.impala import IMPALAConfig
from ray.rllib.algorithms.impala.torch.impala_torch_learner import IMPALATorchLearner
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.env.multi_agent_env_runner import MultiAgentEnvRunner
from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME, NUM_ENV_STEPS_TRAINED_LIFETIME

from gradmon_ray import compat
from gradmon_ray.rllib import with_gradmon
from gradmon_ray.telemetry.blame import RESULT_KEY

ALGOS: dict[str, tuple[type[AlgorithmConfig], type]] = {
    "ppo": (PPOConfig, PPOTorchLearner),
    "appo": (APPOConfig, APPOTorchLearner),
    "impala": (IMPALAConfig, IMPALATorchLearner),
}
"""Algorithm name -> (its config class, RLlib's torch learner)."""
HEADS = {"pi": r"^pi\.", "vf": r"^vf\."}
"""RLlib's default modules name their policy and value outputs ``pi.*`` and ``vf.*``."""
THREADED = ("appo", "impala")
"""Learners that train in a thread of their own (need a running Ray for ``ray.put``)."""


def agent_policy(agent_id: Any, *args: Any, **kwargs: Any) -> str:
    """Agent ``i`` of ``MultiAgentCartPole`` -> module ``p<i>``."""
    return f"p{agent_id}"


def cartpole_config(
    algo: str,
    learner_class: type,
    *,
    agents: int = 0,
    gradmon: dict[str, Any] | None = None,
    training: dict[str, Any] | None = None,
    experimental: dict[str, Any] | None = None,
    framework: dict[str, Any] | None = None,
    rollout_fragment_length: int = 32,
) -> AlgorithmConfig:
    """A CI-sized CartPole config (``agents`` > 0: ``MultiAgentCartPole``, one module per agent)."""
    config_cls, _ = ALGOS[algo]
    config = config_cls()
    if agents:
        config = config.environment(MultiAgentCartPole, env_config={"num_agents": agents}).multi_agent(
            policies={f"p{i}" for i in range(agents)}, policy_mapping_fn=agent_policy
        )
    else:
        config = config.environment("CartPole-v1")
    config = (
        config.env_runners(num_env_runners=0, rollout_fragment_length=rollout_fragment_length)
        .learners(num_learners=0, learner_class=learner_class, learner_config_dict={"gradmon": gradmon or {}})
        .training(**{"train_batch_size_per_learner": 128, **(training or {})})
        .debugging(seed=0)
    )
    if algo in THREADED:
        # Broadcast (= the learner thread's reduction) after every update: each ``update`` call
        # then waits for its batch to be trained on, so both arms are compared at the same point.
        config = config.training(broadcast_interval=1)
    if algo == "appo":
        # APPO's default CircularBuffer re-samples batches with its own unseeded RNG, in the
        # learner thread, as often as the thread gets to it: no two runs of stock APPO match.
        config = config.training(use_circular_buffer=False)
    if experimental:
        config = config.experimental(**experimental)
    if framework:
        config = config.framework(**framework)
    return config


def spaces_of(config: AlgorithmConfig) -> dict[str, tuple[gym.Space, gym.Space]]:
    """``build_learner(spaces=...)`` for the config's environment."""
    if config.env is MultiAgentCartPole:
        env = MultiAgentCartPole(config.env_config)
        return {agent_policy(i): (env.get_observation_space(i), env.get_action_space(i)) for i in env.agents}
    env = gym.make("CartPole-v1")
    return {DEFAULT_MODULE_ID: (env.observation_space, env.action_space)}


def build_pair(stock_config: AlgorithmConfig, wrapped_config: AlgorithmConfig) -> tuple[Any, Any]:
    """Both learners, the wrapped one holding exactly the stock one's initial module state."""
    stock = stock_config.build_learner(spaces=spaces_of(stock_config))
    wrapped = wrapped_config.build_learner(spaces=spaces_of(wrapped_config))
    # Copied in place (load_state_dict), so the optimizers still hold the same Parameter objects.
    wrapped.module.set_state(stock.module.get_state())
    return stock, wrapped


def gradmon_twin(config: AlgorithmConfig, gradmon: dict[str, Any] | None = None) -> AlgorithmConfig:
    """The same config with ``with_gradmon(<its learner class>)``."""
    twin = copy.deepcopy(config)
    twin.learners(
        learner_class=with_gradmon(config.learner_class),
        learner_config_dict={"gradmon": gradmon if gradmon is not None else {"heads": HEADS}},
    )
    return twin


def sample_batch(config: AlgorithmConfig, learner: Any, num_timesteps: int = 128) -> Any:
    """One train batch: episodes sampled with ``learner``'s weights, through its learner connector."""
    multi = config.env is MultiAgentCartPole
    runner = (MultiAgentEnvRunner if multi else SingleAgentEnvRunner)(config=config)
    try:
        runner.module.set_state(learner.module.get_state(inference_only=True) if multi else _single(learner))
        episodes = runner.sample(num_timesteps=num_timesteps, random_actions=False)
    finally:
        runner.stop()
    return compat.make_train_batch(learner, TrainingData(episodes=episodes))


def _single(learner: Any) -> Any:
    return learner.module[DEFAULT_MODULE_ID].get_state(inference_only=True)


def seed_everything(seed: int) -> None:
    """Python, numpy (RLlib's minibatch shuffle uses ``np.random.permutation``) and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def timesteps_at(step: int, batch_size: int) -> dict[str, int]:
    """The ``timesteps`` an Algorithm passes to ``update`` after ``step`` (1-based) batches."""
    return {NUM_ENV_STEPS_SAMPLED_LIFETIME: step * batch_size, NUM_ENV_STEPS_TRAINED_LIFETIME: step * batch_size}


def seeded_update(learner: Any, algo: str, batch: Any, *, seed: int, step: int, **kwargs: Any) -> dict:
    """One ``update`` on a deep copy of ``batch`` (RLlib shuffles a batch in place) after seeding.

    PPO: ``Learner.update(batch=...)``; IMPALA family: through the learner thread.  Returns the
    reduced results (the thread's reduction for the IMPALA family, ``broadcast_interval=1``).
    """
    own = copy.deepcopy(batch)
    seed_everything(seed)
    timesteps = timesteps_at(step, len(batch))
    if algo in THREADED:
        return learner.update(training_data=TrainingData(batch=own), timesteps=timesteps, **kwargs)
    return learner.update(batch=own, timesteps=timesteps, **kwargs)


def learner_tensors(learner: Any) -> dict[str, Any]:
    """Every piece of training state, flat: name -> tensor (or plain value).

    Module weights (target networks included), each optimizer's per-parameter state and
    param-group hyperparameters, the PPO/APPO KL coefficients and torch lr schedulers' state.
    """
    out: dict[str, Any] = {}
    for mid in learner.module.keys():  # noqa: SIM118 (a MultiRLModule iterates otherwise)
        for name, value in learner.module[mid].unwrapped().state_dict().items():
            out[f"module[{mid}].{name}"] = value
        for opt_name, optimizer in learner.get_optimizers_for_module(mid):
            state = optimizer.state_dict()
            for index, per_param in state["state"].items():
                for key, value in per_param.items():
                    out[f"optimizer[{opt_name}].state[{index}].{key}"] = value
            for g, group in enumerate(state["param_groups"]):
                for key, value in group.items():
                    if key != "params":
                        out[f"optimizer[{opt_name}].param_groups[{g}].{key}"] = value
    for mid, coeff in dict(getattr(learner, "curr_kl_coeffs_per_module", {})).items():
        out[f"kl_coeff[{mid}]"] = coeff
    for mid, by_optimizer in getattr(learner, "_lr_schedulers", {}).items():
        for opt_name, schedulers in by_optimizer.items():
            for i, scheduler in enumerate(schedulers):
                for key, value in scheduler.state_dict().items():
                    out[f"lr_scheduler[{mid}][{opt_name}][{i}].{key}"] = value
    return out


def weights_and_optimizer(learner: Any, clone: bool = False) -> dict[str, Any]:
    """``learner_tensors`` restricted to module weights and optimizer state (``clone``: a snapshot)."""
    state = {k: v for k, v in learner_tensors(learner).items() if k.startswith(("module[", "optimizer["))}
    return {k: v.clone() if clone and isinstance(v, torch.Tensor) else v for k, v in state.items()}


def first_difference(stock: dict[str, Any], wrapped: dict[str, Any]) -> str | None:
    """None when equal bit for bit; else a line naming the first differing entry and by how much."""
    if list(stock) != list(wrapped):
        only_stock, only_wrapped = sorted(set(stock) - set(wrapped)), sorted(set(wrapped) - set(stock))
        return f"different entries: only stock {only_stock}, only wrapped {only_wrapped}"
    for name, a in stock.items():
        b = wrapped[name]
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            a_t, b_t = torch.as_tensor(a), torch.as_tensor(b)
            if a_t.dtype != b_t.dtype or a_t.shape != b_t.shape:
                return f"{name}: stock {a_t.dtype}{tuple(a_t.shape)} vs wrapped {b_t.dtype}{tuple(b_t.shape)}"
            if not torch.equal(a_t, b_t):
                diff = (a_t.double() - b_t.double()).abs()
                return (
                    f"{name}: max |stock - wrapped| = {float(diff.nan_to_num(float('inf')).max()):.3e} "
                    f"over {int((a_t != b_t).sum())} of {a_t.numel()} elements"
                )
        elif a != b and not (_is_nan(a) and _is_nan(b)):
            return f"{name}: stock {a!r} vs wrapped {b!r}"
    return None


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and value != value


def peek(results: dict, module_id: str) -> dict[str, float]:
    """One module's reduced results as plain floats (not the diagnoses: a list of JSON strings)."""
    return {key: float(stats.peek()) for key, stats in results[module_id].items() if key != RESULT_KEY}


def shutdown_all(learners: Iterable[Any]) -> None:
    """Shut every built learner down (the IMPALA family stops its thread here)."""
    for learner in learners:
        if learner is not None:
            learner.shutdown()


def rllib_loss(learner: Any, batch: Any, module_id: str = DEFAULT_MODULE_ID) -> float:
    """RLlib's own ``compute_loss_for_module`` of ``learner`` at its current weights, called directly
    (outside ``update``; no gradient).  Call it on a stock learner: it is the oracle."""
    tensors = dict(learner._convert_batch_type(copy.deepcopy(batch)).policy_batches[module_id])
    module = learner.module[module_id].unwrapped()
    with torch.no_grad():
        loss = learner.compute_loss_for_module(
            module_id=module_id,
            config=learner.config.get_config_for_module(module_id),
            batch=tensors,
            fwd_out=module.forward_train(tensors),
        )
    return float(loss)


_FUSED: dict[type, type] = {}


def fused_adam(learner_cls: type) -> type:
    """``learner_cls`` with fused Adam, as a user who cares about speed configures it."""
    if learner_cls not in _FUSED:

        def configure_optimizers_for_module(self, module_id, config=None) -> None:
            params = self.get_parameters(self.module[module_id])
            optimizer = torch.optim.Adam(params, fused=True)
            self.register_optimizer(
                module_id=module_id, optimizer=optimizer, params=params, lr_or_lr_schedule=config.lr
            )

        _FUSED[learner_cls] = type(
            f"FusedAdam{learner_cls.__name__}",
            (learner_cls,),
            {"configure_optimizers_for_module": configure_optimizers_for_module},
        )
    return _FUSED[learner_cls]
