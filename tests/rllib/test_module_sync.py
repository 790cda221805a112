"""``rllib/module_sync.py``, ``compat.DistributedModulesHook`` and ``rllib/module_changes.py`` in
process: a gradmon PPO learner configured as one of two learners (``num_learners=2``) on a real
one-process gloo world, so RLlib wraps every module in its ``TorchDDPRLModule`` and gradmon
takes over the averaging, exactly as on a learner actor; only the other learner is missing.

With one process every all-reduce is the identity: the learner must train exactly as stock
RLlib's single learner does (the oracle: a stock ``PPOTorchLearner`` with the same weights, fed
the same batches; autograd of its loss), DDP must never communicate (a comm hook counts its
buckets), and what the other learner's presence marks would change is set as the ``Presence``
they produce (the real two-learner exchange: tests/e2e/test_sparse_agents_e2e.py).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.core.rl_module.torch.torch_rl_module import TorchDDPRLModule
from ray.rllib.policy.sample_batch import MultiAgentBatch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gradmon_ray import metric_names as mn
from gradmon_ray.distributed.gradient_average import Presence
from gradmon_ray.metric_parsing import parse
from gradmon_ray.rllib import with_gradmon
from tests.peer.pairs import HEADS, build_pair, cartpole_config, sample_batch
from tests.rllib.stock_oracle import stock_head_norms


class _SeesGradients(with_gradmon(PPOTorchLearner)):
    """Keeps the gradients dict ``compute_gradients`` hands RLlib's ``postprocess_gradients``
    (clipping, gradmon's skip): what a filled gradient must be part of."""

    def postprocess_gradients(self, gradients_dict: dict) -> dict:
        self.seen_gradients = dict(gradients_dict)
        return super().postprocess_gradients(gradients_dict)


def _pair(gradmon: dict[str, Any] | None = None, learner_class: type | None = None) -> tuple[Any, Any, Any]:
    """(stock single learner, gradmon learner as one of 2 learners, a 2-module batch), same weights."""
    stock_config = cartpole_config("ppo", PPOTorchLearner, agents=2)
    wrapped = learner_class or with_gradmon(PPOTorchLearner)
    config = cartpole_config("ppo", wrapped, agents=2, gradmon={"heads": HEADS, **(gradmon or {})})
    config.learners(num_learners=2)
    stock, learner = build_pair(stock_config, config)
    return stock, learner, sample_batch(stock_config, stock, num_timesteps=128)


def _update(learner: Any, batch: Any) -> dict[str, dict[str, float]]:
    results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    return {mid: {k: float(v.peek()) for k, v in r.items() if hasattr(v, "peek")} for mid, r in results.items()}


def _only(batch: Any, *module_ids: str) -> MultiAgentBatch:
    return MultiAgentBatch({mid: batch.policy_batches[mid] for mid in module_ids}, env_steps=batch.env_steps())


def _weights(learner: Any, mid: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.module[mid].unwrapped().parameters()]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=what)


def _count_ddp_buckets(learner: Any, mid: str) -> list[int]:
    """DDP's bucket all-reduces of module ``mid`` (a comm hook that counts, then reduces as DDP would)."""
    calls: list[int] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations, not strings
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    learner.module[mid].register_comm_hook(dist.group.WORLD, hook)
    return calls


def test_gradmon_averages_with_ddp_silent_and_trains_as_stock(world):
    """Every module stays RLlib's ``TorchDDPRLModule``, with its forward buffer broadcast off
    (on a module only some learners train it would meet another collective) and no bucket
    all-reduce in backward (``no_sync`` around the whole update); the weights after an update
    are stock RLlib's, bit for bit, module by module."""
    stock, learner, batch = _pair()
    try:
        assert learner.gradient_average is not None and len(learner.gradient_average.modules) == 2
        buckets = {}
        for mid in ("p0", "p1"):
            assert isinstance(learner.module[mid], TorchDDPRLModule), mid
            assert learner.module[mid].require_forward_param_sync is False, mid
            buckets[mid] = _count_ddp_buckets(learner, mid)
        _update(stock, batch)
        _update(learner, batch)
        assert buckets == {"p0": [], "p1": []}, "DDP communicated: gradmon averages already"
        for mid in ("p0", "p1"):
            _assert_same(_weights(learner, mid), _weights(stock, mid), mid)
    finally:
        stock.shutdown()
        learner.shutdown()


