"""``with_gradmon`` on RLlib's own learners and modules, checked against an independent path.

Expected norms come from ``torch.autograd.grad`` of the STOCK learner's loss (RLlib's own
``compute_loss_for_module``) at the pre-update weights, with parameters fetched by name from
``named_parameters()``; nothing here uses gradmon's head resolution or ``GradientNormPlan``.
Everything runs in-process (no Ray cluster): one update on one batch, one minibatch.
"""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
from ray.rllib.algorithms.impala import IMPALAConfig
from ray.rllib.algorithms.impala.torch.impala_torch_learner import IMPALATorchLearner
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID as MID
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from gradmon_ray import compat
from gradmon_ray.rllib import with_gradmon
from gradmon_ray.telemetry.blame import RESULT_KEY
from tests.rllib.fault_injection import with_faults
from tests.rllib.stock_oracle import stock_head_norms
from tests.rllib.user_module import TinyActorCritic, default_ppo_module

HEADS = {"pi": r"^pi\.", "vf": r"^vf\."}
SPACES = {MID: (gym.make("CartPole-v1").observation_space, gym.make("CartPole-v1").action_space)}
ALGOS = {
    "ppo": (PPOConfig, PPOTorchLearner),
    "appo": (APPOConfig, APPOTorchLearner),
    "impala": (IMPALAConfig, IMPALATorchLearner),
}


def _config(algo: str, learner_class: type, gradmon: dict | None = None, module_spec=None, **training):
    config_cls, _ = ALGOS[algo]
    extra = {"num_epochs": 1, "minibatch_size": 200} if algo == "ppo" else {}
    config = (
        config_cls()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=0, rollout_fragment_length=50)
        .learners(num_learners=0, learner_class=learner_class, learner_config_dict={"gradmon": gradmon or {}})
        .training(train_batch_size_per_learner=200, **{"grad_clip": None, **extra, **training})
        .debugging(seed=0)
    )
    return config.rl_module(rl_module_spec=module_spec) if module_spec is not None else config


def _expected_norms(algo, batch, state, heads, module_spec=None) -> dict[str, float]:
    """Norms of d(stock loss)/d(params named like each head), at ``state``'s weights, float64."""
    stock = _config(algo, ALGOS[algo][1], module_spec=module_spec).build_learner(spaces=SPACES)
    try:
        stock.module[MID].set_state(state)
        return stock_head_norms(stock, batch, MID, heads)
    finally:
        stock.shutdown()


def _one_update(algo, gradmon, module_spec=None, **training):
    """(logged metrics of the module, pre-update state, batch) after one update on 200 sampled steps."""
    config = _config(algo, with_gradmon(ALGOS[algo][1]), gradmon, module_spec, **training)
    learner = config.build_learner(spaces=SPACES)
    runner = SingleAgentEnvRunner(config=config)
    try:
        runner.module.set_state(learner.module[MID].get_state(inference_only=True))
        episodes = runner.sample(num_timesteps=200, random_actions=False)
        batch = compat.make_train_batch(learner, TrainingData(episodes=episodes))
        state = learner.module[MID].get_state()
        if algo == "ppo":
            results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        else:  # IMPALA's update hands the batch to its learner thread and waits for the reduction
            results = learner.update(training_data=TrainingData(batch=batch), timesteps={})
        return {k: float(v.peek()) for k, v in results[MID].items() if k != RESULT_KEY}, state, batch, learner
    finally:
        runner.stop()


@pytest.mark.parametrize(
    "algo", ["ppo", pytest.param("appo", marks=pytest.mark.e2e), pytest.param("impala", marks=pytest.mark.e2e)]
)  # APPO and IMPALA put their weights in the object store: they start Ray
def test_default_module_head_norms_equal_autograd_of_the_stock_loss(algo, request):
    if algo != "ppo":
        request.getfixturevalue("ray_session")  # IMPALA's learner thread ray.put()s the weights
    logged, state, batch, learner = _one_update(algo, {"heads": HEADS})
    try:
        expected = _expected_norms(algo, batch, state, {"pi": "pi.", "vf": "vf."})
        for head in ("pi", "vf"):
            assert logged[f"grad/head/{head}/norm"] == pytest.approx(expected[head], rel=1e-4), head
        assert logged["grad/global_norm"] >= max(expected.values()) * (1 - 1e-6)
        assert logged["grad/nan_count"] == 0.0 and logged["update/skipped"] == 0.0
        assert logged["latch/nan/policy"] == 0.0  # Discrete actions: one policy latch
        assert learner.head_names == ("pi", "vf")
        # RLlib's own logger, untouched (no class swap).
        assert type(learner.metrics) is MetricsLogger
    finally:
        learner.shutdown()


