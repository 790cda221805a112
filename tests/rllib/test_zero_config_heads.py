"""Zero-config heads on RLlib's default PPO, APPO and IMPALA torch modules (no Ray needed).

Oracle: ``torch.autograd.grad`` of a stock-style loss (log-probs of sampled actions under the
module's own train action distribution, plus a value loss) with respect to the WHOLE policy
output weight and bias, fetched by name from ``named_parameters()``, then sliced by row ranges
written out here by hand from the action space (a Box component's diagonal Gaussian takes
2 x dim inputs; a Dict's components in sorted-key order).  Nothing here uses the product's
row ranges or ``action_components``.

Bugs these catch: components in declaration instead of dm-tree order, a Box given dim instead
of 2 x dim rows, off-by-one row ranges, the bias entries forgotten, every component given the
whole layer, heads out of order, ``vf`` missing, given ``heads`` not overriding, an unhelpful
error for a regex that matches nothing.
"""

from __future__ import annotations

import logging
import math
import re
from collections import OrderedDict

import gymnasium as gym
import pytest
import torch
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.algorithms.impala import IMPALAConfig
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.rl_module import RLModuleSpec

from gradmon_ray.rllib.head_health import head_sizes
from gradmon_ray.rllib.heads import action_heads, head_parameter_groups, latch_heads
from gradmon_ray.telemetry import GradientNormPlan, per_head_grad_norms
from gradmon_ray.telemetry.head_norms import ParamRows
from tests.rllib.fault_injection import FaultInjection
from tests.rllib.user_module import TinyActorCritic

ALGOS = {"ppo": PPOConfig, "appo": APPOConfig, "impala": IMPALAConfig}
OBS = gym.spaces.Box(-1.0, 1.0, (5,))
# (space, {head: (first row, end row)} of the policy output layer), written out by hand.
SPACES = {
    "discrete": (gym.spaces.Discrete(3), {"pi": (0, 3)}),
    "multidiscrete": (gym.spaces.MultiDiscrete([3, 4, 2]), {"a0": (0, 3), "a1": (3, 7), "a2": (7, 9)}),
    # Declared z, b, m; RLlib's logits are in sorted-key order b (Box: 2 x 2), m (2 + 3), z (3).
    "dict-mixed": (
        gym.spaces.Dict(
            OrderedDict(
                [
                    ("z", gym.spaces.Discrete(3)),
                    ("b", gym.spaces.Box(-1.0, 1.0, (2,))),
                    ("m", gym.spaces.MultiDiscrete([2, 3])),
                ]
            )
        ),
        {"b": (0, 4), "m": (4, 9), "z": (9, 12)},
    ),
    "dict-discrete": (
        gym.spaces.Dict(OrderedDict([("shape", gym.spaces.Discrete(4)), ("colour", gym.spaces.Discrete(2))])),
        {"colour": (0, 2), "shape": (2, 6)},
    ),
    # A Tuple keeps its order: a0 (Discrete 3), a1 (Box: 2 x 1), a2 (Discrete 2).
    "tuple": (
        gym.spaces.Tuple([gym.spaces.Discrete(3), gym.spaces.Box(-1.0, 1.0, (1,)), gym.spaces.Discrete(2)]),
        {"a0": (0, 3), "a1": (3, 5), "a2": (5, 7)},
    ),
}
PI_W, PI_B, VF_W, VF_B = "pi.net.mlp.0.weight", "pi.net.mlp.0.bias", "vf.net.mlp.0.weight", "vf.net.mlp.0.bias"


def default_module(algo: str, space: gym.Space, **model_config):
    """RLlib's default RLModule of ``algo`` for ``space``, from its own spec and catalog."""
    config = ALGOS[algo]()
    spec = config.get_default_rl_module_spec()
    spec.observation_space, spec.action_space = OBS, space
    spec.model_config = {**config.model_config, **model_config}
    return spec.build()


def stock_style_loss(module, seed: int = 0) -> torch.Tensor:
    """-mean log-prob of actions sampled from the module's own train distribution + a value loss."""
    gen = torch.Generator().manual_seed(seed)
    batch = {Columns.OBS: torch.rand(16, 5, generator=gen) * 2 - 1}
    out = module.forward_train(batch)
    logits = out[Columns.ACTION_DIST_INPUTS]
    dist_cls = module.get_train_action_dist_cls()
    torch.manual_seed(seed)
    with torch.no_grad():
        actions = dist_cls.from_logits(logits.detach()).sample()
    logp = dist_cls.from_logits(logits).logp(actions)
    values = module.compute_values(batch, embeddings=out.get(Columns.EMBEDDINGS))
    targets = torch.randn(16, generator=gen)
    return -logp.mean() + 0.5 * ((values - targets) ** 2).mean()


