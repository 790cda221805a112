"""FactoredActorCritic: head resolution for every supported space, layout, logits order."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from ray.rllib.core.columns import Columns

from gradmon_ray.envs import HEAD_NAMES, HEAD_SIZES
from gradmon_ray.rllib import FactoredActorCritic, resolve_heads

OBS = gym.spaces.Box(-1.0, 1.0, (5,), np.float32)


def test_dict_heads_are_sorted_keys_like_dm_tree():
    import tree

    space = gym.spaces.Dict(
        {"op": gym.spaces.Discrete(4), "alpha": gym.spaces.Discrete(2), "tempo": gym.spaces.Discrete(3)}
    )
    layout = resolve_heads(space)
    assert layout.names == tuple(tree.flatten({"op": "op", "alpha": "alpha", "tempo": "tempo"}))
    assert layout.names == ("alpha", "op", "tempo") and layout.sizes == (2, 4, 3)


def test_multidiscrete_and_discrete_names():
    assert resolve_heads(gym.spaces.MultiDiscrete([3, 2])).names == ("head_0", "head_1")
    assert resolve_heads(gym.spaces.MultiDiscrete([3, 2]), ["x", "y"]).names == ("x", "y")
    assert resolve_heads(gym.spaces.Discrete(4)).names == ("action",)
    assert resolve_heads(gym.spaces.Discrete(4), ["move"]).sizes == (4,)


@pytest.mark.parametrize(
    ("space", "names", "match"),
    [
        (gym.spaces.Dict({"a": gym.spaces.Box(0, 1, (2,))}), None, "must be Discrete"),
        (gym.spaces.Dict({"a": gym.spaces.Discrete(2)}), ["b"], "do not match"),
        (gym.spaces.MultiDiscrete([2, 2]), ["x"], "has 1 names"),
        (gym.spaces.MultiDiscrete([2, 2]), ["x", "x"], "unique"),
        (gym.spaces.Discrete(2), ["value"], "may not be called"),
        (gym.spaces.Box(0, 1, (2,)), None, "supports"),
    ],
)
def test_resolve_heads_errors(space, names, match):
    with pytest.raises(ValueError, match=match):
        resolve_heads(space, names)


def _module(action_space, **model_config) -> FactoredActorCritic:
    return FactoredActorCritic(observation_space=OBS, action_space=action_space, model_config=model_config)


def test_builtin_env_space_gives_eight_heads_and_disjoint_groups():
    space = gym.spaces.Dict({h: gym.spaces.Discrete(HEAD_SIZES[h]) for h in HEAD_NAMES})
    module = _module(space, trunk_hiddens=[16])
    groups = module.head_parameter_groups()
    assert list(groups) == [*sorted(HEAD_NAMES), "value"]
    ids = [id(p) for ps in groups.values() for p in ps]
    assert len(ids) == len(set(ids))
    assert module.value_trunk is not None  # vf_share_layers defaults to false: two trunks
    trunk_ids = {id(p) for trunk in (module.trunk, module.value_trunk) for p in trunk.parameters()}
    assert not trunk_ids & set(ids)
    assert len(ids) + len(trunk_ids) == len(list(module.parameters()))


@pytest.mark.parametrize("share", [True, False])
def test_vf_share_layers_decides_what_the_value_head_reads(share):
    """Shared: the value loss reaches the policy trunk; separate: it reaches only the value
    trunk and the value head, and the action logits do not depend on the value trunk.
    Checked with autograd on parameters fetched by attribute name."""
    space = gym.spaces.Dict({"z": gym.spaces.Discrete(2), "a": gym.spaces.Discrete(3)})
    module = _module(space, trunk_hiddens=[8, 8], vf_share_layers=share)
    batch = {Columns.OBS: torch.randn(6, 5, generator=torch.Generator().manual_seed(0))}
    out = module.forward_train(batch)
    values = module.compute_values(batch, embeddings=out[Columns.EMBEDDINGS])
    torch.testing.assert_close(values, module.compute_values(batch))  # the embeddings are the value's input
    policy_trunk = list(module.trunk.parameters())
    value_grads = torch.autograd.grad(values.sum(), policy_trunk, allow_unused=True)
    reaches_policy_trunk = any(g is not None and bool(g.abs().sum() > 0) for g in value_grads)
    assert reaches_policy_trunk == share
    if share:
        assert module.value_trunk is None
    else:
        value_trunk = list(module.value_trunk.parameters())
        assert all(g.abs().sum() > 0 for g in torch.autograd.grad(values.sum(), value_trunk))
        logit_grads = torch.autograd.grad(out[Columns.ACTION_DIST_INPUTS].sum(), value_trunk, allow_unused=True)
        assert all(g is None for g in logit_grads)


def test_logits_follow_head_order():
    space = gym.spaces.Dict({"z": gym.spaces.Discrete(2), "a": gym.spaces.Discrete(3)})
    module = _module(space, trunk_hiddens=[8])
    with torch.no_grad():
        module.heads["a"][-1].bias.copy_(torch.tensor([10.0, 20.0, 30.0]))
        module.heads["a"][-1].weight.zero_()
    out = module.forward_inference({Columns.OBS: torch.zeros(2, 5)})
    assert out[Columns.ACTION_DIST_INPUTS][0, :3].tolist() == [10.0, 20.0, 30.0]  # "a" comes first


def test_forward_train_and_values_shapes():
    module = _module(gym.spaces.MultiDiscrete([3, 4]), trunk_hiddens=[8, 8], head_hiddens=[4], activation="relu")
    out = module.forward_train({Columns.OBS: torch.randn(7, 5)})
    assert out[Columns.ACTION_DIST_INPUTS].shape == (7, 7)
    assert module.compute_values({Columns.OBS: torch.randn(7, 5)}).shape == (7,)
    assert module.compute_values({}, embeddings=out[Columns.EMBEDDINGS]).shape == (7,)


def test_bad_activation_and_obs_space():
    with pytest.raises(ValueError, match="activation"):
        _module(gym.spaces.Discrete(2), activation="gelu")
    with pytest.raises(ValueError, match="Box observation"):
        FactoredActorCritic(
            observation_space=gym.spaces.Discrete(3), action_space=gym.spaces.Discrete(2), model_config={}
        )
