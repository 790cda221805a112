"""``rllib/learner.py``: GradmonPPOTorchLearner on a real RLlib learner and real episodes (no Ray cluster).

Every gradient number it reports per minibatch is recomputed along a second path: parameters are
fetched by module attribute name (``module.heads[name]``, ``module.value_head``), never through
``head_parameter_groups()`` or ``GradientNormPlan``; logits are sliced with a layout computed from the
env's action space (not the module's); losses are RLlib's own (the stock ``PPOTorchLearner``) or
written by hand; the first update equals stock RLlib PPO's with fused Adam.  The iteration-level
metrics (means, prev, trends, bands, latches, clock, VGS): ``test_monitor_step.py``.
"""

from __future__ import annotations

import copy
import math

import gymnasium as gym
import pytest
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.learner import PROBE_STATE_KEY, TELEMETRY_STATE_KEY, GradmonPPOTorchLearner
from gradmon_ray.rllib.local_learner import build_local_learner, env_spaces, sample_episodes, train_batch, update
from gradmon_ray.telemetry import GradientNorms, NoiseScaleTracker
from gradmon_ray.telemetry.noise_scale import GLOBAL_ENTRY

MID = DEFAULT_MODULE_ID

EXPECTED_HEADS = (
    "alpha_curve",
    "alpha_speed",
    "alpha_target",
    "blueprint",
    "op",
    "slot",
    "style",
    "tempo",
    "value",
)


def _cfg(**ppo):
    base = {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 2}
    base.update(ppo)
    return config_from_dict({"seed": 0, "ppo": base, "model": {"trunk_hiddens": [32, 32]}})


@pytest.fixture(scope="module")
def shared():
    """One learner build and one batch of real episodes, reused (read-only) by the tests."""
    cfg = _cfg()
    learner = build_local_learner(cfg)
    batch = train_batch(learner, sample_episodes(cfg, learner, 256))
    return cfg, learner, batch


def _fresh(cfg, fused=True):
    c = copy.deepcopy(cfg)
    c.telemetry.fused_optimizer = fused
    return build_local_learner(c)


def _rl_module(learner):
    return learner.module[DEFAULT_MODULE_ID].unwrapped()


def _head_bias(learner, head):
    return _rl_module(learner).heads[head][-1].bias


def test_reports_the_nine_heads_in_order_under_their_names(shared):
    """The head list (written out above) and the logged names; the values: the oracle tests below."""
    cfg, learner, batch = shared
    results = update(learner, batch, cfg)
    tele = learner.last_telemetry
    assert learner.head_names == EXPECTED_HEADS
    assert tuple(tele.head_norms) == EXPECTED_HEADS
    assert tele.nan_grad_count == 0 and tele.inf_grad_count == 0 and tele.skipped == 0  # a clean batch
    assert not any(tele.nan_latched.values()) and not any(tele.inf_latched.values())
    logged = results[DEFAULT_MODULE_ID]
    for head in EXPECTED_HEADS:
        assert f"grad/head/{head}/norm" in logged
    assert "latch/nan/op" in logged and "latch/inf/tempo" in logged and "grad/global_norm" in logged


def test_norms_equal_the_gradients_left_in_the_parameters_fetched_by_attribute_name(shared):
    """One minibatch, no clipping: the reported norms are the norms of the grads left in p.grad,
    over ``module.heads[h]`` / ``module.value_head`` (not the product's own head groups)."""
    _, _, batch = shared
    c = _cfg(grad_clip=None, num_epochs=1, minibatch_size=256, train_batch_size=256)
    learner = _fresh(c)
    learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    tele = learner.last_telemetry
    assert tele.minibatches == 1
    module = _rl_module(learner)
    owners = {name: list(head.parameters()) for name, head in module.heads.items()}
    owners["value"] = list(module.value_head.parameters())
    assert set(owners) == set(EXPECTED_HEADS)
    for head, params in owners.items():
        want = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
        assert tele.head_norms[head] == pytest.approx(want, rel=1e-5), head
    all_sq = sum(float(p.grad.double().pow(2).sum()) for p in module.parameters())
    assert tele.global_norm == pytest.approx(math.sqrt(all_sq), rel=1e-5)


def test_norms_are_taken_before_clipping(shared):
    _, _, batch = shared
    learner = _fresh(_cfg(grad_clip=1e-4, num_epochs=1))
    learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    reported = learner.last_telemetry.global_norm
    left = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in _rl_module(learner).parameters()))
    assert left == pytest.approx(1e-4, rel=1e-3)  # the optimizer saw clipped grads ...
    assert reported > 100 * left  # ... telemetry saw them before clipping