def oracle_norms(module, loss: torch.Tensor, rows: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Per head: L2 norm of d loss / d (whole output weight, bias), sliced by ``rows``; and vf."""
    named = dict(module.named_parameters())
    gw, gb, gvw, gvb = torch.autograd.grad(
        loss, [named[PI_W], named[PI_B], named[VF_W], named[VF_B]], retain_graph=True
    )
    out = {}
    for head, (lo, hi) in rows.items():
        out[head] = float(torch.linalg.vector_norm(torch.cat([gw[lo:hi].reshape(-1), gb[lo:hi]]).double()))
    out["vf"] = float(torch.linalg.vector_norm(torch.cat([gvw.reshape(-1), gvb]).double()))
    return out


@pytest.mark.parametrize("space_id", list(SPACES))
@pytest.mark.parametrize("algo", list(ALGOS))
def test_zero_config_head_norms_equal_autograd_of_the_sliced_output_layer(algo, space_id):
    space, rows = SPACES[space_id]
    module = default_module(algo, space)
    groups = head_parameter_groups(module, {})
    assert list(groups) == [*rows, "vf"]  # action components in RLlib's logit order, then vf
    loss = stock_style_loss(module)
    expected = oracle_norms(module, loss, rows)
    params = [p for p in module.parameters() if p.requires_grad]
    all_grads = torch.autograd.grad(loss, params, retain_graph=True)
    module.zero_grad(set_to_none=True)
    loss.backward()
    result = GradientNormPlan(groups, params).compute()
    got = dict(zip(groups, result.head_norms.tolist(), strict=True))
    for head, want in expected.items():
        assert want > 1e-4, head  # a real gradient, not two zeros agreeing
        assert got[head] == pytest.approx(want, rel=1e-5), head
    assert per_head_grad_norms(groups).tolist() == pytest.approx(list(expected.values()), rel=1e-5)
    want_global = math.sqrt(sum(float(g.double().pow(2).sum()) for g in all_grads))
    assert result.global_norm.item() == pytest.approx(want_global, rel=1e-5)
    if space_id != "discrete":  # one name per component: norms, latches and head health agree
        assert latch_heads(module) == tuple(action_heads(groups))


def test_free_log_std_box_head_is_the_output_layer_and_log_std():
    module = default_module("ppo", gym.spaces.Box(-1.0, 1.0, (2,)), free_log_std=True)
    groups = head_parameter_groups(module, {})
    named = dict(module.named_parameters())
    assert list(groups) == ["pi", "vf"]
    assert [id(p) for p in groups["pi"]] == [id(named[PI_W]), id(named[PI_B]), id(named["pi.log_std"])]
    loss = stock_style_loss(module)
    grads = torch.autograd.grad(loss, [named[PI_W], named[PI_B], named["pi.log_std"]], retain_graph=True)
    loss.backward()
    got = GradientNormPlan(groups, list(module.parameters())).compute().head_norms[0].item()
    assert got == pytest.approx(math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads)), rel=1e-5)


def test_given_heads_override_zero_config():
    module = default_module("ppo", SPACES["multidiscrete"][0])
    named = dict(module.named_parameters())
    groups = head_parameter_groups(module, {"policy": r"^pi\.", "critic": r"^vf\."})
    assert list(groups) == ["policy", "critic"]
    assert [id(p) for p in groups["policy"]] == [id(named[PI_W]), id(named[PI_B])]
    assert [id(p) for p in groups["critic"]] == [id(named[VF_W]), id(named[VF_B])]


def test_an_unmatched_regex_lists_every_parameter_grouped_by_prefix():
    module = default_module("ppo", gym.spaces.Discrete(2))
    layers = "net.mlp.0.weight, net.mlp.0.bias, net.mlp.2.weight, net.mlp.2.bias"
    listing = (
        f"encoder.actor_encoder: [{layers}]; encoder.critic_encoder: [{layers}]; "
        "pi: [net.mlp.0.weight, net.mlp.0.bias]; vf: [net.mlp.0.weight, net.mlp.0.bias]"
    )
    with pytest.raises(ValueError) as err:
        head_parameter_groups(module, {"pi": r"^pi\.", "value": r"^value_head\."})
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("gradmon head 'value' (regex '^value_head\\\\.') matches no trainable parameter")
    assert message.endswith(f"its parameters: {listing}")


def _child_norms(module, loss: torch.Tensor) -> dict[str, float]:
    """Per top-level child (by its ``named_parameters()`` prefix, written out): autograd's L2 norm."""
    named = dict(module.named_parameters())
    out = {}
    for child in dict.fromkeys(name.split(".")[0] for name in named):
        grads = torch.autograd.grad(loss, [p for n, p in named.items() if n.startswith(child + ".")], retain_graph=True)
        out[child] = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    return out


def _assert_children_are_the_heads(module, loss: torch.Tensor, children: list[str]) -> None:
    groups = head_parameter_groups(module, {})
    assert list(groups) == children
    expected = _child_norms(module, loss)
    params = [p for p in module.parameters() if p.requires_grad]
    module.zero_grad(set_to_none=True)
    loss.backward()
    got = dict(zip(groups, GradientNormPlan(groups, params).compute().head_norms.tolist(), strict=True))
    for head in children:
        assert expected[head] > 1e-6, head  # a real gradient, not two zeros agreeing
        assert got[head] == pytest.approx(expected[head], rel=1e-5), head


def test_a_module_that_is_not_a_default_module_gets_its_children_as_heads_and_one_line(caplog):
    module = RLModuleSpec(
        module_class=TinyActorCritic, observation_space=OBS, action_space=gym.spaces.Discrete(2)
    ).build()
    batch = {Columns.OBS: torch.rand(8, 5) * 2 - 1}
    out = module.forward_train(batch)
    values = module.compute_values(batch, embeddings=out[Columns.EMBEDDINGS])
    loss = out[Columns.ACTION_DIST_INPUTS].pow(2).sum() + values.pow(3).sum()
    with caplog.at_level(logging.WARNING, logger="gradmon_ray.rllib.zero_config_heads"):
        _assert_children_are_the_heads(module, loss, ["body", "policy_out", "value_out"])
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line
    assert line.startswith("gradmon: TinyActorCritic has no per-component heads (no head_parameter_groups() and no")
    assert "its heads are its top-level children ['body', 'policy_out', 'value_out']" in line
    assert "learner_config_dict={'gradmon': {'heads': {" in line and "'value_heads'" in line
    assert "body: [0.weight, 0.bias]; policy_out: [weight, bias]; value_out: [weight, bias]" in line


def test_a_module_without_children_is_one_head_and_one_without_parameters_is_refused():
    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 2))

    flat = Flat()
    groups = head_parameter_groups(flat, {})
    assert list(groups) == ["module"] and groups["module"][0] is flat.w
    flat.w.requires_grad_(False)
    with pytest.raises(ValueError, match=r"^Flat has no trainable parameter: gradmon has nothing to monitor$"):
        head_parameter_groups(flat, {})


