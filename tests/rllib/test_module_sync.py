"""``rllib/module_sync.py``, ``compat.DistributedModulesHook`` and ``rllib/module_changes.py`` in
process: a gradmon PPO learner configured as one of two learners (``num_learners=2``) on a real
one-process gloo world, so RLlib wraps every module in its ``TorchDDPRLModule`` and gradmon
takes over the averaging, exactly as on a learner actor; only the other learner is missing.

With one process every all-reduce is the identity: the learner must train exactly as stock
RLlib's single learner does (the oracle: a stock ``PPOTorchLearner`` with the same weights, fed
the same batches; autograd of its loss), DDP must never communicate (a comm hook counts its
buckets), and what the other learner's presence marks would change is set as the ``Presence``
they produce (the real two-learner exchange: tests/e2e/test_sparse_agents_e2e.py).

The e2e tests at the end run two real learner processes (``tests/distributed/two_ranks.py``, no
Ray) whose batches differ and only partly share modules: each module stepped by its mean over
the learners that trained it (plain SGD, autograd of the stock loss per learner), with and
without a ``GradScaler`` (a learner without a module's samples, one learner's overflow), VGS in
both modes, and the noise scale of a partially trained module left out.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.core.rl_module.torch.torch_rl_module import TorchDDPRLModule
from ray.rllib.evaluation.postprocessing import Postprocessing
from ray.rllib.policy.sample_batch import MultiAgentBatch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gradmon_ray import metric_names as mn
from gradmon_ray.distributed.gradient_average import Presence
from gradmon_ray.metric_parsing import parse
from gradmon_ray.rllib import with_gradmon
from tests.distributed.two_ranks import STATE, TwoRanks
from tests.peer.pairs import HEADS, build_pair, cartpole_config, sample_batch, spaces_of
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
        stock.curr_kl_coeffs_per_module[mid].data.copy_(learner.curr_kl_coeffs_per_module[mid])  # PPO moves it
    expected = {mid: stock_head_norms(stock, batch, mid, {"pi": "pi.", "vf": "vf.", "all": ""}) for mid in mids}
    logged = _update(learner, batch)
    _update(stock, batch)  # PPO's KL coefficients move alike
    for mid in mids:
        assert logged[mid][mn.TELEMETRY_ITERATION] == float(iteration), mid
        assert logged[mid][mn.GLOBAL_GRAD_NORM] == pytest.approx(expected[mid]["all"], rel=1e-4), mid
        for head in ("pi", "vf"):
            assert logged[mid][mn.head_metric(mn.HEAD_GRAD_NORM, head)] == pytest.approx(expected[mid][head], rel=1e-4)


# --- two real learner processes ----------------------------------------------------------------
# tests/distributed/two_ranks.py: ranks 0 and 1 of one gloo world, each a gradmon PPO learner as
# one of two learners (num_learners=2), started once for the module.  Rank 0's batch holds both
# modules, rank 1's only p0 (its own episodes: the two local gradients differ): p0 is averaged
# over 2 learners, p1 over 1 and filled on rank 1.  Only the telemetry's transport is swapped
# for the same SUM on the world (Ray's collective needs a Ray actor), as in test_noise_hook.py.

LR = 0.5
"""SGD's step is ``-LR x gradient``: the oracle.  (Adam's first step, about ``LR x sign``, would
hide a wrong divisor or a mixed loss scale.)"""
SCALE = 2.0**16
SHARDS = (("p0", "p1"), ("p0",))
"""The modules in each rank's batch."""
CASES = {
    "plain-vgs-update": (False, "update"),
    "amp-vgs-gradient": (True, "gradient"),
    "amp-vgs-update": (True, "update"),
}
"""Case -> (a ``GradScaler("cpu")`` of scale ``SCALE``, VGS's ``apply_to``)."""


class _SGDLearner(with_gradmon(PPOTorchLearner)):
    """The gradmon PPO learner with plain SGD at ``LR``."""

    def configure_optimizers_for_module(self, module_id: str, config: Any = None) -> None:
        params = self.get_parameters(self.module[module_id])
        optimizer = torch.optim.SGD(params, lr=LR)
        self.register_optimizer(module_id=module_id, optimizer=optimizer, params=params, lr_or_lr_schedule=LR)