@pytest.mark.parametrize("fused", [True, False], ids=["fused-on-device-skip", "host-sync-skip"])
def test_nan_in_one_head_latches_that_head_only_and_skips_the_update(shared, fused):
    cfg, _, batch = shared
    learner = _fresh(cfg, fused=fused)
    optimizer = next(iter(learner._optimizer_parameters))
    update(learner, batch, cfg)  # one clean iteration so the optimizer has state
    params_before = {k: v.clone() for k, v in _rl_module(learner).state_dict().items()}
    opt_before = copy.deepcopy(optimizer.state_dict())
    with torch.no_grad():
        saved = _head_bias(learner, "tempo").clone()
        _head_bias(learner, "tempo").fill_(float("nan"))
    update(learner, batch, cfg)
    tele = learner.last_telemetry
    assert [h for h, v in tele.nan_latched.items() if v] == ["tempo"]
    assert tele.nan_first_iteration == {"tempo": 2}
    assert tele.skipped == tele.minibatches > 0 and tele.nan_grad_count > 0
    for key, value in _rl_module(learner).state_dict().items():  # nothing applied ...
        if key != "heads.tempo.0.bias":
            assert torch.equal(value, params_before[key]), key
    opt_after = optimizer.state_dict()  # ... and the optimizer state untouched
    for pid, state in opt_before["state"].items():
        for name, tensor in state.items():
            assert torch.equal(opt_after["state"][pid][name], tensor), (pid, name)
    with torch.no_grad():
        _head_bias(learner, "tempo").copy_(saved)
    for _ in range(2):
        update(learner, batch, cfg)
    tele = learner.last_telemetry
    assert tele.skipped == 0 and tele.skipped_total == tele.minibatches
    assert tele.nan_latched["tempo"] and sum(tele.nan_latched.values()) == 1  # latch survives clean updates
    assert all(math.isfinite(p.detach().sum().item()) for p in _rl_module(learner).parameters())

    restored = _fresh(cfg)
    restored.set_state(learner.get_state())
    update(restored, batch, cfg)
    assert restored.last_telemetry.nan_latched["tempo"] and restored.last_telemetry.nan_first_iteration == {"tempo": 2}
    assert restored.last_telemetry.iteration == 5


def test_inf_log_prob_latches_inf_not_nan(shared):
    cfg, _, batch = shared
    learner = _fresh(cfg)
    taken = batch.policy_batches[DEFAULT_MODULE_ID]["actions"]["slot"]
    with torch.no_grad():
        bias = _head_bias(learner, "slot")
        bias[int(taken[0])] = float("-inf")  # that action's log-prob becomes -inf
    update(learner, batch, cfg)
    tele = learner.last_telemetry
    assert [h for h, v in tele.inf_latched.items() if v] == ["slot"]
    assert not any(tele.nan_latched.values())


def test_noise_scale_rows_count_each_minibatch_of_the_modules_own_log_probs():
    """The noise-scale hook's row count (``B`` of B_simple) is the module's log-prob rows of each
    minibatch its norms are added for: a minibatch without this module's log-probs (another
    module's data only) adds its norms with 0 rows, not the previous minibatch's rows again.
    The tracker is set by hand (it needs 2+ learners); oracle: the rows this test records."""
    cfg = _cfg()
    cfg.vgs.enabled = False
    learner = build_local_learner(cfg)
    try:
        monitor = learner.gradmon_modules[MID]
        monitor.noise = NoiseScaleTracker([*monitor.groups, GLOBAL_ENTRY])
        heads = len(monitor.groups)
        norms = GradientNorms(torch.ones(heads), torch.tensor(2.0), torch.zeros(()), torch.zeros(()))
        monitor.record_logp(torch.zeros(16, len(monitor.tracker.latch_heads)), None)
        monitor.after_norms(norms.found_nonfinite, norms)  # a minibatch with 16 of its rows
        monitor.after_norms(norms.found_nonfinite, norms)  # a minibatch without its rows
        monitor.record_logp(torch.zeros(8, len(monitor.tracker.latch_heads)), None)
        monitor.after_norms(norms.found_nonfinite, norms)
        assert monitor.noise_hook.take_rows() == 16 + 0 + 8
    finally:
        learner.shutdown()


