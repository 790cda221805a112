"""The learners of RLlib 2.60's new-API-stack example scripts, rebuilt here, and the oracle that
records, per minibatch, what a learner's per-head gradient norms must be.

RLlib's example scripts (``ray/rllib/examples/learners/*.py`` and friends) ship their custom
learners as example classes; the peer suite (``test_rllib_examples.py``) does not import those:
each learner below is this project's own few lines doing what the example's does (two
optimizers, a weight penalty added to PPO's loss, vanilla policy gradient on returns-to-go, one
optimizer over a shared encoder and two policies).  RLlib's example envs and RLModules are
imported from the installed package where they are library classes.

The oracle (``with_oracle``) is a subclass put OUTSIDE ``with_gradmon(learner)``: before every
minibatch's ``_update`` it runs the module's forward again on a copy of that minibatch, builds
the loss by an independent path (``OracleSpec.loss``: RLlib's own loss of the unwrapped learner
class, or a hand-written one), and takes ``torch.autograd.grad`` of the summed loss (as RLlib's
``compute_gradients`` sums the modules' losses) with respect to the parameters whose
``named_parameters()`` names start with each head's prefix, at the weights the minibatch is
about to train.  Nothing of gradmon's head resolution or norm pass is used.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.callbacks.callbacks import RLlibCallback
from ray.rllib.connectors.learner import ComputeReturnsToGo
from ray.rllib.core import ALL_MODULES
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.env.multi_agent_env import MultiAgentEnv
from ray.rllib.env.multi_agent_env_runner import MultiAgentEnvRunner
from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner
from ray.rllib.utils.typing import ModuleID

from gradmon_ray import compat
from gradmon_ray.rllib import with_gradmon
from tests.peer.pairs import first_difference, learner_tensors, seeded_update, shutdown_all

GLOBAL = "<global>"
"""The oracle's name for a module's global norm (every parameter: the empty prefix)."""

# --- the examples' learners, rebuilt -------------------------------------------------------


class TwoOptimizerPPOLearner(PPOTorchLearner):
    """``separate_vf_lr_and_optimizer.py``: one Adam for actor encoder + ``pi`` (``config.lr``),
    one for critic encoder + ``vf`` (``learner_config_dict["lr_vf"]``); needs ``vf_share_layers=False``."""

    def configure_optimizers_for_module(self, module_id: ModuleID, config: Any = None) -> None:
        module = self.module[module_id]
        groups = {
            "optim_for_pi": (module.encoder.actor_encoder, module.pi, config.lr),
            "optim_for_vf": (module.encoder.critic_encoder, module.vf, config.learner_config_dict.get("lr_vf")),
        }
        for name, (encoder, head, lr) in groups.items():
            params = self.get_parameters(encoder) + self.get_parameters(head)
            self.register_optimizer(
                module_id=module_id,
                optimizer_name=name,
                optimizer=torch.optim.Adam(params),
                params=params,
                lr_or_lr_schedule=lr,
            )


def mean_weight(parameters: list[torch.Tensor]) -> torch.Tensor:
    """The mean over parameter tensors of each tensor's mean (the example's regularizer)."""
    return torch.stack([w.mean() for w in parameters]).mean()


class WeightPenaltyPPOLearner(PPOTorchLearner):
    """``ppo_with_custom_loss_fn.py``: PPO's loss + ``regularizer_coeff`` x the mean weight."""

    def compute_loss_for_module(self, *, module_id: ModuleID, config: Any, batch: dict, fwd_out: dict) -> Any:
        loss = super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)
        penalty = mean_weight(self.get_parameters(self.module[module_id]))
        self.metrics.log_value((module_id, "mean_weight"), penalty, window=1)
        return loss + config.learner_config_dict["regularizer_coeff"] * penalty


