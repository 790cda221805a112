"""Which parameters make up each reported head, and which log-probs each latch watches.

Parameter heads (the gradient norms), first that applies:

1. the module's own ``head_parameter_groups()`` (``FactoredActorCritic``);
2. ``learner_config_dict["gradmon"]["heads"]``: head name -> regex searched in the module's
   ``named_parameters()`` names;
3. zero-config, on RLlib's default modules (PPO, APPO, IMPALA): one head per action component,
   the rows of the policy output layer (the last ``Linear`` of ``module.pi``: weight rows and
   bias entries, ``ParamRows``) that produce that component's distribution inputs, then
   ``vf`` (every parameter of ``module.vf``).  Components: a ``Dict`` space's keys in dm-tree's
   sorted-key order with the row counts of RLlib's ``TorchMultiDistribution`` (``input_lens``);
   ``a0``, ``a1``, ... for a ``MultiDiscrete`` space (``TorchMultiCategorical`` splits by
   ``nvec``); ``pi`` for a single ``Discrete`` or ``Box`` space (the whole output layer, and
   ``pi.log_std`` with ``free_log_std``).

Every trainable parameter (or row) outside the heads is the trunk (in the global norm only).

Value heads (judged by the value bands, never action heads): ``value`` and ``vf``, plus those the
module declares in its ``value_heads`` attribute or the settings' ``value_heads`` names
(``declared_value_heads``); ``metric_names.is_value_head`` is the test.

Latch heads (the log-prob NaN/Inf latches) are the components of the action distribution,
named as the zero-config heads, decided at build from the module's train action distribution
class (``distribution_heads``, the one place, which also decides where per-head entropy/KL
apply): ``FactoredCategorical``'s heads; a ``MultiDiscrete`` space's components (``a0``, ...)
only where the class is RLlib's ``TorchMultiCategorical``; a flat ``Dict`` space's keys (sorted,
as dm-tree flattens) only where it is RLlib's ``TorchMultiDistribution``.  Any other
distribution (a custom one over the same spaces included) gives no per-head log-probs, so the
whole policy latches under one name, ``head_labels.POLICY_LATCH`` (``"policy"``).

Every head and latch name must fit the metric grammar (``head_labels.check_name``): a name that
does not is refused here, at build, in one line.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import gymnasium as gym
import torch
import tree  # dm-tree, an RLlib dependency
from ray.rllib.core.distribution.torch.torch_distribution import TorchMultiCategorical, TorchMultiDistribution
from ray.rllib.core.models.torch.heads import TorchFreeLogStdMLPHead, TorchMLPHead

from gradmon_ray import compat
from gradmon_ray.head_labels import check_name
from gradmon_ray.losses.distribution import FactoredCategorical
from gradmon_ray.metric_names import VALUE_HEAD_NAMES, is_value_head
from gradmon_ray.rllib.distribution_heads import distribution_heads
from gradmon_ray.telemetry.head_norms import HeadPart, ParamRows

SINGLE_COMPONENT_HEAD = "pi"
"""The zero-config head of a single ``Discrete`` or ``Box`` action space."""

MODULE_VALUE_HEADS = "value_heads"
"""The attribute by which a module declares its value heads (``declared_value_heads``)."""

_HEADS_EXAMPLE = "learner_config_dict={'gradmon': {'heads': {'pi': r'^pi\\.', 'vf': r'^vf\\.'}}}"


def head_parameter_groups(module: torch.nn.Module, regexes: Mapping[str, str]) -> dict[str, list[HeadPart]]:
    """The reported heads' parts (disjoint): the module's own, ``regexes``', or zero-config ones.

    See the module docstring for the order of precedence and the zero-config heads.  Raises
    ``ValueError`` naming the head whose regex matches no trainable parameter (listing every
    parameter name), the parameter two heads match, or a module without heads of its own that
    is not a recognisable RLlib default module (naming the class and what to pass as heads), and
    a head name that metric names cannot carry (``head_labels.check_name``).
    """
    if hasattr(module, "head_parameter_groups"):
        groups = {name: list(params) for name, params in module.head_parameter_groups().items()}
        what = f"{type(module).__name__}.head_parameter_groups(): head name"
    elif regexes:
        groups, what = _regex_heads(module, regexes), "gradmon head name"
    else:
        groups, what = zero_config_heads(module), f"{type(module).__name__}'s zero-config head name"
    for name in groups:
        check_name(name, what)
    return groups


def _regex_heads(module: torch.nn.Module, regexes: Mapping[str, str]) -> dict[str, list[HeadPart]]:
    compiled = {head: re.compile(rx) for head, rx in regexes.items()}
    groups: dict[str, list[HeadPart]] = {head: [] for head in compiled}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        hits = [head for head, rx in compiled.items() if rx.search(name)]
        if len(hits) > 1:
            raise ValueError(f"parameter {name!r} is matched by heads {hits}: gradmon heads must be disjoint")
        if hits:
            groups[hits[0]].append(param)
    for head, params in groups.items():
        if not params:
            raise ValueError(
                f"gradmon head {head!r} (regex {regexes[head]!r}) matches no trainable parameter of "
                f"{type(module).__name__}; its parameters: {parameter_names_by_prefix(module)}"
            )
    return groups


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


def zero_config_heads(module: Any) -> dict[str, list[HeadPart]]:
    """One head per action component (rows of the policy output layer), then ``vf``.

    Raises ``ValueError`` naming the module class and what to pass as ``heads`` when the module
    is not an RLlib default module (no catalog-built ``pi`` head, an action space without
    zero-config components, or an output layer whose size does not match the distribution)."""
    pi = getattr(module, "pi", None)
    if not isinstance(pi, (TorchMLPHead, TorchFreeLogStdMLPHead)):
        raise _unrecognised(module, "no head_parameter_groups() and no RLlib policy head `pi`")
    linears = [m for m in pi.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        raise _unrecognised(module, "its policy head `pi` has no Linear output layer")
    out = linears[-1]
    components = action_components(module)
    free_log_std = isinstance(pi, TorchFreeLogStdMLPHead)
    if free_log_std and len(components) != 1:
        raise _unrecognised(module, "free_log_std with a composite action space")
    rows_needed = sum(n for _, n in components) // (2 if free_log_std else 1)  # the means only; log_std apart
    if out.out_features != rows_needed:
        raise _unrecognised(
            module,
            f"its policy output layer has {out.out_features} outputs, its action distribution needs {rows_needed}",
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
            raise _unrecognised(module, f"a MultiDiscrete space with nvec of shape {space.nvec.shape}")
        lens = [int(n) for n in space.nvec]
        if sum(lens) != int(dist_cls.required_input_dim(space)):
            raise _unrecognised(module, "its MultiCategorical needs other than sum(nvec) inputs")
        return [(f"a{i}", n) for i, n in enumerate(lens)]
    if isinstance(space, gym.spaces.Dict) and _is_subclass(dist_cls, TorchMultiDistribution):
        nested = [k for k, s in space.spaces.items() if isinstance(s, (gym.spaces.Dict, gym.spaces.Tuple))]
        if nested:
            raise _unrecognised(module, f"Dict action component(s) {nested} are themselves Dict/Tuple spaces")
        names = tree.flatten({key: key for key in space.spaces})  # dm-tree's (RLlib's) flattening order
        _check_component_names(module, names)
        lens = [int(n) for n in dist_cls.required_input_dim(space, as_list=True)]
        if len(lens) != len(names):
            raise _unrecognised(module, f"{len(lens)} distribution inputs for {len(names)} Dict components")
        return list(zip(names, lens, strict=True))
    raise _unrecognised(module, f"no zero-config heads for a {type(space).__name__} action space")


def _check_component_names(module: Any, names: Sequence[Any]) -> None:
    for key in names:
        check_name(key, f"{type(module).__name__}'s Dict action key")
    if bad := [k for k in names if k in VALUE_HEAD_NAMES]:
        raise _unrecognised(
            module, f"Dict action keys {bad} cannot name action heads ({VALUE_HEAD_NAMES} are value heads)"
        )


def _is_subclass(cls: Any, parent: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, parent)


def _unrecognised(module: Any, reason: str) -> ValueError:
    return ValueError(
        f"{type(module).__name__} has no gradmon heads ({reason}); give them as {_HEADS_EXAMPLE}, "
        f"a regex per head over its parameters: {parameter_names_by_prefix(module)}"
    )


def action_heads(groups: Mapping[str, Any], value_heads: Collection[str] = ()) -> list[str]:
    """The reported heads judged as action heads: all but the value heads (``is_value_head``:
    ``VALUE_HEAD_NAMES`` and the declared ``value_heads``)."""
    return [h for h in groups if not is_value_head(h, value_heads)]


def declared_value_heads(
    module: Any, settings_value_heads: Sequence[str], groups: Mapping[str, Any], latch_heads: Sequence[str]
) -> tuple[str, ...]:
    """The value heads a module declares besides ``value`` and ``vf``: its own ``value_heads``
    attribute (a class attribute or property, next to ``head_parameter_groups()``), then the gradmon
    settings' ``value_heads``.  ``ValueError`` for one that is not a reported head (listing them) or
    that is an action component (it has a log-prob latch)."""
    own = getattr(module, MODULE_VALUE_HEADS, None) or ()
    if isinstance(own, str) or not all(isinstance(h, str) for h in own):
        raise ValueError(f"{type(module).__name__}.{MODULE_VALUE_HEADS} must be a sequence of head names, got {own!r}")
    declared = tuple(dict.fromkeys((*own, *settings_value_heads)))
    for head in declared:
        if head not in groups:
            raise ValueError(f"value head {head!r} is not one of the reported heads {list(groups)}")
        if head in latch_heads:
            raise ValueError(f"value head {head!r} is an action component (it has a log-prob latch), not a value head")
    return declared


def latch_heads(module: Any) -> tuple[str, ...]:
    """The names of the per-head log-prob latches of ``module`` (see the module docstring), decided at
    build by ``distribution_heads.distribution_heads`` (the one decision, which also says where
    per-head entropy/KL apply): ``per_head_logp`` then never meets a distribution it cannot split."""
    return distribution_heads(module).names


def per_head_logp(module: Any, logits: torch.Tensor, actions: Any, num_heads: int) -> torch.Tensor:
    """``[B, num_heads]`` log-probs of the taken actions under the train distribution of ``logits``.

    On the device, no host synchronisation (the distribution is built from the logits as the
    loss builds it: one more log-softmax, which the drop-in runs once per step over all its
    minibatches and its modules of one kind, ``rllib.module_groups``).
    """
    dist = module.get_train_action_dist_cls().from_logits(logits)
    if isinstance(dist, FactoredCategorical):
        return dist.per_head_logp(actions)
    if num_heads == 1:
        return dist.logp(actions).reshape(-1, 1)
    children = compat.child_distributions(dist)
    parts = torch.unbind(actions, dim=-1) if isinstance(actions, torch.Tensor) else tree.flatten(actions)
    return torch.stack([child.logp(part).reshape(-1) for child, part in zip(children, parts, strict=True)], dim=-1)