def test_state_contains_telemetry_only_when_asked(shared):
    _, learner, _ = shared
    assert TELEMETRY_STATE_KEY in learner.get_state()
    assert TELEMETRY_STATE_KEY not in learner.get_state(components="rl_module")


def test_telemetry_off_logs_nothing(shared):
    cfg, _, batch = shared
    c = copy.deepcopy(cfg)
    c.telemetry.enabled = False
    learner = build_local_learner(c)
    results = update(learner, batch, c)
    assert learner.last_telemetry is None
    assert not [k for k in results[DEFAULT_MODULE_ID] if str(k).startswith("grad/")]


def test_configured_regularizers_enter_the_training_loss():
    cfg = config_from_dict(
        {
            "seed": 6,
            "ppo": {"train_batch_size": 128, "minibatch_size": 128, "num_epochs": 1},
            "model": {"trunk_hiddens": [8]},
            "regularizers": [
                {"name": "wl2", "fn": "weight_l2", "weight": 0.25},
                {"name": "off", "fn": "logit_l2", "weight": 100.0, "enabled": False},
            ],
        }
    )
    learner = build_local_learner(cfg)
    batch = learner._convert_batch_type(train_batch(learner, sample_episodes(cfg, learner, 128)))
    tensors = dict(batch.policy_batches[DEFAULT_MODULE_ID])
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    fwd = module.forward_train(tensors)
    config = learner.config.get_config_for_module(DEFAULT_MODULE_ID)
    with_reg = learner.compute_loss_for_module(module_id=DEFAULT_MODULE_ID, config=config, batch=tensors, fwd_out=fwd)
    learner._regularizers = []
    without = learner.compute_loss_for_module(module_id=DEFAULT_MODULE_ID, config=config, batch=tensors, fwd_out=fwd)
    expected = 0.25 * sum(float(p.detach().pow(2).sum()) for p in module.parameters())
    assert float(with_reg.detach() - without.detach()) == pytest.approx(expected, rel=1e-5)


def test_configured_band_edges_judge_the_learners_heads():
    """telemetry.bands reaches the learner's tracker: value by its own edges, action heads by theirs."""
    from gradmon_ray.telemetry import BandSet

    bands = {"action": {"dead_below": 0.001}, "value": {"healthy_max": 20.0, "elevated_max": 80.0}}
    cfg = config_from_dict({"seed": 0, "model": {"trunk_hiddens": [16]}, "telemetry": {"bands": bands}})
    learner = build_local_learner(cfg)
    assert learner.gradmon_modules[DEFAULT_MODULE_ID].tracker.bands == BandSet.from_dict(bands)
    assert learner.gradmon_modules[DEFAULT_MODULE_ID].tracker.bands.value.edges == (0.01, 0.1, 20.0, 80.0)
    assert learner.gradmon_modules[DEFAULT_MODULE_ID].tracker.bands.action.edges == (0.001, 0.1, 2.0, 5.0)


# --- per minibatch, against autograd of RLlib's own loss and hand-built losses ------------------


def _oracle_cfg(**ppo):
    base = {"train_batch_size": 256, "minibatch_size": 256, "num_epochs": 1, "grad_clip": None}
    base.update(ppo)
    return config_from_dict({"seed": 3, "ppo": base, "model": {"trunk_hiddens": [32, 32]}})


@pytest.fixture(scope="module")
def episodes_cfg():
    cfg = _oracle_cfg()
    learner = build_local_learner(cfg)
    return cfg, sample_episodes(cfg, learner, 256)


def _action_slices(cfg) -> dict[str, slice]:
    """Logit columns per action head, from the env's Dict action space (sorted keys, as dm-tree flattens)."""
    _, action_space = env_spaces(cfg)
    assert isinstance(action_space, gym.spaces.Dict)
    out, start = {}, 0
    for name in sorted(action_space.spaces):
        n = int(action_space[name].n)
        out[name] = slice(start, start + n)
        start += n
    return out


def _norm_by_attribute(loss: torch.Tensor, module: torch.nn.Module) -> dict[str, float]:
    """L2 norm of d loss / d params for each head, params fetched by attribute name, in float64."""
    owners = {name: list(head.parameters()) for name, head in module.heads.items()}
    owners["value"] = list(module.value_head.parameters())
    flat = [p for ps in owners.values() for p in ps]
    grads = torch.autograd.grad(loss, flat, retain_graph=True, allow_unused=True)
    out, i = {}, 0
    for name, ps in owners.items():
        chunk = [g for g in grads[i : i + len(ps)] if g is not None]
        out[name] = math.sqrt(sum(float(g.double().pow(2).sum()) for g in chunk))
        i += len(ps)
    return out