class ReturnsToGoVPGLearner(TorchLearner):
    """The VPG learner of ``shared_encoder_cartpole.py``: -mean(log pi(a|s) x return-to-go)."""

    def build(self) -> None:
        super().build()
        if self.config.add_default_connectors_to_learner_pipeline:
            self._learner_connector.prepend(ComputeReturnsToGo(gamma=self.config.gamma))

    def compute_loss_for_module(self, *, module_id: ModuleID, config: Any, batch: dict, fwd_out: dict) -> Any:
        dist = self.module[module_id].get_train_action_dist_cls().from_logits(fwd_out[Columns.ACTION_DIST_INPUTS])
        return -torch.mean(dist.logp(batch[Columns.ACTIONS]) * batch[Columns.RETURNS_TO_GO])


class SharedOptimizerVPGLearner(ReturnsToGoVPGLearner):
    """``VPGTorchLearnerSharedOptimizer``: ONE Adam over every module (shared encoder and policies),
    registered for all modules at once (RLlib's ``ALL_MODULES``), not per module."""

    def configure_optimizers(self) -> None:
        params = [p for m in self.module.values() if self.rl_module_is_compatible(m) for p in m.parameters()]
        self.register_optimizer(
            optimizer_name="shared_optimizer",
            optimizer=torch.optim.Adam(params),
            params=params,
            lr_or_lr_schedule=self.config.lr,
        )


def vpg_oracle_loss(learner: Any, module_id: ModuleID, batch: Mapping, fwd_out: Mapping) -> torch.Tensor:
    """VPG's loss by hand: ``torch.distributions.Categorical`` on the logits, not RLlib's classes."""
    dist = torch.distributions.Categorical(logits=fwd_out[Columns.ACTION_DIST_INPUTS])
    return -(dist.log_prob(batch[Columns.ACTIONS].long()) * batch[Columns.RETURNS_TO_GO]).mean()


# --- the oracle ----------------------------------------------------------------------------

LossFn = Callable[[Any, ModuleID, Mapping, Mapping], torch.Tensor]


OracleHead = str | tuple[str, int, int]
"""A head: a ``named_parameters()`` prefix, or ``(prefix, lo, hi)``: rows ``lo:hi`` of each such parameter."""


@dataclass(frozen=True)
class OracleSpec:
    """What the oracle computes: ``loss(learner, module_id, batch, fwd_out)`` per module in the
    forward output, and per module id the heads (``OracleHead``)."""

    loss: LossFn
    heads: Mapping[ModuleID, Mapping[str, OracleHead]]


def rllib_loss_of(learner_cls: type) -> LossFn:
    """The loss of ``learner_cls`` itself (RLlib's own or an example's), called on the class so
    that a subclass's override (gradmon's) is skipped."""

    def loss(learner: Any, module_id: ModuleID, batch: Mapping, fwd_out: Mapping) -> torch.Tensor:
        config = learner.config.get_config_for_module(module_id)
        return learner_cls.compute_loss_for_module(
            learner, module_id=module_id, config=config, batch=batch, fwd_out=fwd_out
        )

    return loss


def _copy(batch: Any) -> Any:
    """New dicts all the way down (example modules pop keys from nested dicts), same tensors."""
    return {k: _copy(v) for k, v in batch.items()} if isinstance(batch, Mapping) else batch


class OracleRecorder:
    """Records the oracle's norms of every minibatch: ``oracle_updates[-1]`` is the last ``update``
    call's list of ``{module_id: {head: norm}}``, one per minibatch, for the modules the minibatch's
    loss reaches (a module without rows, or not to be trained, is left out)."""

    oracle: OracleSpec

    def update(self, *args: Any, **kwargs: Any) -> Any:
        self.oracle_updates = [*getattr(self, "oracle_updates", []), []]
        return super().update(*args, **kwargs)

    def _update(self, batch: dict, **kwargs: Any) -> Any:
        self.oracle_updates[-1].append(self._oracle_norms(batch))
        return super()._update(batch, **kwargs)

    def _oracle_norms(self, batch: dict) -> dict[ModuleID, dict[str, float]]:
        tensors = _copy(batch)
        fwd_out = self.module.forward_train(tensors)
        total = sum(self.oracle.loss(self, mid, tensors[mid], fwd_out[mid]) for mid in fwd_out)
        out: dict[ModuleID, dict[str, float]] = {}
        for mid, heads in self.oracle.heads.items():
            if mid not in self.module.keys():  # noqa: SIM118 (a MultiRLModule iterates otherwise)
                continue
            named = dict(self.module[mid].unwrapped().named_parameters())
            norms = {h: _norm(total, named, head) for h, head in heads.items()}
            if not all(math.isnan(v) for v in norms.values()):  # a module the loss reaches: it trains
                out[mid] = norms
        return out