@pytest.mark.parametrize(
    ("space", "reason"),
    [
        (gym.spaces.Dict({"vf": gym.spaces.Discrete(2), "x": gym.spaces.Discrete(2)}), r"keys \['vf'\] cannot"),
        (
            gym.spaces.Dict({"a": gym.spaces.Dict({"b": gym.spaces.Discrete(2)}), "c": gym.spaces.Discrete(2)}),
            r"a Dict action space with Dict/Tuple components",
        ),
        (gym.spaces.Tuple([gym.spaces.Tuple([gym.spaces.Discrete(2)])]), r"a Tuple action space with Dict/Tuple"),
    ],
)
def test_a_default_module_without_components_falls_back_to_its_children(space, reason, caplog):
    module = default_module("ppo", space)
    loss = stock_style_loss(module)
    with caplog.at_level(logging.WARNING, logger="gradmon_ray.rllib.zero_config_heads"):
        _assert_children_are_the_heads(module, loss, ["encoder", "pi", "vf"])
    (line,) = [r.getMessage() for r in caplog.records]
    assert re.search(rf"DefaultPPOTorchRLModule has no per-component heads \(.*{reason}", line), line


def test_overlapping_row_heads_on_a_default_module_are_refused():
    module = default_module("ppo", SPACES["multidiscrete"][0])
    groups = head_parameter_groups(module, {})
    weight = groups["a1"][0].param
    groups["extra"] = [ParamRows(weight, slice(6, 8))]  # a1 is rows 3:7
    with pytest.raises(ValueError, match=r"rows 3:7 \(head 'a1'\) and 6:8 \(head 'extra'\) .* overlap"):
        GradientNormPlan(groups, list(module.parameters()))


