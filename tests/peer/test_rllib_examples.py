"""RLlib 2.60's own new-API-stack example scripts, as scenarios, with the learner wrapped by
``with_gradmon`` (issue 36, item 7).  Outcomes and limits: docs/rllib_examples.md.

Each scenario is the example's config made CI-sized (one local learner, the EnvRunner in this
process, ~64-128-step batches, one epoch) and trained for 2+ ``algo.train()`` iterations on the
suite's shared Ray.  Every trained module's ``result["learners"][module_id]`` per-head gradient
norms (and global norm) must equal the oracle (``rllib_examples.with_oracle``): autograd of an
independently built loss at the weights each minibatch trained from, averaged over the
iteration's minibatches as documented (``grad/head/<head>/norm``: mean over minibatches).
The examples with custom learners also train bit for bit like the unwrapped learner
(observe-only, in-process, no Ray).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import pytest
import torch
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.connectors.env_to_module import FlattenObservations
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.learner.learner import DEFAULT_OPTIMIZER
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
from ray.rllib.core.rl_module.multi_rl_module import MultiRLModuleSpec
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.examples.algorithms.classes.vpg import VPGConfig
from ray.rllib.examples.envs.classes.action_mask_env import ActionMaskEnv
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
from ray.rllib.examples.envs.classes.multi_agent.rock_paper_scissors import RockPaperScissors
from ray.rllib.examples.envs.classes.multi_agent.tic_tac_toe import TicTacToe
from ray.rllib.examples.envs.classes.multi_agent.two_step_game import TwoStepGameWithGroupedAgents
from ray.rllib.examples.envs.classes.stateless_cartpole import StatelessCartPole
from ray.rllib.examples.rl_modules.classes.action_masking_rlm import ActionMaskingTorchRLModule
from ray.rllib.examples.rl_modules.classes.lstm_containing_rlm import LSTMContainingRLModule
from ray.rllib.examples.rl_modules.classes.random_rlm import RandomRLModule
from ray.rllib.examples.rl_modules.classes.vpg_using_shared_encoder_rlm import (
    SHARED_ENCODER_ID,
    SharedEncoder,
    VPGMultiRLModuleWithSharedEncoder,
    VPGPolicyAfterSharedEncoder,
)

from gradmon_ray import metric_names as mn
from gradmon_ray.rllib import with_gradmon
from tests.peer.pairs import shutdown_all
from tests.peer.rllib_examples import (
    GLOBAL,
    OracleSpec,
    SharedOptimizerVPGLearner,
    SnapshotAtIteration,
    TrainedSnapshotAtIteration,
    TwoOptimizerPPOLearner,
    TwoSpacesEnv,
    WeightPenaltyPPOLearner,
    env_runner,
    expected_means,
    main_vs,
    observe_only_difference,
    rllib_loss_of,
    sample_with,
    vpg_oracle_loss,
    with_oracle,
)

RTOL = 1e-5
"""Float32 norms in the learner against float64 sums of the same float32 gradients."""
TINY = {"train_batch_size_per_learner": 128, "minibatch_size": 64, "num_epochs": 1}
"""Two minibatches per iteration: the mean over minibatches is exercised, not just one value."""
PPO_HEADS = {"pi": "pi.", "vf": "vf.", GLOBAL: ""}
"""RLlib's default PPO module: ``pi`` (one Linear without head hiddens) and ``vf``, by name."""


def _metric(head: str) -> str:
    return mn.GLOBAL_GRAD_NORM if head == GLOBAL else mn.head_metric(mn.HEAD_GRAD_NORM, head)


@dataclass
class Iteration:
    """One ``algo.train()``: its ``result["learners"]`` and the oracle's minibatches."""

    learners: dict[str, Any]
    minibatches: list[dict[str, dict[str, float]]]

    def trained(self) -> set[str]:
        """The modules some minibatch of this iteration trained."""
        return {mid for mb in self.minibatches for mid in mb}


