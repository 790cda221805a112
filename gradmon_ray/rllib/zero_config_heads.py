"""Heads for a module nobody described: RLlib's default modules by action component, any other by its children.

``zero_config_heads(module)`` (rule 3 of ``heads.head_parameter_groups``), first that applies:

1. RLlib's default modules (PPO, APPO, IMPALA; a catalog-built ``pi`` head): one head per action
   component, the rows of the policy output layer (the last ``Linear`` of ``module.pi``: weight rows
   and bias entries, ``ParamRows``) that produce that component's distribution inputs, then ``vf``
   (every parameter of ``module.vf``).  Components: a ``Dict`` space's keys in dm-tree's sorted-key
   order, a ``Tuple`` space's ``a0``, ``a1``, ... (both with the row counts of RLlib's
   ``TorchMultiDistribution``, ``input_lens``); ``a0``, ``a1``, ... for a ``MultiDiscrete`` space
   (``TorchMultiCategorical`` splits by ``nvec``); ``pi`` for a single ``Discrete`` or ``Box`` space
   (the whole output layer, and ``pi.log_std`` with ``free_log_std``).
2. any other torch module (a custom ``RLModule`` without ``pi``, or a default one whose action space
   has no components above, a nested ``Dict`` say): each top-level child module holding trainable
   parameters is a head, named as it is (``_lstm``, ``_pi_head``, ...); a module without such
   children is one head, ``module``.  One warning line at build says which heads were chosen, why,
   and how to refine them (``heads`` regexes, ``value_heads``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import torch
import tree  # dm-tree, an RLlib dependency
from ray.rllib.core.distribution.torch.torch_distribution import TorchMultiCategorical, TorchMultiDistribution
from ray.rllib.core.models.torch.heads import TorchFreeLogStdMLPHead, TorchMLPHead

from gradmon_ray.head_labels import check_name
from gradmon_ray.metric_names import VALUE_HEAD_NAMES
from gradmon_ray.telemetry.head_norms import HeadPart, ParamRows

logger = logging.getLogger(__name__)

SINGLE_COMPONENT_HEAD = "pi"
"""The zero-config head of a single ``Discrete`` or ``Box`` action space."""

WHOLE_MODULE_HEAD = "module"
"""The one head of a module without child modules holding trainable parameters."""

HEADS_EXAMPLE = "learner_config_dict={'gradmon': {'heads': {'pi': r'^pi\\.', 'vf': r'^vf\\.'}}}"


class NotADefaultModule(ValueError):
    """``module`` is not an RLlib default module gradmon can split by action component (the reason)."""


def zero_config_heads(module: Any) -> dict[str, list[HeadPart]]:
    """RLlib's default module's component heads, else the module's children (module docstring)."""
    try:
        return default_module_heads(module)
    except NotADefaultModule as why:
        groups = child_heads(module)
        logger.warning(
            "gradmon: %s has no per-component heads (%s): its heads are its top-level children %s; to refine "
            "them give %s (a regex per head over its parameters: %s), and 'value_heads' for a critic not called vf",
            type(module).__name__,
            why,
            list(groups),
            HEADS_EXAMPLE,
            parameter_names_by_prefix(module),
        )
        return groups