def _learner_with_loss(cfg, loss_fn):
    """Gradmon's learner whose training loss is ``loss_fn(module, batch, fwd_out)``; everything else is real."""

    class HandBuiltLoss(GradmonPPOTorchLearner):
        @override(GradmonPPOTorchLearner)
        def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
            super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)
            return loss_fn(self.module[module_id].unwrapped(), batch, fwd_out)

    return build_local_learner(cfg, learner_class=HandBuiltLoss)


def _logged_head_norms(results, heads) -> dict[str, float]:
    logged = results[MID]
    return {h: float(logged[f"grad/head/{h}/norm"]) for h in heads}


def test_a_loss_on_one_heads_logits_moves_only_that_heads_norm(episodes_cfg):
    """By construction: a loss of head h's logits gives h a non-zero norm and every other head exactly 0.

    One learner for every target (a build is about a CPU-second): its loss reads the target of the
    update under way, and each update's oracle is taken from the weights that update starts from."""
    cfg, episodes = episodes_cfg
    slices = _action_slices(cfg)
    targets = [*slices, "value"]
    current: list[str] = []

    def loss_fn(module, batch, fwd_out):
        logits = fwd_out[Columns.ACTION_DIST_INPUTS]
        values = module.compute_values(batch, embeddings=fwd_out[Columns.EMBEDDINGS])
        # 0 x everything: every parameter gets an exactly-zero gradient, never None.
        zero = 0.0 * (logits.sum() + values.sum())
        if current[-1] == "value":
            return values.pow(2).mean() + zero
        return torch.logsumexp(2.0 * logits[:, slices[current[-1]]], dim=-1).mean() + zero

    learner = _learner_with_loss(cfg, loss_fn)
    batch = train_batch(learner, episodes)
    for target in targets:
        current.append(target)
        before = copy.deepcopy(_rl_module(learner))
        tensors = dict(learner._convert_batch_type(batch).policy_batches[MID])
        expected = _norm_by_attribute(loss_fn(before, tensors, before.forward_train(tensors)), before)
        results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        reported = _logged_head_norms(results, targets)
        assert reported[target] > 1e-3, (target, reported)
        assert reported[target] == pytest.approx(expected[target], rel=1e-4), target
        for other in targets:
            if other != target:
                assert reported[other] == 0.0, (target, other, reported)
        # The global norm covers the trunk as well: at least the target head's norm.
        assert float(results[MID]["grad/global_norm"]) >= reported[target] * (1 - 1e-6)


def test_ppo_minibatch_norms_equal_autograd_of_rllibs_own_loss_by_attribute_name(episodes_cfg):
    """A real minibatch: reported norms == autograd.grad of stock RLlib PPO's loss w.r.t. module.heads[h]."""
    cfg, episodes = episodes_cfg
    learner = build_local_learner(cfg)
    batch = train_batch(learner, episodes)
    stock = build_local_learner(cfg, learner_class=PPOTorchLearner)
    stock.module[MID].set_state(learner.module[MID].get_state())  # the pre-update weights
    tensors = dict(stock._convert_batch_type(batch).policy_batches[MID])
    module = _rl_module(stock)
    loss = stock.compute_loss_for_module(
        module_id=MID,
        config=stock.config.get_config_for_module(MID),
        batch=tensors,
        fwd_out=module.forward_train(tensors),
    )
    expected = _norm_by_attribute(loss, module)
    all_grads = torch.autograd.grad(loss, list(module.parameters()), allow_unused=True)
    expected_global = math.sqrt(sum(float(g.double().pow(2).sum()) for g in all_grads if g is not None))

    results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    reported = _logged_head_norms(results, expected)
    assert len({round(v, 6) for v in expected.values()}) == len(expected)  # distinct: a swap would show
    for head, value in expected.items():
        assert reported[head] == pytest.approx(value, rel=1e-4), head
    assert float(results[MID]["grad/global_norm"]) == pytest.approx(expected_global, rel=1e-4)


# --- skip flag: NaN, +Inf, -Inf, mixed ----------------------------------------------------------


@pytest.fixture(scope="module")
def skip_learners(episodes_cfg):
    """One learner per optimizer path and its state as built: each case below starts from that
    state again (``set_state``: weights, optimizer, telemetry), not from a build of its own."""
    learners = {}
    for fused in (True, False):
        cfg = _oracle_cfg(grad_clip=None)
        cfg.telemetry.fused_optimizer = fused
        learner = build_local_learner(cfg)
        learners[fused] = (learner, copy.deepcopy(learner.get_state()))
    return learners