def train_against_oracle(
    config: AlgorithmConfig,
    learner_cls: type,
    oracle: OracleSpec,
    gradmon: dict[str, Any] | None = None,
    *,
    iterations: int = 2,
    between: Callable[[Any, int], None] | None = None,
) -> list[Iteration]:
    """Train ``with_oracle(with_gradmon(learner_cls))`` for ``iterations``; after each, assert every
    trained oracle module's reported norms equal the oracle (``between(algo, iteration)`` runs
    before training, as iteration 0, and after each check)."""
    extra = dict(config.learner_config_dict)
    config.learners(
        num_learners=0,
        learner_class=with_oracle(with_gradmon(learner_cls), oracle),
        learner_config_dict={**extra, "gradmon": gradmon or {}},
    )
    algo = config.build_algo()
    out = []
    try:
        if between is not None:
            between(algo, 0)
        for iteration in range(1, iterations + 1):
            learners = algo.train()["learners"]
            minibatches = local_learner(algo).oracle_updates[-1]
            assert minibatches and all(minibatches), f"iteration {iteration}: no module trained"
            for mid in oracle.heads:
                if not any(mid in mb for mb in minibatches):
                    continue  # not trained this iteration (the caller asserts which must be)
                for head, norm in expected_means(minibatches, mid).items():
                    got = learners[mid][_metric(head)]
                    assert got == pytest.approx(norm, rel=RTOL), (iteration, mid, head, got, norm)
            out.append(Iteration(dict(learners), minibatches))
            if between is not None:
                between(algo, iteration)
    finally:
        algo.stop()
    return out


def _norms_reported(learners: dict[str, Any], module_id: str) -> dict[str, float]:
    """The module's gradient norms that are numbers (an untrained module's are NaN or absent:
    ``test_a_module_outside_policies_to_train_raises_no_missing_gradient_health``)."""
    norms = {k: v for k, v in learners.get(module_id, {}).items() if k.startswith("grad/") and k.endswith("norm")}
    return {k: v for k, v in norms.items() if not math.isnan(v)}


def local_learner(algo: Any) -> Any:
    """The algorithm's one (local, ``num_learners=0``) learner, through RLlib's public call."""
    (learner,) = [r.get() for r in algo.learner_group.foreach_learner(lambda learner: learner)]
    return learner


def _ppo_cartpole(**training: Any) -> PPOConfig:
    return (
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=0, rollout_fragment_length=64)
        .training(**{**TINY, **training})
        .debugging(seed=0)
    )


# --- learners/separate_vf_lr_and_optimizer.py ----------------------------------------------


@pytest.mark.e2e
def test_separate_vf_optimizer_two_optimizers_one_module(ray_session) -> None:
    """Two optimizers (two lrs) in one module: norms are per module, whatever the optimizers."""
    config = _ppo_cartpole(vf_loss_coeff=1.0, lr=1e-3).rl_module(model_config=DefaultModelConfig(vf_share_layers=False))
    config.learners(learner_config_dict={"lr_vf": 5e-4})
    heads = {**PPO_HEADS, "actor": "encoder.actor_encoder.", "critic": "encoder.critic_encoder."}
    gradmon = {"heads": {h: "^" + p.replace(".", r"\.") for h, p in heads.items() if h != GLOBAL}}
    oracle = OracleSpec(rllib_loss_of(TwoOptimizerPPOLearner), {DEFAULT_MODULE_ID: heads})
    run = train_against_oracle(config, TwoOptimizerPPOLearner, oracle, gradmon)
    assert all(len(it.minibatches) >= 2 for it in run)  # the mean over minibatches is exercised


# --- learners/ppo_with_custom_loss_fn.py ----------------------------------------------------


def penalised_ppo_loss(learner: Any, module_id: str, batch: Any, fwd_out: Any) -> Any:
    """The oracle's loss: RLlib's PPO loss + coeff x the mean weight, the penalty written here."""
    config = learner.config.get_config_for_module(module_id)
    base = PPOTorchLearner.compute_loss_for_module(
        learner, module_id=module_id, config=config, batch=batch, fwd_out=fwd_out
    )
    params = list(learner.module[module_id].parameters())
    penalty = sum(p.mean() for p in params) / len(params)
    return base + config.learner_config_dict["regularizer_coeff"] * penalty


@pytest.mark.e2e
def test_custom_loss_fn_weight_penalty_is_in_the_norms(ray_session) -> None:
    """A loss term the learner adds (a weight penalty) is in the measured gradient."""
    config = _ppo_cartpole(vf_loss_coeff=0.01, lr=0.01).rl_module(model_config=DefaultModelConfig(vf_share_layers=True))
    config.learners(learner_config_dict={"regularizer_coeff": 0.02})
    heads = {**PPO_HEADS, "trunk": "encoder.encoder."}
    gradmon = {"heads": {"pi": r"^pi\.", "vf": r"^vf\.", "trunk": r"^encoder\.encoder\."}}
    oracle = OracleSpec(penalised_ppo_loss, {DEFAULT_MODULE_ID: heads})
    run = train_against_oracle(config, WeightPenaltyPPOLearner, oracle, gradmon)
    assert all("mean_weight" in it.learners[DEFAULT_MODULE_ID] for it in run)  # the example's own metric