def test_user_module_declares_heads_by_regex():
    spec = RLModuleSpec(module_class=TinyActorCritic, model_config={"hidden": 16})
    heads = {"actor": r"^policy_out\.", "critic": r"^value_out\."}
    logged, state, batch, learner = _one_update("ppo", {"heads": heads}, module_spec=spec)
    try:
        expected = _expected_norms(
            "ppo", batch, state, {"actor": "policy_out.", "critic": "value_out."}, module_spec=spec
        )
        assert logged["grad/head/actor/norm"] == pytest.approx(expected["actor"], rel=1e-4)
        assert logged["grad/head/critic/norm"] == pytest.approx(expected["critic"], rel=1e-4)
        assert learner.head_names == ("actor", "critic")  # dict order
    finally:
        learner.shutdown()


def _build(gradmon, learner_cls=PPOTorchLearner, **experimental):
    config = _config("ppo", with_gradmon(learner_cls), gradmon)
    if experimental:
        config = config.experimental(**experimental)
    return config.build_learner(spaces=SPACES)


@pytest.mark.parametrize(
    ("gradmon", "message"),
    [
        ({"heads": {"pi": r"^pi\.", "nothing": r"^nope\."}}, r"head 'nothing' \(regex '\^nope\\\\.'\) matches no"),
        (
            {"heads": {"pi": r"^pi\.", "all": r"\.weight$"}},
            r"'pi\..*weight' is matched by heads \['pi', 'all'\]",
        ),
        ({"heads": HEADS, "hedas": 1}, r"unknown keys \['hedas'\]"),
    ],
)
def test_build_errors_name_the_culprit(gradmon, message):
    with pytest.raises(ValueError, match=message):
        _build(gradmon)


def test_with_gradmon_needs_a_torch_learner_and_is_idempotent():
    with pytest.raises(TypeError, match="TorchLearner"):
        with_gradmon(object)
    cls = with_gradmon(APPOTorchLearner)
    assert cls is with_gradmon(APPOTorchLearner) and with_gradmon(cls) is cls
    assert issubclass(cls, APPOTorchLearner)


def test_ray_minor_version_is_checked(monkeypatch):
    for version in ("2.58.0", "2.58.1", "2.59.0", "2.60.0", "2.60.7"):
        compat.check_ray_version(version)
    for version in ("2.57.1", "2.61.0", "3.0.0"):
        with pytest.raises(compat.RayVersionError, match=rf"supports Ray 2\.58, 2\.59, 2\.60 .* Ray {version} is"):
            compat.check_ray_version(version)
    import ray

    monkeypatch.setattr(ray, "__version__", "2.57.1")
    with pytest.raises(compat.RayVersionError, match=r"pip install 'ray\[default,rllib,tune\]>=2\.58,<2\.61'$"):
        _build({"heads": HEADS})


def test_pyproject_states_the_ray_range_compat_checks():
    """The one range, twice: what pip lets in is what ``check_ray_version`` accepts."""
    from pathlib import Path

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    (ray_req,) = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "ray"]
    for minor in ("2.57", *compat.SUPPORTED_RAY_MINORS, "2.61"):
        accepted = minor in compat.SUPPORTED_RAY_MINORS
        assert [ray_req.specifier.contains(f"{minor}.{patch}") for patch in (0, 3)] == [accepted, accepted], minor


