"""The one decision, at build, of what a module's train action distribution class lets gradmon watch.

Per component (``DistributionHeads.names``: the log-prob latches, ``heads.latch_heads``):

- gradmon's ``FactoredCategorical`` (a ``for_heads`` class, or a subclass): its ``head_names``;
- RLlib's ``TorchMultiCategorical`` (or a subclass) over a 1-d ``MultiDiscrete``: ``a0``, ``a1``, ...;
- RLlib's ``TorchMultiDistribution`` (or a subclass) over a flat ``Dict``: the keys in dm-tree's
  sorted-key order; over a flat ``Tuple``: ``a0``, ``a1``, ...;
- anything else: the whole policy as one latch, ``head_labels.POLICY_LATCH``.

Per-head entropy and KL (``DistributionHeads.sizes``: the number of actions of each component, else
None) are computed from the raw logits as one plain categorical per component
(``telemetry.head_entropy``), so they are on only where the distribution IS that: exactly RLlib's
``TorchCategorical`` over ``Discrete``, RLlib's own ``get_partial_dist_cls`` class of
``TorchMultiCategorical`` over ``MultiDiscrete``, the same of ``TorchMultiDistribution`` over a
``Dict`` or ``Tuple`` whose every child distribution is exactly ``TorchCategorical``, or a class made by
``FactoredCategorical.for_heads``.  A subclass of any of them (a temperature in ``from_logits``, say)
keeps its latches but gets no entropy or KL: they are left out of the results, not NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import torch
from ray.rllib.core.distribution.torch.torch_distribution import (
    TorchCategorical,
    TorchMultiCategorical,
    TorchMultiDistribution,
)

from gradmon_ray import compat
from gradmon_ray.head_labels import POLICY_LATCH, check_name
from gradmon_ray.losses.distribution import FactoredCategorical
from gradmon_ray.rllib.zero_config_heads import component_names, component_space

_RLLIB_PARTIAL = TorchCategorical.get_partial_dist_cls()
"""A class made by RLlib's ``Distribution.get_partial_dist_cls``: its ``from_logits`` code marks RLlib's own."""
_FOR_HEADS_ATTRS = {"head_names", "head_sizes", "action_format"}
"""All that ``FactoredCategorical.for_heads`` sets on its class (besides Python's and ``abc``'s bookkeeping)."""
_BOOKKEEPING = {"__module__", "__doc__", "__qualname__", "__abstractmethods__", "_abc_impl"}


@dataclass(frozen=True)
class DistributionHeads:
    """The latch names of a module's action components, and their sizes where entropy/KL apply."""

    names: tuple[str, ...]
    sizes: tuple[int, ...] | None


def distribution_heads(module: Any) -> DistributionHeads:
    """What ``module.get_train_action_dist_cls()`` over ``module.action_space`` gives (module docstring).

    Raises ``ValueError`` (``head_labels.check_name``) for a component name metric names cannot carry."""
    dist_cls = module.get_train_action_dist_cls()
    space = module.action_space
    sizes: tuple[int, ...] | None = None
    if _is_subclass(dist_cls, FactoredCategorical):
        names: list[Any] = list(dist_cls.head_names)
        if dist_cls.__bases__ == (FactoredCategorical,) and set(vars(dist_cls)) - _BOOKKEEPING <= _FOR_HEADS_ATTRS:
            sizes = tuple(int(n) for n in dist_cls.head_sizes)
    elif _is_subclass(dist_cls, TorchMultiCategorical) and isinstance(space, gym.spaces.MultiDiscrete):
        if space.nvec.ndim != 1:
            names = [POLICY_LATCH]
        else:
            names = [f"a{i}" for i in range(len(space.nvec))]
            sizes = tuple(int(n) for n in space.nvec) if _is_rllib_partial(dist_cls, TorchMultiCategorical) else None
    elif _is_subclass(dist_cls, TorchMultiDistribution) and isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        flat = component_names(space)  # dm-tree's (RLlib's) order; None: nested
        names = [POLICY_LATCH] if flat is None else flat
        sizes = None if flat is None else _categorical_children(dist_cls, space, flat)
    else:
        names = [POLICY_LATCH]
        if dist_cls is TorchCategorical and isinstance(space, gym.spaces.Discrete):
            sizes = (int(space.n),)
    checked = tuple(check_name(name, f"{type(module).__name__}'s action component") for name in names)
    return DistributionHeads(checked, sizes)


def _is_subclass(cls: Any, parent: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, parent)


def _is_rllib_partial(cls: type, parent: type) -> bool:
    """``cls`` is RLlib's ``parent.get_partial_dist_cls(...)`` itself (as RLlib's catalog builds it),
    not a subclass of it nor a partial of a subclass of ``parent``."""
    own = vars(cls).get("from_logits")
    reference = vars(_RLLIB_PARTIAL)["from_logits"]
    return (
        cls.__bases__ == (parent,)
        and isinstance(own, classmethod)
        and own.__func__.__code__ is reference.__func__.__code__
    )


def _categorical_children(
    dist_cls: type, space: gym.spaces.Dict | gym.spaces.Tuple, names: list[str]
) -> tuple[int, ...] | None:
    """Each ``Discrete`` component's ``n`` in ``names``' order when ``dist_cls`` is RLlib's own partial of
    ``TorchMultiDistribution`` whose every child, built from zero logits, is exactly ``TorchCategorical``."""
    if not _is_rllib_partial(dist_cls, TorchMultiDistribution):
        return None
    components = [component_space(space, name) for name in names]
    if not all(isinstance(component, gym.spaces.Discrete) for component in components):
        return None
    dist = dist_cls.from_logits(torch.zeros(1, int(dist_cls.required_input_dim(space))))
    children = compat.child_distributions(dist)
    if len(children) != len(names) or any(type(child) is not TorchCategorical for child in children):
        return None
    return tuple(int(component.n) for component in components)