def test_a_module_missing_from_the_next_update_is_not_stepped_nor_reported(world):
    """Update 1 trains both modules, update 2 only p0 (p1's agents in no shard): the presence is
    exchanged again, so p1 gets no (zero) gradient, keeps its weights and Adam state, reports
    nothing; p0 trains as stock RLlib's learner fed the same batches."""
    stock, learner, batch = _pair()
    try:
        for b in (batch, _only(batch, "p0")):
            _update(stock, b)
            before = _weights(learner, "p1")
            logged = _update(learner, b)
        _assert_same(_weights(learner, "p1"), before, "p1 stepped in an update nobody trained it")
        # RLlib's logger keeps p1's keys of update 1 as NaN: nothing of gradmon's is logged anew
        assert [k for k, v in logged.get("p1", {}).items() if parse(k) is not None and not math.isnan(v)] == []
        assert learner.gradient_average.presence is None, "forgotten after the update"
        for mid in ("p0", "p1"):
            _assert_same(_weights(learner, mid), _weights(stock, mid), mid)
        assert logged["p0"][mn.MINIBATCH_UPDATES] == 1.0
    finally:
        stock.shutdown()
        learner.shutdown()


def test_a_gradient_only_another_learner_has_is_filled_and_reaches_the_optimizer(world):
    """This learner's shard has no p1 sample, the other learner's has (its marks: p1 trained by
    one learner): p1's gradient is the other learner's share, zeros here, and RLlib must step p1
    with it, as the other replica does, or the replicas part: the filled gradient is in the dict
    RLlib's ``postprocess_gradients`` gets (its clipping must see it, as on the other learner).
    Oracles: that dict, Adam's ``step`` count of every p1 parameter (1), and Adam's zero-gradient
    step from a fresh state leaves the weights as they were."""
    stock, learner, batch = _pair(learner_class=_SeesGradients)
    try:
        average = learner.gradient_average
        average.presence = Presence((1,) * len(average.params), (1, 1))
        before = _weights(learner, "p1")
        _update(learner, _only(batch, "p0"))
        (optimizer,) = [o for _, o in learner.get_optimizers_for_module("p1")]
        params = list(learner.module["p1"].unwrapped().parameters())
        seen = learner.seen_gradients
        for p in params:
            grad = seen.get(learner.get_param_ref(p))
            assert grad is not None and torch.equal(grad, torch.zeros_like(p)), "filled, and handed to RLlib"
        assert [float(optimizer.state[p]["step"]) for p in params] == [1.0] * len(params)
        _assert_same(_weights(learner, "p1"), before, "p1")
    finally:
        stock.shutdown()
        learner.shutdown()


def _local_and_big(learner: Any, mid: str) -> tuple[list[float], list[float]]:
    """(local, all-reduced) squared norms of (pi, vf, all) in ``mid``'s noise lanes (one minibatch)."""
    lanes = learner.gradmon_modules[mid].noise_hook.lanes.tolist()
    return [lanes[0], lanes[1], lanes[3]], lanes[4:7]


