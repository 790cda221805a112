"""Which parameters make up each reported head, and which log-probs each latch watches.

Parameter heads (the gradient norms): a module's ``head_parameter_groups()`` when it has one
(``FactoredActorCritic``), else ``learner_config_dict["gradmon"]["heads"]``: head name ->
regex searched in the module's ``named_parameters()`` names (RLlib's default modules:
``encoder.actor_encoder.*``, ``encoder.critic_encoder.*``, ``pi.*``, ``vf.*``).  Every
trainable parameter outside the heads is the trunk (in the global norm only).

Latch heads (the log-prob NaN/Inf latches) are the components of the action distribution:
``FactoredCategorical``'s heads; a ``MultiDiscrete`` space's components (``head_0``, ...)
through RLlib's ``TorchMultiCategorical``; a flat ``Dict`` space's keys (sorted, as dm-tree
flattens) through ``TorchMultiDistribution``.  Any other distribution gives no per-head
log-probs, so the whole policy latches under one name, ``"policy"``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import torch
import tree  # dm-tree, an RLlib dependency

from gradmon_ray.metric_names import VALUE_HEAD
from gradmon_ray.rllib import compat
from gradmon_ray.rllib.distribution import FactoredCategorical

POLICY_LATCH = "policy"
"""The one latch of a module whose action distribution has no per-head log-probs."""

VALUE_HEAD_NAMES = (VALUE_HEAD, "vf")
"""Heads judged by the value bands and left out of the action heads' norm CV."""


def head_parameter_groups(module: torch.nn.Module, regexes: Mapping[str, str]) -> dict[str, list[torch.nn.Parameter]]:
    """The reported heads' parameters (disjoint), from the module or from ``regexes``.

    Raises ``ValueError`` naming the head whose regex matches no trainable parameter, or the
    parameter two heads match.
    """
    if hasattr(module, "head_parameter_groups"):
        return {name: list(params) for name, params in module.head_parameter_groups().items()}
    if not regexes:
        raise ValueError(
            f"{type(module).__name__} has no head_parameter_groups(); give the heads as "
            "learner_config_dict={'gradmon': {'heads': {'pi': r'^pi\\.', 'vf': r'^vf\\.'}}}"
        )
    compiled = {head: re.compile(rx) for head, rx in regexes.items()}
    groups: dict[str, list[torch.nn.Parameter]] = {head: [] for head in compiled}
    names = [name for name, p in module.named_parameters() if p.requires_grad]
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
                f"{type(module).__name__}; its parameters are named like {names[:4]}"
            )
    return groups


def action_heads(groups: Mapping[str, Any]) -> list[str]:
    """The reported heads judged as action heads: all but ``VALUE_HEAD_NAMES``."""
    return [h for h in groups if h not in VALUE_HEAD_NAMES]


def latch_heads(module: Any) -> tuple[str, ...]:
    """The names of the per-head log-prob latches of ``module`` (see the module docstring)."""
    dist_cls = module.get_train_action_dist_cls()
    if isinstance(dist_cls, type) and issubclass(dist_cls, FactoredCategorical):
        return dist_cls.head_names
    space = module.action_space
    if isinstance(space, gym.spaces.MultiDiscrete) and space.nvec.ndim == 1 and len(space.nvec) > 1:
        return tuple(f"head_{i}" for i in range(len(space.nvec)))
    if isinstance(space, gym.spaces.Dict) and not any(
        isinstance(s, (gym.spaces.Dict, gym.spaces.Tuple)) for s in space.spaces.values()
    ):
        return tuple(sorted(space.spaces))
    return (POLICY_LATCH,)


def per_head_logp(module: Any, logits: torch.Tensor, actions: Any, num_heads: int) -> torch.Tensor:
    """``[B, num_heads]`` log-probs of the taken actions under the train distribution of ``logits``.

    On the device, no host synchronisation (the distribution is built from the logits as the
    loss builds it; this costs one more log-softmax per minibatch).
    """
    dist = module.get_train_action_dist_cls().from_logits(logits)
    if isinstance(dist, FactoredCategorical):
        return dist.per_head_logp(actions)
    if num_heads == 1:
        return dist.logp(actions).reshape(-1, 1)
    children = compat.child_distributions(dist)
    parts = torch.unbind(actions, dim=-1) if isinstance(actions, torch.Tensor) else tree.flatten(actions)
    return torch.stack([child.logp(part).reshape(-1) for child, part in zip(children, parts, strict=True)], dim=-1)