def _rank_setup(rank: int, amp: bool, apply_to: str) -> None:
    """This rank's learner for a case (VGS on, warm-up: its factor is 1); on the first call also
    its batch (episodes of its own seed) and a stock single learner (the oracle's loss)."""
    gradmon = {"heads": HEADS, "vgs": {"enabled": True, "apply_to": apply_to}}
    scaler = functools.partial(torch.amp.GradScaler, "cpu", init_scale=SCALE, backoff_factor=0.5, growth_interval=10**6)
    experimental = {"_torch_grad_scaler_class": scaler} if amp else None
    config = cartpole_config("ppo", _SGDLearner, agents=2, gradmon=gradmon, experimental=experimental)
    old = STATE.pop("learner", None)
    if old is not None:
        old.shutdown()
    learner = config.learners(num_learners=2).build_learner(spaces=spaces_of(config))
    learner._collective._allreduce = dist.all_reduce  # the transport only
    STATE["learner"] = learner
    if "batch" not in STATE:
        sampling = cartpole_config("ppo", PPOTorchLearner, agents=2).debugging(seed=10 + rank)
        STATE["batch"] = sample_batch(sampling, learner, num_timesteps=128)
        stock = cartpole_config("ppo", PPOTorchLearner, agents=2)
        STATE["stock"] = stock.build_learner(spaces=spaces_of(stock))


def _rank_local_gradients(rank: int, modules: tuple[str, ...]) -> dict[str, Any]:
    """The learner's weights and, per module of this rank's batch, the local gradient: autograd
    of the STOCK learner's loss on the batch at those weights (float64 numpy, parameter order)."""
    learner, stock = STATE["learner"], STATE["stock"]
    tensors = stock._convert_batch_type(STATE["batch"])
    weights, grads, names = {}, {}, {}
    for mid in ("p0", "p1"):
        stock.module[mid].set_state(learner.module[mid].unwrapped().get_state())
        stock.curr_kl_coeffs_per_module[mid].data.copy_(learner.curr_kl_coeffs_per_module[mid])  # PPO moves it
        weights[mid] = [p.detach().double().numpy().copy() for p in learner.module[mid].unwrapped().parameters()]
        names[mid] = [n for n, _ in stock.module[mid].unwrapped().named_parameters()]
    for mid in modules:
        module, batch = stock.module[mid].unwrapped(), dict(tensors.policy_batches[mid])
        loss = stock.compute_loss_for_module(
            module_id=mid,
            config=stock.config.get_config_for_module(mid),
            batch=batch,
            fwd_out=module.forward_train(batch),
        )
        grads[mid] = [g.double().numpy() for g in torch.autograd.grad(loss, list(module.parameters()))]
    rows = {mid: len(STATE["batch"].policy_batches[mid]) for mid in modules}
    return {"weights": weights, "grads": grads, "names": names, "rows": rows}


def _rank_update(rank: int, modules: tuple[str, ...], poison: str | None = None) -> dict[str, Any]:
    """One update on this rank's batch of ``modules`` (``poison``: that module's advantages NaN
    here); the weights after it, the logged metrics, each module's loss scale and VGS means."""
    learner, batch = STATE["learner"], STATE["batch"]
    shard = MultiAgentBatch({mid: copy.deepcopy(batch.policy_batches[mid]) for mid in modules}, batch.env_steps())
    if poison is not None:
        shard.policy_batches[poison][Postprocessing.ADVANTAGES][0] = float("nan")
    results = learner.update(batch=shard, timesteps={}, num_epochs=1, minibatch_size=None)
    logged = {mid: {k: v.peek() for k, v in r.items() if hasattr(v, "peek")} for mid, r in results.items()}
    monitors = learner.gradmon_modules
    return {
        "weights": {mid: [p.detach().double().numpy().copy() for p in monitors[mid].params] for mid in ("p0", "p1")},
        "logged": logged,
        "scales": {
            mid: m.grad_scaler.get_scale() if m.grad_scaler is not None else None for mid, m in monitors.items()
        },
        "vgs_mean": {mid: m.vgs.state_dict()["param_grad_mean_ema"].double().numpy() for mid, m in monitors.items()},
    }