@pytest.mark.parametrize("counts", [None, {"p0": 2, "p1": 1}], ids=["exchanged", "p0-on-2-learners"])
def test_each_modules_local_gradient_feeds_its_own_noise_lanes(world, counts):
    """The noise scale's LOCAL squared norms come from the average's ``before_reduce``: each
    module's own gradient, before the division by its learner count.  Oracle: autograd of the
    stock loss, per head and in all.  With p0 trained by 2 learners (their marks), p0's average
    is half its local gradient here: its all-reduced lanes are a quarter of its local ones.
    Also: a module every learner trained is not "partially trained"."""
    stock, learner, batch = _pair({"report_every": 1000})  # no report: the lanes stay readable
    try:
        for mid, monitor in learner.gradmon_modules.items():  # as on 2 live learners (world size 2)
            monitor.setup_noise_scale(learner.module[mid], learner.gradmon, True, averaged=True)
        average = learner.gradient_average
        if counts is not None:  # the average's module order is RLlib's (from a set), not p0, p1
            per_module = [counts[mid] for mid in learner._synced_module_ids]
            average.presence = Presence(tuple(per_module[m] for m in average._module_of), tuple(per_module))
        expected = {}
        for mid in ("p0", "p1"):
            norms = stock_head_norms(stock, batch, mid, {"pi": "pi.", "vf": "vf.", "all": ""})
            expected[mid] = [norms[k] ** 2 for k in ("pi", "vf", "all")]
        _update(learner, batch)
        if counts is None:
            assert learner.partially_trained == set()
        for mid in ("p0", "p1"):
            local, big = _local_and_big(learner, mid)
            assert local == pytest.approx(expected[mid], rel=1e-4), mid
            share = 1.0 / (counts[mid] if counts else 1) ** 2
            assert big == pytest.approx([v * share for v in expected[mid]], rel=1e-4), mid
    finally:
        stock.shutdown()
        learner.shutdown()


def _spec_like(learner: Any, mid: str) -> RLModuleSpec:
    template = learner.module[mid].unwrapped()
    return RLModuleSpec(
        module_class=type(template),
        observation_space=template.observation_space,
        action_space=template.action_space,
        model_config=template.model_config,
    )


def test_added_and_removed_modules_join_the_average_clock_and_norm_pass(world):
    """``add_module("p2")`` after one update: p2 is averaged by gradmon with the others (DDP
    silent, its forward broadcast off), monitored with its clock at the learner's, its norms
    the stock loss's; ``remove_module("p0")``: the average and the norm pass follow (p1 and p2
    keep their own norms, not p0's slot)."""
    stock, learner, batch = _pair()
    try:
        for owner in (stock, learner):  # both: PPO's KL coefficients move alike
            _update(owner, batch)
        for owner in (stock, learner):
            owner.add_module(module_id="p2", module_spec=_spec_like(learner, "p0"))
        stock.module["p2"].set_state(learner.module["p2"].unwrapped().get_state())
        assert len(learner.gradient_average.modules) == 3
        assert learner.module["p2"].require_forward_param_sync is False
        assert learner.gradmon_modules["p2"].tracker.iteration == learner.gradmon_iteration == 1
        buckets = _count_ddp_buckets(learner, "p2")
        three = MultiAgentBatch({**batch.policy_batches, "p2": batch.policy_batches["p0"]}, batch.env_steps())
        _check_norms(stock, learner, three, ("p0", "p1", "p2"), iteration=2)
        assert buckets == []
        for owner in (stock, learner):
            owner.remove_module("p0")
        assert len(learner.gradient_average.modules) == 2 and sorted(learner.gradmon_modules) == ["p1", "p2"]
        _check_norms(stock, learner, _only(three, "p1", "p2"), ("p1", "p2"), iteration=3)
    finally:
        stock.shutdown()
        learner.shutdown()


def _check_norms(stock: Any, learner: Any, batch: Any, mids: tuple[str, ...], iteration: int) -> None:
    for mid in mids:  # the stock learner holds the gradmon learner's weights of the moment
        stock.module[mid].set_state(learner.module[mid].unwrapped().get_state())
    expected = {mid: stock_head_norms(stock, batch, mid, {"pi": "pi.", "vf": "vf.", "all": ""}) for mid in mids}
    logged = _update(learner, batch)
    _update(stock, batch)  # PPO's KL coefficients move alike
    for mid in mids:
        assert logged[mid][mn.TELEMETRY_ITERATION] == float(iteration), mid
        assert logged[mid][mn.GLOBAL_GRAD_NORM] == pytest.approx(expected[mid]["all"], rel=1e-4), mid
        for head in ("pi", "vf"):
            assert logged[mid][mn.head_metric(mn.HEAD_GRAD_NORM, head)] == pytest.approx(expected[mid][head], rel=1e-4)