# --- learners/ppo_with_torch_lr_schedulers.py -----------------------------------------------

LR, FACTOR, TOTAL_ITERS, GAMMA = 0.03, 0.9, 2, 0.99


@pytest.mark.e2e
def test_torch_lr_schedulers_chain_and_zero_config_heads(ray_session) -> None:
    """ConstantLR then ExponentialLR, stepped once per update: the example's own lr check (its
    ``LRChecker`` closed form) holds with gradmon, and zero-config heads equal the oracle."""
    config = (
        _ppo_cartpole(lr=LR, vf_loss_coeff=0.01)
        .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[32], fcnet_activation="linear", vf_share_layers=True))
        .experimental(
            _torch_lr_scheduler_classes=[
                functools.partial(torch.optim.lr_scheduler.ConstantLR, factor=FACTOR, total_iters=TOTAL_ITERS),
                functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=GAMMA),
            ]
        )
    )
    lrs = []

    def read_lr(algo: Any, iteration: int) -> None:
        if iteration:
            lrs.append(local_learner(algo).get_optimizer(DEFAULT_MODULE_ID, DEFAULT_OPTIMIZER).param_groups[0]["lr"])

    oracle = OracleSpec(rllib_loss_of(PPOTorchLearner), {DEFAULT_MODULE_ID: PPO_HEADS})
    train_against_oracle(config, PPOTorchLearner, oracle, iterations=3, between=read_lr)
    expected = [LR * (FACTOR if i < TOTAL_ITERS else 1.0) * GAMMA**i for i in (1, 2, 3)]
    assert lrs == pytest.approx(expected, rel=1e-9, abs=1e-9)


# --- rl_modules/action_masking_rl_module.py -------------------------------------------------


@pytest.mark.e2e
def test_action_masking_module_zero_config_heads(ray_session) -> None:
    """Masked logits (FLOAT_MIN added to invalid actions) over 100 actions, Dict observations;
    the zero-config ``pi`` head is the policy's output layer, the last Linear of ``pi``."""
    config = (
        _ppo_cartpole()
        .environment(
            ActionMaskEnv,
            env_config={"action_space": gym.spaces.Discrete(100), "observation_space": gym.spaces.Box(-1.0, 1.0, (5,))},
        )
        .rl_module(
            rl_module_spec=RLModuleSpec(
                module_class=ActionMaskingTorchRLModule,
                model_config={"head_fcnet_hiddens": [16], "head_fcnet_activation": "relu", "fcnet_hiddens": [32]},
            )
        )
    )
    # pi.net.mlp: 0 = the hidden Linear, 2 = the output Linear (after the ReLU at 1).
    heads = {"pi": "pi.net.mlp.2.", "vf": "vf.", GLOBAL: ""}
    oracle = OracleSpec(rllib_loss_of(PPOTorchLearner), {DEFAULT_MODULE_ID: heads})
    run = train_against_oracle(config, PPOTorchLearner, oracle)
    assert all(it.learners[DEFAULT_MODULE_ID][mn.head_metric(mn.HEAD_NAN_LATCH, "policy")] == 0.0 for it in run)


# --- rl_modules/custom_lstm_rl_module.py ----------------------------------------------------


@pytest.mark.e2e
def test_custom_lstm_module_time_ranked_batches(ray_session) -> None:
    """A recurrent module: [B, T] batches zero-padded to max_seq_len, a loss mask, state-ins."""
    config = (
        _ppo_cartpole(lr=9e-4, vf_loss_coeff=1e-3, entropy_coeff=0.0)
        .environment(StatelessCartPole)
        .rl_module(
            rl_module_spec=RLModuleSpec(
                module_class=LSTMContainingRLModule,
                model_config={"lstm_cell_size": 16, "dense_layers": [16], "max_seq_len": 20},
            )
        )
    )
    # Zero-config: a custom module's top-level children are its heads, named as they are.
    heads = {"_lstm": "_lstm.", "_fc_net": "_fc_net.", "_pi_head": "_pi_head.", "_values": "_values.", GLOBAL: ""}
    oracle = OracleSpec(rllib_loss_of(PPOTorchLearner), {DEFAULT_MODULE_ID: heads})
    train_against_oracle(config, PPOTorchLearner, oracle)