@pytest.fixture(scope="module")
def two_learners() -> Any:
    ranks = TwoRanks(preload=[__name__])
    try:
        yield ranks
    finally:
        ranks.close()


@pytest.fixture(scope="module")
def sparse_runs(two_learners: TwoRanks) -> dict[str, tuple[list[dict], list[dict]]]:
    """Per case: (each rank's weights and local gradients before, its update's record)."""
    runs = {}
    for case, (amp, apply_to) in CASES.items():
        two_learners.run(_rank_setup, (amp, apply_to), (amp, apply_to))
        before = two_learners.run(_rank_local_gradients, (SHARDS[0],), (SHARDS[1],))
        runs[case] = (before, two_learners.run(_rank_update, (SHARDS[0],), (SHARDS[1],)))
    return runs


def _mean_gradient(before: list[dict], mid: str) -> list[np.ndarray]:
    """The mean of the local gradients of ``mid`` over the ranks whose batch held it."""
    local = [b["grads"][mid] for b in before if mid in b["grads"]]
    return [sum(gs) / len(local) for gs in zip(*local, strict=True)]


def _assert_replicas_equal(after: list[dict], what: str) -> None:
    for mid in ("p0", "p1"):
        for i, (w0, w1) in enumerate(zip(after[0]["weights"][mid], after[1]["weights"][mid], strict=True)):
            np.testing.assert_array_equal(w0, w1, err_msg=f"{what}: {mid} parameter {i} differs between the learners")


def _assert_stepped(before: dict, after: dict, mean: dict[str, list[np.ndarray]], what: str) -> None:
    """SGD: every weight moved by exactly ``-LR x`` the averaged true-unit gradient."""
    for mid, grads in mean.items():
        for i, (w0, g, w1) in enumerate(zip(before["weights"][mid], grads, after["weights"][mid], strict=True)):
            np.testing.assert_allclose(w1, w0 - LR * g, rtol=1e-5, atol=1e-6, err_msg=f"{what}: {mid} parameter {i}")


@pytest.mark.e2e  # two learner processes
@pytest.mark.parametrize("case", list(CASES))
def test_two_learners_step_each_module_by_its_mean_over_the_learners_that_trained_it(sparse_runs, case):
    """No hang, no ``AssertionError`` from a ``GradScaler`` that never scaled (rank 1 has no p1
    sample), both replicas bit for bit alike, and each equal to the oracle: SGD steps p0 by the
    mean of the two local gradients and p1 by rank 0's alone (autograd of the stock loss, true
    units).  VGS (both modes) learned from that mean: its first mean-|g| EMA is ``(1 - beta) |g|``.
    With AMP each learner's scale of each module is the one it started with (no overflow)."""
    before, after = sparse_runs[case]
    mean = {mid: _mean_gradient(before, mid) for mid in ("p0", "p1")}
    _assert_replicas_equal(after, case)
    for rank in (0, 1):
        _assert_stepped(before[rank], after[rank], mean, f"{case}, rank {rank}")
        for mid in ("p0", "p1"):
            expected = (1 - 0.99) * np.abs(np.concatenate([g.ravel() for g in mean[mid]]))
            np.testing.assert_allclose(after[rank]["vgs_mean"][mid], expected, rtol=1e-5, atol=1e-9, err_msg=mid)
        if CASES[case][0]:
            assert after[rank]["scales"] == {"p0": SCALE, "p1": SCALE}, rank
            assert [after[rank]["logged"][mid][mn.SCALER_SKIPPED_UPDATES] for mid in ("p0", "p1")] == [0.0, 0.0]


def _noise_scale(m0: list[np.ndarray], m1: list[np.ndarray], rows: int) -> float:
    """B_simple of two learners after one update (tests/README: the estimator from per-rank
    gradients): ``|G|^2 = m0.m1``, ``tr(Sigma) = rows |m0 - m1|^2 / 2``; NaN when ``|G|^2 <= 0``."""
    dot = sum(float((a * b).sum()) for a, b in zip(m0, m1, strict=True))
    diff = sum(float(((a - b) ** 2).sum()) for a, b in zip(m0, m1, strict=True))
    return rows * diff / 2 / dot if dot > 0 else math.nan