def test_latch_and_head_health_names_follow_the_components():
    module = default_module("ppo", SPACES["multidiscrete"][0])
    assert latch_heads(module) == ("a0", "a1", "a2")
    assert head_sizes(module, latch_heads(module)) == (3, 4, 2)
    single = default_module("ppo", gym.spaces.MultiDiscrete([5]))
    assert latch_heads(single) == ("a0",) and list(head_parameter_groups(single, {})) == ["a0", "vf"]
    assert head_sizes(single, latch_heads(single)) == (5,)
    pair = default_module("ppo", gym.spaces.Tuple([gym.spaces.Discrete(3), gym.spaces.Discrete(2)]))
    assert latch_heads(pair) == ("a0", "a1") and list(head_parameter_groups(pair, {})) == ["a0", "a1", "vf"]
    assert head_sizes(pair, latch_heads(pair)) == (3, 2)  # RLlib's own categoricals: entropy/KL per component
    mixed = default_module("ppo", SPACES["tuple"][0])
    assert latch_heads(mixed) == ("a0", "a1", "a2") and head_sizes(mixed, latch_heads(mixed)) is None


def test_an_injected_gradient_fault_stays_in_its_row_head():
    """``fault_injection.grad`` on a zero-config component: the NaN lands in that component's
    first weight row only (the whole-tensor NaN count is 1), the other components stay exact."""
    module = default_module("ppo", SPACES["multidiscrete"][0])
    groups = head_parameter_groups(module, {})
    faults = FaultInjection.from_dict({"grad": [{"rank": 0, "head": "a1", "iteration": 1, "value": "nan"}]})
    handles = faults.install_grad_hooks(groups, rank=0, current_iteration=lambda: 1)
    try:
        loss = stock_style_loss(module)
        clean = oracle_norms(module, loss, SPACES["multidiscrete"][1])  # autograd.grad: hooks run too
        module.zero_grad(set_to_none=True)
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    weight = dict(module.named_parameters())[PI_W]
    nan_at = torch.isnan(weight.grad).nonzero().tolist()
    assert nan_at == [[3, 0]]  # row 3 = a1's first row, first column
    result = GradientNormPlan(groups, list(module.parameters())).compute()
    got = dict(zip(groups, result.head_norms.tolist(), strict=True))
    assert math.isnan(got["a1"]) and result.nan_count.item() == 1.0
    for head in ("a0", "a2", "vf"):
        assert got[head] == pytest.approx(clean[head], rel=1e-5)


def test_per_component_log_probs_of_a_mixed_dict_use_the_same_rows():
    """The latches' per-component log-probs (``per_head_logp``) on the rows the norm heads take:
    ``b`` a diagonal Gaussian on rows 0:2 (means) and 2:4 (log-stds), ``m`` two categoricals on
    rows 4:6 and 6:9, ``z`` a categorical on rows 9:12 (torch.distributions, by hand)."""
    from gradmon_ray.rllib.heads import per_head_logp

    space, rows = SPACES["dict-mixed"]
    module = default_module("ppo", space)
    assert latch_heads(module) == tuple(rows) == ("b", "m", "z")
    logits = torch.randn(6, 12, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        actions = module.get_train_action_dist_cls().from_logits(logits).sample()
    got = per_head_logp(module, logits, actions, 3)

    def categorical(lo: int, hi: int, a: torch.Tensor) -> torch.Tensor:
        return torch.distributions.Categorical(logits=logits[:, lo:hi]).log_prob(a)

    want_b = torch.distributions.Normal(logits[:, 0:2], logits[:, 2:4].exp()).log_prob(actions["b"]).sum(-1)
    want_m = categorical(4, 6, actions["m"][:, 0]) + categorical(6, 9, actions["m"][:, 1])
    want_z = categorical(9, 12, actions["z"])
    torch.testing.assert_close(got, torch.stack([want_b, want_m, want_z], dim=-1))


def test_per_component_log_probs_of_a_tuple_keep_its_order():
    """A Tuple's components in declaration order: ``a0`` a categorical on rows 0:3, ``a1`` a
    Gaussian on rows 3 (mean) and 4 (log-std), ``a2`` a categorical on rows 5:7."""
    from gradmon_ray.rllib.heads import per_head_logp

    space, _rows = SPACES["tuple"]
    module = default_module("ppo", space)
    logits = torch.randn(6, 7, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a0, a1, a2 = module.get_train_action_dist_cls().from_logits(logits).sample()
    got = per_head_logp(module, logits, (a0, a1, a2), 3)
    want_a0 = torch.distributions.Categorical(logits=logits[:, 0:3]).log_prob(a0)
    want_a1 = torch.distributions.Normal(logits[:, 3:4], logits[:, 4:5].exp()).log_prob(a1).sum(-1)
    want_a2 = torch.distributions.Categorical(logits=logits[:, 5:7]).log_prob(a2)
    torch.testing.assert_close(got, torch.stack([want_a0, want_a1, want_a2], dim=-1))