# --- multi_agent/different_spaces_for_agents.py ---------------------------------------------


@pytest.mark.e2e
def test_different_spaces_for_agents_only_the_trained_module_is_reported(ray_session) -> None:
    """Two modules of different spaces, ``policies_to_train=["main0"]``: main0's norms equal the
    oracle; main1 is never trained, reports no gradient norm, and keeps its weights."""
    config = (
        _ppo_cartpole()
        .environment(TwoSpacesEnv)
        .multi_agent(
            policies={"main0", "main1"},
            policy_mapping_fn=lambda aid, episode, **kw: f"main{aid[-1]}",
            policies_to_train=["main0"],
        )
    )
    oracle = OracleSpec(rllib_loss_of(PPOTorchLearner), {"main0": PPO_HEADS, "main1": PPO_HEADS})
    frozen: list[dict[str, torch.Tensor]] = []

    def keep_main1(algo: Any, iteration: int) -> None:
        frozen.append({k: v.clone() for k, v in local_learner(algo).module["main1"].state_dict().items()})

    run = train_against_oracle(config, PPOTorchLearner, oracle, iterations=3, between=keep_main1)
    assert [it.trained() for it in run] == [{"main0"}] * 3
    assert [_norms_reported(it.learners, "main1") for it in run] == [{}] * 3, "main1 is never trained"
    assert all(torch.equal(frozen[0][k], later[k]) for later in frozen[1:] for k in later)


# --- multi_agent/shared_encoder_cartpole.py -------------------------------------------------


def _shared_encoder_spec() -> MultiRLModuleSpec:
    cartpole = gym.make("CartPole-v1")
    policy = RLModuleSpec(module_class=VPGPolicyAfterSharedEncoder, model_config={"embedding_dim": 8, "hidden_dim": 16})
    return MultiRLModuleSpec(
        multi_rl_module_class=VPGMultiRLModuleWithSharedEncoder,
        rl_module_specs={
            SHARED_ENCODER_ID: RLModuleSpec(
                module_class=SharedEncoder,
                model_config={"embedding_dim": 8},
                observation_space=cartpole.observation_space,
                action_space=cartpole.action_space,
            ),
            "p0": policy,
            "p1": policy,
        },
    )


SHARED_ENCODER_GRADMON = {
    "per_module": {
        SHARED_ENCODER_ID: {"heads": {"net": r"^_net\."}},
        "p0": {"heads": {"pi": r"^_pi_head\."}},
        "p1": {"heads": {"pi": r"^_pi_head\."}},
    }
}


def _shared_encoder_config() -> VPGConfig:
    return (
        VPGConfig()
        .environment(MultiAgentCartPole, env_config={"num_agents": 2})
        .env_runners(num_env_runners=0)
        .training(num_episodes_per_train_batch=4, lr=1e-2)
        .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=lambda agent_id, episode, **kw: f"p{agent_id}")
        .rl_module(rl_module_spec=_shared_encoder_spec())
        .debugging(seed=0)
    )


@pytest.mark.e2e
def test_shared_encoder_vpg_one_optimizer_for_all_modules(ray_session) -> None:
    """VPG, an encoder module shared by two policy modules, ONE optimizer for all of them: each
    policy's norms are its own loss's; the encoder (no loss of its own) gets both losses' sum."""
    per_policy = {"_pi_head": "_pi_head.", GLOBAL: ""}  # zero-config: each module's children
    heads = {"p0": per_policy, "p1": per_policy, SHARED_ENCODER_ID: {"_net": "_net.", GLOBAL: ""}}
    oracle = OracleSpec(vpg_oracle_loss, heads)
    run = train_against_oracle(_shared_encoder_config(), SharedOptimizerVPGLearner, oracle)
    assert all(it.trained() == {"p0", "p1", SHARED_ENCODER_ID} for it in run)


# --- multi_agent/two_step_game_with_grouped_agents.py ---------------------------------------