def _norm(total: torch.Tensor, named: Mapping[str, torch.Tensor], head: OracleHead) -> float:
    """autograd's L2 norm over the parameters named ``prefix...`` (only rows ``lo:hi`` of each, for
    a ``(prefix, lo, hi)`` head)."""
    prefix, rows = (head, slice(None)) if isinstance(head, str) else (head[0], slice(head[1], head[2]))
    params = [p for n, p in named.items() if n.startswith(prefix)]
    assert params, "an oracle head prefix matched no parameter"
    grads = torch.autograd.grad(total, params, retain_graph=True, allow_unused=True)
    used = [g[rows] for g in grads if g is not None]
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in used)) if used else math.nan


def with_oracle(learner_cls: type, oracle: OracleSpec) -> type:
    """``learner_cls`` (a ``with_gradmon`` class) with the oracle recorded before each minibatch."""
    return type(f"Oracle{learner_cls.__name__}", (OracleRecorder, learner_cls), {"oracle": oracle})


def expected_means(minibatches: list[dict[ModuleID, dict[str, float]]], module_id: ModuleID) -> dict[str, float]:
    """gradmon's documented reduction of a step: per head, the mean over the minibatches that held
    the module, NaN minibatches left out."""
    rows = [mb[module_id] for mb in minibatches if module_id in mb]
    assert rows, f"no minibatch held {module_id}"
    out = {}
    for head in rows[0]:
        values = [r[head] for r in rows if not math.isnan(r[head])]
        out[head] = sum(values) / len(values) if values else math.nan
    return out


# --- in-process learner pairs (observe-only) -----------------------------------------------


def env_runner(config: Any) -> Any:
    """An in-process EnvRunner for ``config`` (multi-agent or not)."""
    return (MultiAgentEnvRunner if config.is_multi_agent else SingleAgentEnvRunner)(config=config)


def sample_with(runner: Any, learner: Any, num_timesteps: int) -> Any:
    """One train batch sampled with ``learner``'s weights, through its learner connector."""
    state = learner.module.get_state(inference_only=True)
    runner.module.set_state(state if isinstance(runner, MultiAgentEnvRunner) else next(iter(state.values())))
    episodes = runner.sample(num_timesteps=num_timesteps, random_actions=False)
    return compat.make_train_batch(learner, TrainingData(episodes=episodes))


MINIBATCHES = {"num_epochs": 2, "minibatch_size": 32, "shuffle_batch_per_epoch": True}
"""Each observe-only update: 2 epochs of 32-row minibatches, reshuffled (RLlib's np.random)."""


def observe_only_difference(config: Any, gradmon: dict[str, Any], *, updates: int = 2) -> str | None:
    """None when ``with_gradmon(config.learner_class)`` trains bit for bit like the learner itself
    on one sampled batch for ``updates`` seeded multi-epoch updates; else the first difference
    (``pairs.first_difference``: weights, every optimizer's state, lr schedulers, KL coefficients)."""
    runner = env_runner(config)
    stock = wrapped = None
    try:
        spaces = runner.get_spaces()
        stock = config.build_learner(spaces=spaces)
        twin = copy.deepcopy(config)
        extra = dict(config.learner_config_dict)
        twin.learners(
            learner_class=with_gradmon(config.learner_class), learner_config_dict={**extra, "gradmon": gradmon}
        )
        wrapped = twin.build_learner(spaces=spaces)
        wrapped.module.set_state(stock.module.get_state())  # in place: the optimizers keep their Parameters
        batch = sample_with(runner, stock, num_timesteps=64)
        before = {k: v.clone() for k, v in _all_state(stock).items() if k.startswith("module[")}
        for step in range(1, updates + 1):
            for learner in (stock, wrapped):
                seeded_update(learner, "ppo", batch, seed=100 + step, step=step, **MINIBATCHES)
            diff = first_difference(_all_state(stock), _all_state(wrapped))
            if diff is not None:
                return f"after update {step}: {diff}"
        optimizer_steps = [
            k for k, v in _all_state(stock).items() if k.startswith("optimizer[") and k.endswith(".step")
        ]
        after = {k: v for k, v in _all_state(stock).items() if k.startswith("module[")}
        assert optimizer_steps and first_difference(before, after), "nothing trained: a vacuous check"
        return None
    finally:
        runner.stop()
        shutdown_all([stock, wrapped])