@pytest.mark.parametrize("skip", [True, False])
def test_torch_skip_nan_gradients_is_honoured(skip):
    """True: the non-finite minibatch is skipped (weights unchanged); False (RLlib's default): the
    gradients go through nan_to_num and the step is taken, as in stock RLlib; counts exact either way."""
    fault = {"grad": [{"rank": 0, "head": "pi", "iteration": 1, "value": "nan"}]}
    config = with_faults(_config("ppo", with_gradmon(PPOTorchLearner), {"heads": HEADS}), fault)
    config = config.framework(torch_skip_nan_gradients=skip)
    learner = config.build_learner(spaces=SPACES)
    runner = SingleAgentEnvRunner(config=config)
    try:
        batch = compat.make_train_batch(learner, TrainingData(episodes=runner.sample(num_timesteps=200)))
        before = {k: v.clone() for k, v in learner.module[MID].unwrapped().state_dict().items()}
        results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        logged = {k: float(v.peek()) for k, v in results[MID].items() if k != RESULT_KEY}
        after = learner.module[MID].unwrapped().state_dict()
        assert logged["grad/nan_count"] == 1.0
        assert logged["update/skipped"] == (1.0 if skip else 0.0)
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        assert unchanged is skip
        assert all(torch.isfinite(v).all() for v in after.values())
    finally:
        runner.stop()
        learner.shutdown()


def test_global_norm_equals_rllibs_own_clip_norm():
    """RLlib's own clipping still runs (gradmon calls super()) and logs its global norm, computed
    by RLlib's ``compute_global_norm``: an independent path to gradmon's ``grad/global_norm``."""
    config = _config("ppo", with_gradmon(PPOTorchLearner), {"heads": HEADS}, grad_clip=0.5).reporting(
        log_gradients=True
    )
    learner = config.build_learner(spaces=SPACES)
    runner = SingleAgentEnvRunner(config=config)
    try:
        batch = compat.make_train_batch(learner, TrainingData(episodes=runner.sample(num_timesteps=200)))
        results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        logged = {k: float(v.peek()) for k, v in results[MID].items() if k != RESULT_KEY}
        (key,) = [k for k in logged if k.startswith("gradients_") and k.endswith("_global_norm")]
        assert logged[key] == pytest.approx(logged["grad/global_norm"], rel=1e-6)
    finally:
        runner.stop()
        learner.shutdown()


@pytest.mark.parametrize(
    ("space", "names"),
    [
        (gym.spaces.MultiDiscrete([3, 4]), ("a0", "a1")),
        (gym.spaces.Dict({"b": gym.spaces.Discrete(4), "a": gym.spaces.Discrete(3)}), ("a", "b")),
        (gym.spaces.Discrete(3), ("policy",)),
    ],
)
def test_default_module_latches_per_action_component(space, names):
    """Per-head log-probs through RLlib's own distributions == log_softmax of each head's logit slice
    (sorted Dict keys, as dm-tree flattens); NaN logits of one head flag that head only."""
    from gradmon_ray.rllib.heads import latch_heads, per_head_logp

    module = default_ppo_module(space)
    assert latch_heads(module) == names
    sizes = [3, 4] if len(names) == 2 else [3]
    logits = torch.randn(6, sum(sizes))
    samples = [torch.randint(n, (6,)) for n in sizes]
    if isinstance(space, gym.spaces.MultiDiscrete):
        actions = torch.stack(samples, dim=-1)
    elif isinstance(space, gym.spaces.Dict):
        actions = dict(zip(names, samples, strict=True))
    else:
        actions = samples[0]
    got = per_head_logp(module, logits, actions, len(names))
    start = 0
    for i, n in enumerate(sizes):
        expected = torch.log_softmax(logits[:, start : start + n], -1).gather(-1, samples[i][:, None])[:, 0]
        torch.testing.assert_close(got[:, i], expected)
        start += n
    if len(names) == 2:
        poisoned = logits.clone()
        poisoned[:, 3:] = float("nan")  # the second head's logits
        flags = torch.isnan(per_head_logp(module, poisoned, actions, 2)).any(0).tolist()
        assert flags == [False, True]


def test_shutdown_removes_the_tensor_hooks_it_installed():
    fault = {"grad": [{"rank": 0, "head": "pi", "iteration": 99, "value": "nan"}]}
    learner = with_faults(_config("ppo", with_gradmon(PPOTorchLearner), {"heads": HEADS}), fault).build_learner(
        spaces=SPACES
    )
    first_pi = next(p for n, p in learner.module[MID].unwrapped().named_parameters() if n.startswith("pi."))
    assert len(first_pi._backward_hooks) == 1
    learner.shutdown()
    assert len(first_pi._backward_hooks) == 0
    assert not learner.gradmon_modules[MID].noise_hook.enabled