@pytest.mark.e2e  # two learner processes
@pytest.mark.parametrize("case", ["plain-vgs-update", "amp-vgs-gradient"])
def test_a_partially_trained_modules_noise_scale_is_left_out_and_a_fully_trained_ones_kept(sparse_runs, case):
    """p1, trained by rank 0 only, is "partially trained": no learner reports its noise scale
    (B_simple needs every learner's local gradient).  p0, trained by both, is reported on each
    rank; oracle: the closed form from the two local gradients (autograd of the stock loss) and
    the rank's own row count, per head and over all parameters (left out where ``m0.m1 <= 0``)."""
    before, after = sparse_runs[case]
    prefixes = {mn.head_metric(mn.HEAD_NOISE_SCALE, "pi"): "pi.", mn.head_metric(mn.HEAD_NOISE_SCALE, "vf"): "vf."}
    compared = []
    for rank in (0, 1):
        logged = after[rank]["logged"]
        assert [k for k in logged["p1"] if "noise_scale" in k] == [], f"rank {rank}: p1 is partially trained"
        for key, prefix in {mn.GLOBAL_NOISE_SCALE: "", **prefixes}.items():
            keep = [i for i, n in enumerate(before[0]["names"]["p0"]) if n.startswith(prefix)]
            local = [[b["grads"]["p0"][i] for i in keep] for b in before]
            expected = _noise_scale(*local, rows=before[rank]["rows"]["p0"])
            if math.isnan(expected):
                assert key not in logged["p0"], f"rank {rank}: {key} is undefined"
            else:
                assert logged["p0"][key] == pytest.approx(expected, rel=1e-4), f"rank {rank}: {key}"
                compared.append(key)
    assert mn.GLOBAL_NOISE_SCALE in compared, "p0's noise scale is defined in this batch (its seeds): kept"


@pytest.mark.e2e  # two learner processes
def test_one_learners_overflow_skips_the_module_on_both_and_their_scales_stay_one(two_learners):
    """AMP, VGS on gradients.  Update 1: rank 0's p1 gradient is not finite (a NaN advantage),
    rank 1 has no p1 sample: both learners skip p1's step (weights as they were), count it in
    ``update/scaler_skipped`` and back their p1 scale off to ``SCALE / 2`` (rank 1's too: its
    scaler unscaled the same averaged gradient); p0 steps by its mean on both.  Update 2, both
    ranks train p1 at that one scale: each module steps by its exact mean (a learner still at
    ``SCALE`` would double its share)."""
    two_learners.run(_rank_setup, (True, "gradient"), (True, "gradient"))
    before = two_learners.run(_rank_local_gradients, (SHARDS[0],), (SHARDS[1],))
    after = two_learners.run(_rank_update, (SHARDS[0], "p1"), (SHARDS[1],))
    _assert_replicas_equal(after, "update 1")
    for rank in (0, 1):
        _assert_stepped(before[rank], after[rank], {"p0": _mean_gradient(before, "p0")}, f"update 1, rank {rank}")
        for i, (w0, w1) in enumerate(zip(before[rank]["weights"]["p1"], after[rank]["weights"]["p1"], strict=True)):
            np.testing.assert_array_equal(w1, w0, err_msg=f"rank {rank}: p1 parameter {i} stepped on a NaN gradient")
        assert after[rank]["scales"] == {"p0": SCALE, "p1": SCALE / 2}, rank
        assert [after[rank]["logged"][mid][mn.SCALER_SKIPPED_UPDATES] for mid in ("p0", "p1")] == [0.0, 1.0], rank
    both = (("p0", "p1"), ("p0", "p1"))
    before = two_learners.run(_rank_local_gradients, *[(s,) for s in both])
    after = two_learners.run(_rank_update, *[(s,) for s in both])
    _assert_replicas_equal(after, "update 2")
    mean = {mid: _mean_gradient(before, mid) for mid in ("p0", "p1")}
    for rank in (0, 1):
        _assert_stepped(before[rank], after[rank], mean, f"update 2, rank {rank}")
        assert after[rank]["scales"] == {"p0": SCALE, "p1": SCALE / 2}, rank