@pytest.mark.e2e
def test_two_step_game_grouped_agents_tuple_action_space(ray_session) -> None:
    """Two agents grouped into one (Tuple observation and action spaces, flattened observations):
    one module whose action distribution is RLlib's multi-distribution over a Tuple."""
    config = (
        _ppo_cartpole(train_batch_size_per_learner=64, minibatch_size=32)
        .environment(TwoStepGameWithGroupedAgents)
        .env_runners(env_to_module_connector=lambda env, spaces, device: FlattenObservations(multi_agent=True))
        .multi_agent(policies={"p0"}, policy_mapping_fn=lambda aid, *a, **kw: "p0")
        .rl_module(rl_module_spec=MultiRLModuleSpec(rl_module_specs={"p0": RLModuleSpec()}))
    )
    # Zero-config: one head per Tuple component (RLlib's multi-distribution's rows of pi), then vf.
    heads = {"a0": ("pi.", 0, 2), "a1": ("pi.", 2, 4), "vf": "vf.", GLOBAL: ""}
    oracle = OracleSpec(rllib_loss_of(PPOTorchLearner), {"p0": heads})
    run = train_against_oracle(config, PPOTorchLearner, oracle)
    assert all(it.trained() == {"p0"} for it in run)


# --- multi_agent/rock_paper_scissors_learned_vs_learned.py ----------------------------------


@pytest.mark.e2e
def test_rock_paper_scissors_learned_vs_learned(ray_session) -> None:
    """Two learning PPO modules playing each other (RLlib's built-in rock-paper-scissors: the
    example's PettingZoo ``rps_v2`` is not installed), zero-config heads per module."""
    config = (
        _ppo_cartpole(vf_loss_coeff=0.005)
        .environment(RockPaperScissors)
        .env_runners(env_to_module_connector=lambda env, spaces, device: FlattenObservations(multi_agent=True))
        .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=lambda aid, episode, **kw: f"p{int(aid[-1]) - 1}")
        .rl_module(
            model_config=DefaultModelConfig(fcnet_hiddens=[32], vf_share_layers=True),
            rl_module_spec=MultiRLModuleSpec(rl_module_specs={"p0": RLModuleSpec(), "p1": RLModuleSpec()}),
        )
    )
    oracle = OracleSpec(rllib_loss_of(PPOTorchLearner), {"p0": PPO_HEADS, "p1": PPO_HEADS})
    run = train_against_oracle(config, PPOTorchLearner, oracle)
    assert all(it.trained() == {"p0", "p1"} for it in run)
    last = run[-1].learners
    assert last["p0"][_metric("pi")] != last["p1"][_metric("pi")]  # each module its own numbers


# --- multi_agent/self_play_with_open_spiel.py (OpenSpiel is not installed: tic-tac-toe) ------


def _self_play_config(callback: type) -> PPOConfig:
    return (
        _ppo_cartpole()
        .environment(TicTacToe)
        .callbacks(callback)
        .multi_agent(policies={"main", "random"}, policy_mapping_fn=main_vs("random"), policies_to_train=["main"])
        .rl_module(
            model_config=DefaultModelConfig(fcnet_hiddens=[32]),
            rl_module_spec=MultiRLModuleSpec(
                rl_module_specs={"main": RLModuleSpec(), "random": RLModuleSpec(module_class=RandomRLModule)}
            ),
        )
    )


def _weights(algo: Any, module_id: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in local_learner(algo).module[module_id].state_dict().items()}


@pytest.mark.e2e
def test_self_play_frozen_snapshot_added_mid_run(ray_session) -> None:
    """A frozen snapshot of ``main`` added after iteration 1 (``add_module``) plays main from
    then on: main's norms equal the oracle before and after; the snapshot is never trained, has
    no gradient norms, and keeps main's weights of the moment it was taken."""
    snapshots: dict[int, dict[str, dict[str, torch.Tensor]]] = {}

    def keep(algo: Any, iteration: int) -> None:
        mids = [m for m in ("main", "main_v1") if m in local_learner(algo).module.keys()]  # noqa: SIM118
        snapshots[iteration] = {mid: _weights(algo, mid) for mid in mids}

    oracle = OracleSpec(rllib_loss_of(PPOTorchLearner), {"main": PPO_HEADS, "main_v1": PPO_HEADS})
    run = train_against_oracle(
        _self_play_config(SnapshotAtIteration), PPOTorchLearner, oracle, iterations=3, between=keep
    )
    assert [it.trained() for it in run] == [{"main"}] * 3
    assert [_norms_reported(it.learners, "main_v1") for it in run] == [{}] * 3, "the snapshot is never trained"
    # Added after iteration 1 (the callback runs inside train()) with the EnvRunner's main: its
    # inference-only part (actor encoder, pi), as in RLlib's example; the critic is left as built.
    actor = [k for k in snapshots[1]["main"] if k.startswith(("pi.", "encoder.actor_encoder."))]
    for later in (1, 2, 3):
        assert _equal(snapshots[later]["main_v1"], snapshots[1]["main"], actor), later
    assert not _equal(snapshots[3]["main"], snapshots[1]["main"], actor)  # main trained on


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str]) -> bool:
    assert keys
    return all(torch.equal(a[k], b[k]) for k in keys)


