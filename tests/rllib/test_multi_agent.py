"""``with_gradmon`` on a ``MultiRLModule``, in-process: per-module numbers against autograd of the
stock learner's loss, ONE packed reduction and host copy per step for 8 modules, per-module state,
``modules`` / ``per_module`` settings, shared parameters, and build errors before any thread."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
import torch
from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.multi_rl_module import MultiRLModule, MultiRLModuleSpec
from ray.rllib.core.rl_module.rl_module import RLModuleSpec

import gradmon_ray.distributed.collective as collective_module
from gradmon_ray import metric_names as mn
from gradmon_ray.rllib import with_gradmon
from gradmon_ray.rllib.monitor_step import TELEMETRY_STATE_KEY
from gradmon_ray.telemetry.blame import RESULT_KEY
from tests.peer.pairs import build_pair, cartpole_config, sample_batch, spaces_of
from tests.rllib.stock_oracle import stock_head_norms
from tests.rllib.user_module import TinyActorCritic

HEADS = {"pi": r"^pi\.", "vf": r"^vf\."}


def _update(learner: Any, batch: Any) -> dict[str, dict[str, float]]:
    results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    numbers = {
        mid: {k: v for k, v in res.items() if hasattr(v, "peek") and k != RESULT_KEY} for mid, res in results.items()
    }
    return {mid: {k: float(v.peek()) for k, v in res.items()} for mid, res in numbers.items()}


@pytest.fixture(scope="module")
def eight_modules():
    """Stock and wrapped PPO learners on 8-agent CartPole (one module per agent), same weights, one batch."""
    stock_config = cartpole_config("ppo", PPOTorchLearner, agents=8, training={"grad_clip": None})
    wrapped_config = cartpole_config("ppo", with_gradmon(PPOTorchLearner), agents=8, gradmon={"heads": HEADS})
    wrapped_config.training(grad_clip=None)
    stock, wrapped = build_pair(stock_config, wrapped_config)
    batch = sample_batch(stock_config, stock, num_timesteps=256)
    yield stock, wrapped, batch
    stock.shutdown()
    wrapped.shutdown()


def test_eight_modules_one_packed_reduction_and_per_module_norms(eight_modules, monkeypatch):
    stock, wrapped, batch = eight_modules
    expected = {mid: stock_head_norms(stock, batch, mid, {"pi": "pi.", "vf": "vf."}) for mid in batch.policy_batches}
    copies = []
    inner = collective_module.reduce_and_copy
    monkeypatch.setattr(collective_module, "reduce_and_copy", lambda *a, **k: copies.append(1) or inner(*a, **k))
    logged = _update(wrapped, batch)
    assert len(copies) == 1, "one packed reduction and host copy for all 8 modules"
    assert sorted(wrapped.gradmon_modules) == [f"p{i}" for i in range(8)]
    for mid, heads in expected.items():
        for head, norm in heads.items():
            assert logged[mid][mn.head_metric(mn.HEAD_GRAD_NORM, head)] == pytest.approx(norm, rel=1e-4), (mid, head)
    # different agents' data: different gradients, reported under their own module
    assert len({round(logged[m][mn.head_metric(mn.HEAD_GRAD_NORM, "vf")], 6) for m in expected}) > 1


def test_per_module_state_round_trips_and_old_single_module_state_loads(eight_modules):
    _, wrapped, batch = eight_modules
    _update(wrapped, batch)
    state = wrapped.get_state()
    assert sorted(state[TELEMETRY_STATE_KEY]) == sorted(wrapped.gradmon_modules)
    config = cartpole_config("ppo", with_gradmon(PPOTorchLearner), agents=8, gradmon={"heads": HEADS})
    restored = config.build_learner(spaces=spaces_of(config))
    try:
        restored.set_state(state)
        for mid, monitor in wrapped.gradmon_modules.items():
            assert restored.gradmon_modules[mid].tracker.state_dict() == monitor.tracker.state_dict(), mid
        assert restored.gradmon_iteration == wrapped.gradmon_iteration >= 1
        with pytest.raises(ValueError, match="not by the modules"):  # a one-module state cannot be split
            restored.set_state({TELEMETRY_STATE_KEY: state[TELEMETRY_STATE_KEY]["p0"]})
    finally:
        restored.shutdown()
    # A state written before multi-agent support, built here by hand in that format: ONE module's
    # telemetry under the key, not keyed by module, and no collapse latch yet.  A single-module
    # learner loads it into its module; the values read back are the ones written here.
    single = cartpole_config("ppo", with_gradmon(PPOTorchLearner), gradmon={"heads": HEADS})
    one = single.build_learner(spaces=spaces_of(single))
    try:
        ((mid, monitor),) = one.gradmon_modules.items()
        heads, latch = list(monitor.tracker.reported_heads), list(monitor.tracker.latch_heads)
        assert heads and latch  # the premise: something to carry
        prev = {h: 0.25 * (i + 1) for i, h in enumerate(heads)}
        old = {
            "reported_heads": heads,
            "action_heads": list(monitor.tracker.action_heads),
            "prev_norms": prev,
            "skipped_total": 3,
            "iteration": 7,
            "latches": {
                "head_names": latch,
                "nan": {h: h == latch[0] for h in latch},
                "inf": {h: False for h in latch},
                "nan_first_iteration": {latch[0]: 5},
                "inf_first_iteration": {},
            },
        }
        one.set_state({TELEMETRY_STATE_KEY: old})
        tracker = one.gradmon_modules[mid].tracker
        assert tracker.prev_norms == prev and tracker.skipped_total == 3 and tracker.iteration == 7
        assert one.gradmon_iteration == 7
        assert tracker.latches.nan == {h: h == latch[0] for h in latch}
        assert tracker.latches.nan_first_iteration == {latch[0]: 5} and not any(tracker.latches.inf.values())
        assert one.get_state()[TELEMETRY_STATE_KEY][mid]["prev_norms"] == prev  # saved again: keyed by module
    finally:
        one.shutdown()


def test_modules_and_per_module_settings():
    gradmon = {
        "heads": HEADS,
        "modules": ["p0", "p2"],
        "per_module": {"p2": {"heads": {"actor": r"^pi\.", "critic": r"^vf\."}}},
    }
    config = cartpole_config("ppo", with_gradmon(PPOTorchLearner), agents=3, gradmon=gradmon)
    learner = config.build_learner(spaces=spaces_of(config))
    try:
        batch = sample_batch(config, learner, num_timesteps=128)
        logged = _update(learner, batch)
        assert sorted(learner.gradmon_modules) == ["p0", "p2"]  # RLlib orders the modules from a set
        assert learner.gradmon_modules["p0"].head_names == ("pi", "vf")
        assert learner.gradmon_modules["p2"].head_names == ("actor", "critic")
        assert not any(k.startswith("grad/") for k in logged.get("p1", {})), "p1 is not monitored"
        assert mn.head_metric(mn.HEAD_GRAD_NORM, "critic") in logged["p2"]
    finally:
        learner.shutdown()
    # an id the MultiRLModule does not have is accepted (a league adds it later: tests/rllib/test_module_changes.py),
    # one that metric names cannot carry is not
    bad = cartpole_config("ppo", with_gradmon(PPOTorchLearner), agents=2, gradmon={"modules": ["p0", "p 9"]})
    with pytest.raises(ValueError, match="module id 'p 9' cannot go into"):
        bad.build_learner(spaces=spaces_of(bad))


class SharedBodyMultiRLModule(MultiRLModule):
    """Two TinyActorCritic modules whose ``body`` is ONE shared encoder (p1 uses p0's)."""

    def setup(self) -> None:
        super().setup()
        self._rl_modules["p1"].body = self._rl_modules["p0"].body


def test_shared_encoder_counts_in_each_modules_global_norm():
    """A parameter two modules share is in both modules' global norms, with the gradient autograd
    gives it: the sum over both modules' losses (one backward of their sum, as RLlib does)."""
    specs = {mid: RLModuleSpec(module_class=TinyActorCritic, model_config={"hidden": 8}) for mid in ("p0", "p1")}
    spec = MultiRLModuleSpec(multi_rl_module_class=SharedBodyMultiRLModule, rl_module_specs=specs)
    gradmon = {"heads": {"actor": r"^policy_out\.", "critic": r"^value_out\."}}
    config = cartpole_config(
        "ppo", with_gradmon(PPOTorchLearner), agents=2, gradmon=gradmon, training={"grad_clip": None}
    )
    config.rl_module(rl_module_spec=spec)
    learner = config.build_learner(spaces=spaces_of(config))
    try:
        modules = {mid: learner.module[mid].unwrapped() for mid in ("p0", "p1")}
        assert modules["p0"].body is modules["p1"].body
        batch = sample_batch(config, learner, num_timesteps=128)
        tensors = learner._convert_batch_type(batch).policy_batches
        total = sum(
            learner.compute_loss_for_module(
                module_id=mid,
                config=learner.config.get_config_for_module(mid),
                batch=dict(tensors[mid]),
                fwd_out=modules[mid].forward_train(dict(tensors[mid])),
            )
            for mid in ("p0", "p1")
        )
        expected = {}
        for mid, module in modules.items():
            params = list(module.parameters())
            grads = torch.autograd.grad(total, params, retain_graph=True, allow_unused=True)
            expected[mid] = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
        logged = _update(learner, batch)
        for mid in ("p0", "p1"):
            assert logged[mid][mn.GLOBAL_GRAD_NORM] == pytest.approx(expected[mid], rel=1e-4), mid
    finally:
        learner.shutdown()


def test_appo_bad_head_fails_before_the_learner_thread_starts(ray_session):
    before = {t.ident for t in threading.enumerate()}
    config = cartpole_config("appo", with_gradmon(APPOTorchLearner), agents=2, gradmon={"heads": {"pi": "^nope"}})
    with pytest.raises(ValueError, match=r"module 'p[01]'.*'pi'.*matches no"):
        config.build_learner(spaces=spaces_of(config))
    started = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert started == [], f"threads left running after a failed build: {started}"


class _OwnPostprocessing(with_gradmon(PPOTorchLearner)):
    """A subclass of a gradmon learner whose ``postprocess_gradients`` calls the per-module hook
    itself, without ``super()`` (so gradmon's batched pass does not run there)."""

    def postprocess_gradients(self, gradients_dict):
        out = {}
        for module_id in self.module.keys():  # noqa: SIM118 (a MultiRLModule iterates otherwise)
            own = {p: g for p, g in gradients_dict.items() if any(p is q for q in self.module[module_id].parameters())}
            config = self.config.get_config_for_module(module_id)
            out.update(
                self.postprocess_gradients_for_module(module_id=module_id, config=config, module_gradients_dict=own)
            )
        return out


def test_an_override_of_postprocess_gradients_still_measures_every_module_once_per_minibatch():
    """The batched norm pass normally runs in ``postprocess_gradients``; an override that skips
    gradmon's gets it from the first per-module hook, ONCE per minibatch for all modules: VGS folds
    each minibatch exactly once (its applied-update count equals the minibatches), and the norms
    are still the stock loss's autograd norms per module (not another module's, not stale)."""
    gradmon = {"heads": HEADS, "vgs": {"enabled": True, "warmup_steps": 0}}
    stock_config = cartpole_config("ppo", PPOTorchLearner, agents=2, training={"grad_clip": None})
    wrapped_config = cartpole_config("ppo", _OwnPostprocessing, agents=2, gradmon=gradmon)
    wrapped_config.training(grad_clip=None)
    stock, wrapped = build_pair(stock_config, wrapped_config)
    batch = sample_batch(stock_config, stock, num_timesteps=128)
    expected = {mid: stock_head_norms(stock, batch, mid, {"pi": "pi.", "vf": "vf."}) for mid in batch.policy_batches}
    logged = _update(wrapped, batch)
    for mid, heads in expected.items():
        monitor = wrapped.gradmon_modules[mid]
        assert float(monitor.vgs._stat_steps) == monitor.last_telemetry.minibatches == 1, mid
        for head, norm in heads.items():
            assert logged[mid][mn.head_metric(mn.HEAD_GRAD_NORM, head)] == pytest.approx(norm, rel=1e-4), (mid, head)
    stock.shutdown()
    wrapped.shutdown()


@pytest.mark.parametrize("poisoned", ["p0", "p1"])
def test_each_modules_vgs_skips_by_its_own_non_finite_flag(poisoned):
    """A NaN observation in one module's rows only: that module's gradients are non-finite, the
    other's are clean.  Each module's VGS skips (or folds) the minibatch by its own flag from the
    batched norm pass, never another module's: the clean module's VGS learned from it, the
    poisoned one's did not.  Oracle: which module the test poisoned."""
    gradmon = {"heads": HEADS, "vgs": {"enabled": True, "warmup_steps": 0}}
    config = cartpole_config(
        "ppo",
        with_gradmon(PPOTorchLearner),
        agents=2,
        gradmon=gradmon,
        framework={"torch_skip_nan_gradients": True},
    )
    learner = config.build_learner(spaces=spaces_of(config))
    try:
        batch = sample_batch(config, learner, num_timesteps=128)
        batch.policy_batches[poisoned][Columns.OBS][0] = float("nan")
        logged = _update(learner, batch)
        clean = "p1" if poisoned == "p0" else "p0"
        assert logged[poisoned][mn.NAN_GRAD_COUNT] > 0 and logged[clean][mn.NAN_GRAD_COUNT] == 0
        steps = {mid: float(monitor.vgs._stat_steps) for mid, monitor in learner.gradmon_modules.items()}
        assert steps == {clean: 1.0, poisoned: 0.0}
    finally:
        learner.shutdown()