@pytest.mark.parametrize(
    ("values", "skipped"),
    [
        ([float("nan")], True),
        ([float("inf")], True),
        ([float("-inf")], True),
        ([float("nan"), float("-inf"), float("inf")], True),
        ([3e38], False),  # finite although its square overflows: nothing to skip
        ([], False),
    ],
    ids=["nan", "+inf", "-inf", "mixed", "finite-huge", "finite"],
)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_non_finite_gradients_skip_the_step_and_are_counted_exactly(
    episodes_cfg, skip_learners, values, skipped, fused
):
    _, episodes = episodes_cfg
    learner, built = skip_learners[fused]
    learner.set_state(copy.deepcopy(built))
    module = _rl_module(learner)
    target = module.heads["op"][0].weight  # by attribute name

    def poison(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone().reshape(-1)
        out[: len(values)] = torch.tensor(values, dtype=out.dtype)
        return out.reshape(grad.shape)

    handle = target.register_hook(poison)
    batch = train_batch(learner, episodes)
    before = [p.detach().clone() for p in module.parameters()]
    try:
        learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    finally:
        handle.remove()
    changed = [not torch.equal(p.detach(), b) for p, b in zip(module.parameters(), before, strict=True)]
    tele = learner.last_telemetry
    assert tele.minibatches == 1
    assert tele.skipped == int(skipped)
    assert tele.nan_grad_count == sum(math.isnan(v) for v in values)
    assert tele.inf_grad_count == sum(math.isinf(v) for v in values)
    if skipped:
        assert not any(changed)
    else:
        assert all(changed)


# --- learning parity: gradmon's first update == stock RLlib PPO's ------------------------------


class FusedAdamPPOTorchLearner(PPOTorchLearner):
    """Stock RLlib PPO as a competent user configures it: fused Adam."""

    @override(TorchLearner)
    def configure_optimizers_for_module(self, module_id, config=None):
        params = self.get_parameters(self._module[module_id])
        self.register_optimizer(
            module_id=module_id,
            optimizer=torch.optim.Adam(params, fused=True),
            params=params,
            lr_or_lr_schedule=config.lr,
        )


@pytest.mark.parametrize("grad_clip", [None, 0.05, 100.0], ids=["no-clip", "clip-binding", "clip-slack"])
def test_first_update_equals_stock_rllib_ppo_with_fused_adam(episodes_cfg, grad_clip):
    _, episodes = episodes_cfg
    cfg = _oracle_cfg(grad_clip=grad_clip, minibatch_size=64, num_epochs=2, lr=1e-3)
    gradmon = build_local_learner(cfg)
    stock = build_local_learner(cfg, learner_class=FusedAdamPPOTorchLearner)
    stock.module[MID].set_state(gradmon.module[MID].get_state())
    batch = train_batch(gradmon, episodes)
    start = {k: v.clone() for k, v in _rl_module(gradmon).state_dict().items()}
    for learner in (gradmon, stock):
        learner.update(batch=batch, timesteps={}, num_epochs=2, minibatch_size=64, shuffle_batch_per_epoch=False)
    moved = 0.0
    for (name, got), want in zip(
        _rl_module(gradmon).state_dict().items(), _rl_module(stock).state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, float((got - start[name]).abs().max()))
    assert moved > 1e-4  # the update did something


# --- the probe's clock across a checkpoint restore ------------------------------------------------


def test_probe_iteration_count_survives_a_checkpoint_restore(shared):
    """The learner's own iteration count (what probe requests are numbered and scheduled by)
    continues across ``get_state`` / ``set_state``: the test counts 2, then 3."""
    cfg, _, batch = shared
    learner = _fresh(cfg)
    for _ in range(2):
        learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    state = learner.get_state(components=[PROBE_STATE_KEY, TELEMETRY_STATE_KEY])
    assert state[PROBE_STATE_KEY]["iterations_done"] == 2
    restored = _fresh(cfg)
    restored.set_state(state)
    assert restored.get_state(components=[PROBE_STATE_KEY])[PROBE_STATE_KEY]["iterations_done"] == 2
    restored.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    assert restored.get_state(components=[PROBE_STATE_KEY])[PROBE_STATE_KEY]["iterations_done"] == 3
    assert restored.last_telemetry.iteration == 3
