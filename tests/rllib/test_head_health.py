"""``rllib/head_health.py``: per-head policy entropy and KL against RLlib's OWN loss code, in a real run.

The drop-in ``with_gradmon(PPOTorchLearner)`` on RLlib's default module with a
``MultiDiscrete([3, 4])`` action space: RLlib's ``TorchMultiCategorical`` and its stock PPO loss
compute ``entropy`` and ``mean_kl_loss`` (KL(sampling || current), masked mean, logged with
window=1, so the result holds the iteration's last minibatch).  For a factored distribution both
are sums over the heads, so the sum of gradmon's per-head values of the same (last) minibatch
must equal them.  The metrics must then be in a real MLflow sqlite store at the same steps.

Bugs this catches: the KL direction swapped (KL(current || sampling) differs once the policy
moved), the wrong minibatch (the first instead of the last: entropy moves across 8 updates),
wrong head slices or sizes, log base, the mask, entropy_norm normalised by the wrong size, a
dropped ``policy/`` prefix on the way to MLflow, and ``vf_explained_var`` not reaching MLflow.

Fast lane (in-process learners, no Ray): which distribution classes get head health
(``distribution_heads``), and on ``Discrete(3)`` (Acrobot) a module whose train distribution is a
``TorchCategorical`` subclass with a temperature reports no entropy/KL (it would be the entropy of
the untempered logits), while RLlib's stock ``TorchCategorical`` module reports the entropy and
KL(sampling || current) that numpy computes from the logits over the loss mask.  Bugs: entropy/KL
turned on by the action space or by ``issubclass`` whatever ``from_logits`` does, a subclassed
partial or ``FactoredCategorical`` taken for the stock one, the loss mask ignored, KL swapped.
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.ppo.torch.default_ppo_torch_rl_module import DefaultPPOTorchRLModule
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.distribution.torch.torch_distribution import (
    TorchCategorical,
    TorchMultiCategorical,
    TorchMultiDistribution,
)
from ray.rllib.core.rl_module.rl_module import RLModuleSpec

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.head_labels import POLICY_LATCH
from gradmon_ray.losses.distribution import FactoredCategorical
from gradmon_ray.rllib import GradmonPPOTorchLearner, with_gradmon
from gradmon_ray.rllib.head_health import head_sizes
from gradmon_ray.rllib.heads import latch_heads
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch
from gradmon_ray.rllib.local_learner import update as local_update
from gradmon_ray.tracking import GradmonMLflowCallback
from tests.fixtures.user_envs import MatchTwoEnv
from tests.peer.pairs import sample_batch
from tests.rllib.user_module import default_ppo_module

SIZES = {"a0": 3, "a1": 4}  # MatchTwoEnv's MultiDiscrete([3, 4]): zero-config names a0, a1


@pytest.mark.parametrize(
    ("space", "sizes"),
    [
        (gym.spaces.MultiDiscrete([3, 4]), (3, 4)),
        (gym.spaces.Dict({"b": gym.spaces.Discrete(4), "a": gym.spaces.Discrete(2)}), (2, 4)),  # sorted keys
        (gym.spaces.Discrete(5), (5,)),
        (gym.spaces.Box(-1.0, 1.0, (2,)), None),  # a Gaussian: no per-head categorical entropy
    ],
)
def test_head_sizes_follow_the_latch_heads_of_rllibs_default_module(space, sizes):
    module = default_ppo_module(space)
    assert head_sizes(module, latch_heads(module)) == sizes


TEMPERATURE = 4.0


class TemperedCategorical(TorchCategorical):
    """A user's categorical at temperature 4: ``softmax(logits / 4)``, so its entropy is NOT the
    entropy of ``softmax(logits)`` that gradmon's per-head lanes would compute from the raw logits."""

    @classmethod
    def from_logits(cls, logits: torch.Tensor, **kwargs: Any) -> TemperedCategorical:
        return cls(logits=logits / TEMPERATURE, **kwargs)


class TemperedPPOModule(DefaultPPOTorchRLModule):
    """RLlib's default PPO module (its catalog, its layers) with the tempered distribution."""

    def get_train_action_dist_cls(self) -> type:
        return TemperedCategorical

    def get_exploration_action_dist_cls(self) -> type:
        return TemperedCategorical

    def get_inference_action_dist_cls(self) -> type:
        return TemperedCategorical


