"""Which parameters make up each reported head, and which log-probs each latch watches.

Parameter heads (the gradient norms), first that applies:

1. the module's own ``head_parameter_groups()`` (``FactoredActorCritic``);
2. ``learner_config_dict["gradmon"]["heads"]``: head name -> regex searched in the module's
   ``named_parameters()`` names;
3. zero-config (``zero_config_heads``): on RLlib's default modules (PPO, APPO, IMPALA) one head per
   action component (rows of the policy output layer), then ``vf``; on any other module its
   top-level children, named as they are, with one warning line saying so.

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

import torch
import tree  # dm-tree, an RLlib dependency

from gradmon_ray import compat
from gradmon_ray.head_labels import check_name
from gradmon_ray.losses.distribution import FactoredCategorical
from gradmon_ray.metric_names import is_value_head
from gradmon_ray.rllib.distribution_heads import distribution_heads
from gradmon_ray.rllib.zero_config_heads import parameter_names_by_prefix, zero_config_heads
from gradmon_ray.telemetry.head_norms import HeadPart

MODULE_VALUE_HEADS = "value_heads"
"""The attribute by which a module declares its value heads (``declared_value_heads``)."""


def head_parameter_groups(module: torch.nn.Module, regexes: Mapping[str, str]) -> dict[str, list[HeadPart]]:
    """The reported heads' parts (disjoint): the module's own, ``regexes``', or zero-config ones.

    See the module docstring for the order of precedence.  Raises ``ValueError`` naming the head
    whose regex matches no trainable parameter (listing every parameter name), the parameter two
    heads match, a module without any trainable parameter, and a head name that metric names
    cannot carry (``head_labels.check_name``).
    """
    if hasattr(module, "head_parameter_groups"):
        groups = {name: list(params) for name, params in module.head_parameter_groups().items()}
        what = f"{type(module).__name__}.head_parameter_groups(): head name"
    elif regexes:
        groups, what = _regex_heads(module, regexes), "gradmon head name"
    else:
        groups, what = zero_config_heads(module), f"{type(module).__name__}'s zero-config head name"
        if not groups:
            raise ValueError(f"{type(module).__name__} has no trainable parameter: gradmon has nothing to monitor")
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