def child_heads(module: torch.nn.Module) -> dict[str, list[HeadPart]]:
    """Each top-level child holding trainable parameters, named as it is (a parameter shared by two
    children goes to the first); ``{"module": every trainable parameter}`` when no child holds one."""
    groups: dict[str, list[HeadPart]] = {}
    seen: set[int] = set()
    for name, child in module.named_children():
        params = [p for p in child.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            groups[name] = list(params)
    if not groups and (params := [p for p in module.parameters() if p.requires_grad]):
        groups[WHOLE_MODULE_HEAD] = list(params)
    return groups


def default_module_heads(module: Any) -> dict[str, list[HeadPart]]:
    """One head per action component (rows of the policy output layer), then ``vf``.

    Raises ``NotADefaultModule`` with the reason when the module is not an RLlib default module (no
    catalog-built ``pi`` head, an action space without components, or an output layer whose size
    does not match the distribution)."""
    pi = getattr(module, "pi", None)
    if not isinstance(pi, (TorchMLPHead, TorchFreeLogStdMLPHead)):
        raise NotADefaultModule("no head_parameter_groups() and no RLlib policy head `pi`")
    linears = [m for m in pi.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        raise NotADefaultModule("its policy head `pi` has no Linear output layer")
    out = linears[-1]
    components = action_components(module)
    free_log_std = isinstance(pi, TorchFreeLogStdMLPHead)
    if free_log_std and len(components) != 1:
        raise NotADefaultModule("free_log_std with a composite action space")
    rows_needed = sum(n for _, n in components) // (2 if free_log_std else 1)  # the means only; log_std apart
    if out.out_features != rows_needed:
        raise NotADefaultModule(
            f"its policy output layer has {out.out_features} outputs, its action distribution needs {rows_needed}"
        )
    whole = [p for p in (out.weight, out.bias) if p is not None and p.requires_grad]
    groups: dict[str, list[HeadPart]] = {}
    if len(components) == 1:
        groups[components[0][0]] = whole + ([pi.log_std] if free_log_std and pi.log_std.requires_grad else [])
    else:
        start = 0
        for name, n in components:
            groups[name] = [ParamRows(p, slice(start, start + n)) for p in whole]
            start += n
    vf = getattr(module, "vf", None)
    if isinstance(vf, torch.nn.Module) and (vf_params := [p for p in vf.parameters() if p.requires_grad]):
        groups["vf"] = list(vf_params)
    return groups


def action_components(module: Any) -> list[tuple[str, int]]:
    """(head name, number of distribution inputs) per action component, in RLlib's logit order.

    Row counts come from RLlib's train action distribution class: ``required_input_dim`` of
    the space (2 x dim for a ``Box``'s diagonal Gaussian), ``input_lens`` of a
    ``TorchMultiDistribution`` (``required_input_dim(space, as_list=True)``), ``nvec`` for a
    ``TorchMultiCategorical`` (what RLlib's catalog hands it as ``input_lens``)."""
    space = module.action_space
    dist_cls = module.get_train_action_dist_cls()
    if isinstance(space, (gym.spaces.Discrete, gym.spaces.Box)):
        return [(SINGLE_COMPONENT_HEAD, int(dist_cls.required_input_dim(space)))]
    if isinstance(space, gym.spaces.MultiDiscrete) and _is_subclass(dist_cls, TorchMultiCategorical):
        if space.nvec.ndim != 1:
            raise NotADefaultModule(f"a MultiDiscrete space with nvec of shape {space.nvec.shape}")
        lens = [int(n) for n in space.nvec]
        if sum(lens) != int(dist_cls.required_input_dim(space)):
            raise NotADefaultModule("its MultiCategorical needs other than sum(nvec) inputs")
        return [(f"a{i}", n) for i, n in enumerate(lens)]
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)) and _is_subclass(dist_cls, TorchMultiDistribution):
        names = component_names(space)
        if names is None:
            raise NotADefaultModule(f"a {type(space).__name__} action space with Dict/Tuple components")
        _check_component_names(names)
        lens = [int(n) for n in dist_cls.required_input_dim(space, as_list=True)]
        if len(lens) != len(names):
            raise NotADefaultModule(f"{len(lens)} distribution inputs for {len(names)} components")
        return list(zip(names, lens, strict=True))
    raise NotADefaultModule(f"no per-component heads for a {type(space).__name__} action space")


def component_names(space: gym.spaces.Dict | gym.spaces.Tuple) -> list[str] | None:
    """A flat ``Dict``'s keys in dm-tree's (RLlib's) sorted order, a flat ``Tuple``'s ``a0``, ``a1``, ...;
    None when a component is itself a ``Dict`` or ``Tuple``."""
    children = space.spaces.values() if isinstance(space, gym.spaces.Dict) else space.spaces
    if any(isinstance(s, (gym.spaces.Dict, gym.spaces.Tuple)) for s in children):
        return None
    if isinstance(space, gym.spaces.Tuple):
        return [f"a{i}" for i in range(len(space.spaces))]
    return tree.flatten({key: key for key in space.spaces})


def component_space(space: gym.spaces.Dict | gym.spaces.Tuple, name: str) -> gym.Space:
    """The component ``component_names`` called ``name``."""
    return space[int(name[1:])] if isinstance(space, gym.spaces.Tuple) else space[name]


def _check_component_names(names: Sequence[Any]) -> None:
    for key in names:
        try:
            check_name(key, "Dict action key")
        except ValueError as bad:
            raise NotADefaultModule(str(bad)) from None
    if bad := [k for k in names if k in VALUE_HEAD_NAMES]:
        raise NotADefaultModule(f"Dict action keys {bad} cannot name action heads ({VALUE_HEAD_NAMES} are value heads)")


def _is_subclass(cls: Any, parent: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, parent)


def parameter_names_by_prefix(module: torch.nn.Module) -> str:
    """Every trainable parameter name of ``module``, grouped by module prefix on one line, e.g.
    ``encoder.actor_encoder: [net.mlp.0.weight, ...]; pi: [net.mlp.0.weight, net.mlp.0.bias]``.

    A prefix is a top-level child, split further while it only holds several named (not
    numbered) children, as RLlib's ``encoder`` holds ``actor_encoder`` and ``critic_encoder``."""
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    groups: dict[str, list[str]] = {}
    for prefix, rest in _split_by_prefix([n.split(".") for n in names], []):
        groups.setdefault(".".join(prefix) or "(module)", []).append(".".join(rest))
    return "; ".join(f"{prefix}: [{', '.join(rests)}]" for prefix, rests in groups.items())


def _split_by_prefix(paths: list[list[str]], prefix: list[str]) -> list[tuple[list[str], list[str]]]:
    """(prefix, rest) per path, in order; see ``parameter_names_by_prefix``."""
    heads = list(dict.fromkeys(p[0] for p in paths))
    holds_params = any(len(p) == 1 for p in paths)
    if prefix and (holds_params or len(heads) < 2 or any(h.isdigit() for h in heads)):
        return [(prefix, p) for p in paths]
    out: list[tuple[list[str], list[str]]] = []
    for head in heads:
        below = [p[1:] for p in paths if p[0] == head]
        if any(not p for p in below):  # a parameter directly on the module
            out += [([*prefix], [head]) for _ in below]
        else:
            out += _split_by_prefix(below, [*prefix, head])
    return out