class TemperedMultiCategorical(TorchMultiCategorical):
    """A subclass of RLlib's MultiCategorical (its children stay RLlib's ``TorchCategorical``)."""


DICT = gym.spaces.Dict({"b": gym.spaces.Discrete(4), "a": gym.spaces.Discrete(2)})


def _module(space: gym.Space, dist_cls: type) -> Any:
    module = default_ppo_module(space)
    module.get_train_action_dist_cls = lambda: dist_cls  # this module's own train distribution
    return module


@pytest.mark.parametrize(
    ("space", "dist_cls", "names"),
    [
        (gym.spaces.Discrete(3), TemperedCategorical, (POLICY_LATCH,)),
        (
            gym.spaces.MultiDiscrete([3, 4]),
            TemperedMultiCategorical.get_partial_dist_cls(space=gym.spaces.MultiDiscrete([3, 4]), input_lens=[3, 4]),
            ("a0", "a1"),
        ),
        (
            DICT,
            TorchMultiDistribution.get_partial_dist_cls(
                space=DICT,
                child_distribution_cls_struct={"a": TemperedCategorical, "b": TorchCategorical},
                input_lens=[2, 4],
            ),
            ("a", "b"),
        ),
        (
            gym.spaces.MultiDiscrete([3, 4]),
            type("Hot", (FactoredCategorical.for_heads(("x", "y"), (3, 4), "multi_discrete"),), {}),
            ("x", "y"),
        ),
    ],
)
def test_a_subclass_of_a_categorical_keeps_its_latches_but_gets_no_head_sizes(space, dist_cls, names):
    module = _module(space, dist_cls)
    assert latch_heads(module) == names
    assert head_sizes(module, latch_heads(module)) is None


def test_gradmons_own_factored_categorical_gets_its_head_sizes():
    module = _module(
        gym.spaces.MultiDiscrete([3, 4]), FactoredCategorical.for_heads(("x", "y"), (3, 4), "multi_discrete")
    )
    assert head_sizes(module, latch_heads(module)) == (3, 4)


def _acrobot_learner(module_class: type) -> tuple[Any, PPOConfig]:
    """An in-process ``with_gradmon(PPOTorchLearner)`` on Acrobot (``Discrete(3)``), no Ray."""
    config = (
        PPOConfig()
        .environment("Acrobot-v1")
        .rl_module(rl_module_spec=RLModuleSpec(module_class=module_class))
        .env_runners(num_env_runners=0, rollout_fragment_length=64)
        .learners(num_learners=0, learner_class=with_gradmon(PPOTorchLearner))
        .training(train_batch_size_per_learner=64, minibatch_size=64, num_epochs=1)
        .debugging(seed=0)
    )
    learner = config.build_learner(spaces={DEFAULT_MODULE_ID: (gym.spaces.Box(-30, 30, (6,)), gym.spaces.Discrete(3))})
    return learner, config


def _update(learner: Any, batch: Any) -> dict[str, float]:
    results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    return {k: float(v.peek()) for k, v in results[DEFAULT_MODULE_ID].items() if hasattr(v, "peek")}