def _all_state(learner: Any) -> dict[str, Any]:
    """``pairs.learner_tensors`` plus the optimizers registered for all modules at once."""
    out = learner_tensors(learner)
    for name, optimizer in learner.get_optimizers_for_module(ALL_MODULES):
        for index, per_param in optimizer.state_dict()["state"].items():
            out.update({f"optimizer[{name}].state[{index}].{key}": v for key, v in per_param.items()})
    return out


class TwoSpacesEnv(MultiAgentEnv):
    """``different_spaces_for_agents.py``'s env (its own class lives in the script): ``agent0``
    sees Box(10,) and picks Discrete(2), ``agent1`` sees Box(20,) and picks Discrete(3); zero
    rewards; here episodes end after ``LENGTH`` steps (the example's never end)."""

    LENGTH = 16

    def __init__(self, config: dict | None = None) -> None:
        self.agents = self.possible_agents = ["agent0", "agent1"]
        box = gym.spaces.Box
        self.observation_spaces = {"agent0": box(-1.0, 1.0, (10,)), "agent1": box(-1.0, 1.0, (20,))}
        self.action_spaces = {"agent0": gym.spaces.Discrete(2), "agent1": gym.spaces.Discrete(3)}
        super().__init__()
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self._steps = 0
        if seed is not None:
            for space in self.observation_spaces.values():
                space.seed(seed)
        return {a: self.get_observation_space(a).sample() for a in self.agents}, {}

    def step(self, action_dict: dict) -> tuple[dict, dict, dict, dict, dict]:
        self._steps += 1
        obs = {a: self.get_observation_space(a).sample() for a in action_dict}
        done = self._steps >= self.LENGTH
        return obs, dict.fromkeys(action_dict, 0.0), {"__all__": done}, {"__all__": False}, {}


def main_vs(opponent: str) -> Callable[..., str]:
    """Self-play mapping: per episode, one seat plays ``main`` and the other ``opponent``."""

    def mapping(agent_id: Any, episode: Any, **kwargs: Any) -> str:
        return "main" if hash(episode.id_) % 2 == int(agent_id[-1]) - 1 else opponent

    return mapping


class SnapshotAtIteration(RLlibCallback):
    """The self-play pattern of ``self_play_with_open_spiel.py`` (its ``SelfPlayCallback``): after
    iteration ``AT``, ``algorithm.add_module`` adds ``main_v1``, a copy of ``main`` with main's
    weights, and maps main's opponents to it.  ``TRAIN_SNAPSHOT`` also trains the snapshot
    (``new_should_module_be_updated``), as a league would."""

    AT = 1
    TRAIN_SNAPSHOT = False

    def on_train_result(self, *, algorithm: Any, metrics_logger: Any = None, result: dict, **kwargs: Any) -> None:
        if algorithm.iteration != self.AT:
            return
        main = algorithm.get_module("main")
        algorithm.add_module(
            module_id="main_v1",
            module_spec=RLModuleSpec.from_module(main),
            new_agent_to_module_mapping_fn=main_vs("main_v1"),
            new_should_module_be_updated=["main", "main_v1"] if self.TRAIN_SNAPSHOT else None,
        )
        algorithm.set_state({"learner_group": {"learner": {"rl_module": {"main_v1": main.get_state()}}}})


class TrainedSnapshotAtIteration(SnapshotAtIteration):
    """``SnapshotAtIteration`` whose snapshot trains from its first iteration on."""

    TRAIN_SNAPSHOT = True