@pytest.mark.e2e
def test_self_play_trainable_snapshot_is_monitored_from_its_first_update(ray_session) -> None:
    """The league variant: the added snapshot trains too.  Its norms must be reported, equal to
    the oracle, from its first update on (issue 36, item 2, here with the local learner)."""
    oracle = OracleSpec(rllib_loss_of(PPOTorchLearner), {"main": PPO_HEADS, "main_v1": PPO_HEADS})
    run = train_against_oracle(_self_play_config(TrainedSnapshotAtIteration), PPOTorchLearner, oracle, iterations=3)
    assert [it.trained() for it in run] == [{"main"}, {"main", "main_v1"}, {"main", "main_v1"}]


# --- observe-only: the examples' own learners train bit for bit as without gradmon -----------


def _observe_only_configs() -> dict[str, tuple[AlgorithmConfig, dict[str, Any]]]:
    """Example -> (its config with its own, unwrapped, learner; gradmon settings)."""
    separate = _ppo_cartpole(vf_loss_coeff=1.0, lr=1e-3).rl_module(
        model_config=DefaultModelConfig(vf_share_layers=False)
    )
    separate.learners(learner_class=TwoOptimizerPPOLearner, learner_config_dict={"lr_vf": 5e-4})
    penalty = _ppo_cartpole(vf_loss_coeff=0.01, lr=0.01).rl_module(
        model_config=DefaultModelConfig(vf_share_layers=True)
    )
    penalty.learners(learner_class=WeightPenaltyPPOLearner, learner_config_dict={"regularizer_coeff": 0.02})
    schedulers = _ppo_cartpole(lr=LR).experimental(
        _torch_lr_scheduler_classes=[
            functools.partial(torch.optim.lr_scheduler.ConstantLR, factor=FACTOR, total_iters=TOTAL_ITERS),
            functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=GAMMA),
        ]
    )
    schedulers.learners(learner_class=PPOTorchLearner)
    shared = _shared_encoder_config()
    shared.learners(learner_class=SharedOptimizerVPGLearner)
    return {
        "separate_vf_lr_and_optimizer": (separate, {}),
        "ppo_with_custom_loss_fn": (penalty, {}),
        "ppo_with_torch_lr_schedulers": (schedulers, {}),
        "shared_encoder_cartpole": (shared, SHARED_ENCODER_GRADMON),
    }


@pytest.mark.parametrize("example", list(_observe_only_configs()))
def test_example_learners_train_bit_for_bit_with_gradmon(example: str) -> None:
    """In-process (no Ray): the example's learner and its ``with_gradmon`` twin, same initial
    weights, same batch, two seeded 2-epoch updates: weights, every optimizer's state (the two
    optimizers; the one registered for all modules) and lr schedulers equal bit for bit."""
    config, gradmon = _observe_only_configs()[example]
    assert observe_only_difference(config, gradmon) is None


def test_a_module_outside_policies_to_train_raises_no_missing_gradient_health() -> None:
    """``different_spaces_for_agents.py``'s ``policies_to_train=["main0"]``, in-process: main1
    gets no rows and no gradient by RLlib's design; it must not be reported as a head whose
    gradient went missing (what ``watch`` and the health summary rank as an alarm)."""
    config = (
        _ppo_cartpole()
        .environment(TwoSpacesEnv)
        .multi_agent(
            policies={"main0", "main1"},
            policy_mapping_fn=lambda aid, episode, **kw: f"main{aid[-1]}",
            policies_to_train=["main0"],
        )
        .learners(learner_class=with_gradmon(PPOTorchLearner), learner_config_dict={"gradmon": {}})
    )
    runner = env_runner(config)
    learner = None
    try:
        learner = config.build_learner(spaces=runner.get_spaces())
        batch = sample_with(runner, learner, num_timesteps=64)
        results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=64)
    finally:
        runner.stop()
        shutdown_all([learner])
    assert mn.head_metric(mn.HEAD_GRAD_NORM, "pi") in results["main0"]
    reported = sorted(k for k in results.get("main1", {}) if k.startswith(("grad/", "latch/")))
    assert not reported, f"main1 is never trained, yet reports {reported}"