def test_a_tempered_categorical_module_reports_no_head_entropy_or_kl():
    learner, config = _acrobot_learner(TemperedPPOModule)
    try:
        assert learner.module[DEFAULT_MODULE_ID].get_train_action_dist_cls() is TemperedCategorical
        logged = _update(learner, sample_batch(config, learner, num_timesteps=64))
    finally:
        learner.shutdown()
    assert logged[mn.head_metric(mn.HEAD_NAN_LATCH, POLICY_LATCH)] == 0.0  # the latch stays
    assert "entropy" in logged  # RLlib's own, from the tempered distribution
    assert not [k for k in logged if k.startswith(("policy/head/", "latch/collapse/"))]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def test_a_stock_categorical_modules_entropy_and_kl_equal_numpy_from_the_logits():
    """One minibatch (the whole batch): entropy of softmax(current logits) and KL(sampling || current),
    masked means over the loss mask, in numpy; the weights are moved after sampling so the KL is real."""
    learner, config = _acrobot_learner(DefaultPPOTorchRLModule)
    try:
        batch = sample_batch(config, learner, num_timesteps=64)
        module = learner.module[DEFAULT_MODULE_ID].unwrapped()
        torch.manual_seed(0)
        with torch.no_grad():
            for p in module.pi.parameters():
                p.add_(0.3 * torch.randn_like(p))
            rows = batch.policy_batches[DEFAULT_MODULE_ID]
            current = module.forward_train({Columns.OBS: torch.as_tensor(rows[Columns.OBS])})
        logged = _update(learner, batch)
    finally:
        learner.shutdown()
    logq = _log_softmax(current[Columns.ACTION_DIST_INPUTS].double().numpy())
    logp = _log_softmax(np.asarray(rows[Columns.ACTION_DIST_INPUTS], dtype=np.float64))
    mask = np.asarray(rows[Columns.LOSS_MASK], dtype=bool)  # PPO's bootstrap rows are masked out
    assert 0 < mask.sum() < len(mask)
    entropy = float((-(np.exp(logq) * logq).sum(-1))[mask].mean())
    kl = float((np.exp(logp) * (logp - logq)).sum(-1)[mask].mean())
    assert kl > 1e-3  # a real KL, not two zeros agreeing
    assert logged[mn.head_metric(mn.HEAD_ENTROPY, POLICY_LATCH)] == pytest.approx(entropy, rel=1e-5)
    assert logged[mn.head_metric(mn.HEAD_KL, POLICY_LATCH)] == pytest.approx(kl, rel=1e-5)
    assert logged["entropy"] == pytest.approx(entropy, rel=1e-5)  # and RLlib's own agrees


@pytest.mark.e2e  # a real algorithm on a local Ray
def test_dropin_head_entropy_and_kl_sum_to_rllibs_own_entropy_and_mean_kl_loss(ray_session, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = (
        PPOConfig()
        .environment(MatchTwoEnv)
        .env_runners(num_env_runners=0)
        .learners(
            num_learners=0,
            learner_class=with_gradmon(PPOTorchLearner),
            learner_config_dict={"gradmon": {"heads": {"pi": r"^pi\.", "vf": r"^vf\."}}},
        )
        .training(
            train_batch_size_per_learner=256,
            minibatch_size=64,
            num_epochs=2,
            lr=3e-3,  # the policy moves: KL of the last minibatch is far from 0
            use_kl_loss=True,
            kl_coeff=0.2,
        )
        .callbacks(GradmonMLflowCallback.configured(tracking_uri=uri, experiment="head-health"))
        .debugging(seed=0)
    )
    algo = config.build_algo()
    try:
        learners = [dict(algo.train()["learners"]["default_policy"]) for _ in range(2)]
        callback = next(c for c in algo.callbacks if isinstance(c, GradmonMLflowCallback))
        run_id = callback.sink.wait_for_run(30)
    finally:
        algo.stop()

    for learner in learners:
        entropy = {h: learner[mn.head_metric(mn.HEAD_ENTROPY, h)] for h in SIZES}
        kl = {h: learner[mn.head_metric(mn.HEAD_KL, h)] for h in SIZES}
        assert sum(entropy.values()) == pytest.approx(learner["entropy"], rel=1e-5)
        assert sum(kl.values()) == pytest.approx(learner["mean_kl_loss"], rel=1e-5, abs=1e-9)
        assert learner["mean_kl_loss"] > 1e-4  # a real KL, not two zeros agreeing
        for head, n in SIZES.items():
            assert 0.0 < entropy[head] <= math.log(n) + 1e-6
            norm = learner[mn.head_metric(mn.HEAD_ENTROPY_NORM, head)]
            assert norm == pytest.approx(entropy[head] / math.log(n), rel=1e-12)
            assert learner[mn.head_metric(mn.HEAD_COLLAPSE_LATCH, head)] == 0.0  # default 0.05: not collapsed

    client = MlflowClient(uri)
    for step, learner in enumerate(learners, 1):
        for template in (mn.HEAD_ENTROPY, mn.HEAD_ENTROPY_NORM, mn.HEAD_KL, mn.HEAD_COLLAPSE_LATCH):
            for head in SIZES:
                name = mn.head_metric(template, head)
                history = {m.step: m.value for m in client.get_metric_history(run_id, name)}
                assert history[step] == pytest.approx(learner[name], rel=1e-12), (name, step)
        explained = {m.step: m.value for m in client.get_metric_history(run_id, mn.VF_EXPLAINED_VAR)}
        assert explained[step] == pytest.approx(learner["vf_explained_var"], rel=1e-12)


class _MinibatchLogits(GradmonPPOTorchLearner):
    """gradmon's PPO learner that keeps, per module, a copy of every minibatch's current logits, its
    sampling logits and its loss mask, in the order the loss saw them (the oracle's input)."""

    def build(self) -> None:
        super().build()
        self.seen: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def compute_loss_for_module(self, *, module_id: Any, config: Any, batch: dict, fwd_out: dict) -> Any:
        logits, sampling = (
            t.detach().double().cpu().numpy().copy()
            for t in (fwd_out[Columns.ACTION_DIST_INPUTS], batch[Columns.ACTION_DIST_INPUTS])
        )
        self.seen.setdefault(module_id, []).append(
            (logits, sampling, batch[Columns.LOSS_MASK].cpu().numpy().astype(bool))
        )
        return super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)


def _entropy_and_kl(record: tuple[np.ndarray, np.ndarray, np.ndarray], sizes: dict[str, int]) -> dict[str, float]:
    """Per head: masked means of -sum p log p and of KL(sampling || current), in numpy (float64)."""
    logits, sampling, mask = record
    out, start = {}, 0
    for head, n in sizes.items():  # the order FactoredActorCritic concatenates its heads' logits in
        logq = _log_softmax(logits[:, start : start + n])
        logp = _log_softmax(sampling[:, start : start + n])
        start += n
        out[f"entropy/{head}"] = float((-(np.exp(logq) * logq).sum(-1))[mask].mean())
        out[f"kl/{head}"] = float((np.exp(logp) * (logp - logq)).sum(-1)[mask].mean())
    assert start == logits.shape[-1]
    return out


@pytest.mark.parametrize("env", ["gradmon/FactoredOps-v0", "gradmon/FactoredOpsMultiAgent-v0"])
def test_entropy_and_kl_are_the_steps_last_minibatchs_with_several_minibatches(env):
    """Two epochs of three or more minibatches (192 rows and the bootstrap rows, 64 a minibatch): each
    module's entropy and KL are numpy's on the step's LAST minibatch (the product's documented choice,
    RLlib's own window=1 entropy), not its first: the policy moves over the minibatches (lr 0.01), and
    the first minibatch's values differ from the last's by far more than the tolerance.  The
    multi-agent env runs the grouped pass (two modules, one distribution: ``health_blocks``)."""
    cfg = config_from_dict(
        {
            "seed": 5,
            "env": {"id": env},
            "ppo": {"train_batch_size": 192, "minibatch_size": 64, "num_epochs": 2, "lr": 0.01},
            "model": {"trunk_hiddens": [16]},
        }
    )
    learner = build_local_learner(cfg, learner_class=_MinibatchLogits)
    try:
        sizes = {
            h: head[-1].out_features
            for mid in learner.gradmon_modules
            for h, head in learner.module[mid].unwrapped().heads.items()
        }
        results = local_update(learner, train_batch(learner, sample_episodes(cfg, learner, 192)), cfg)
        seen = learner.seen
    finally:
        learner.shutdown()
    assert seen and all(len(records) >= 6 for records in seen.values()), {m: len(r) for m, r in seen.items()}
    for mid, records in seen.items():
        logged = {k: float(v.peek()) for k, v in results[mid].items() if hasattr(v, "peek")}
        last, first = _entropy_and_kl(records[-1], sizes), _entropy_and_kl(records[0], sizes)
        for key, want in last.items():
            kind, head = key.split("/")
            template = mn.HEAD_ENTROPY if kind == "entropy" else mn.HEAD_KL
            assert logged[mn.head_metric(template, head)] == pytest.approx(want, rel=1e-5, abs=1e-7), (mid, key)
        moved = [k for k in last if abs(last[k] - first[k]) > 1e-3 * max(abs(last[k]), 1e-3)]
        assert len(moved) == len(last), (mid, "the first minibatch's values must differ from the last's", moved)
