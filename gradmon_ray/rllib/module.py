"""``FactoredActorCritic``: a shared trunk, one head module per action component, a value head."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis.value_function_api import ValueFunctionAPI
from ray.rllib.core.rl_module.rl_module import RLModule
from ray.rllib.core.rl_module.torch import TorchRLModule
from ray.rllib.utils.annotations import override
from torch import nn

from gradmon_ray.head_labels import check_name
from gradmon_ray.losses.distribution import ActionFormat, FactoredCategorical
from gradmon_ray.metric_names import VALUE_HEAD


class ModelConfigError(ValueError):
    """The model config does not fit the env's spaces (head names, action or observation space)."""


_ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU, "silu": nn.SiLU}


@dataclass(frozen=True)
class HeadLayout:
    """The action heads of an action space, in logits order."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    action_format: ActionFormat


def resolve_heads(action_space: gym.Space, head_names: Sequence[str] | None = None) -> HeadLayout:
    """Head names and sizes for a ``Dict`` (of ``Discrete``), ``MultiDiscrete`` or ``Discrete`` space.

    A ``Dict`` space's heads are its keys in sorted order, which is the order dm-tree (and
    so RLlib) flattens dicts in, and which gymnasium's ``Dict`` already iterates in;
    ``head_names`` may not rename them.  ``MultiDiscrete``/``Discrete`` heads take
    ``head_names`` when given, else ``head_0, head_1, ...`` / ``action``.  Every name must fit the
    metric grammar (``head_labels.check_name``).
    """
    if isinstance(action_space, gym.spaces.Dict):
        names = tuple(sorted(action_space.spaces))
        bad = [k for k in names if not isinstance(action_space[k], gym.spaces.Discrete)]
        if bad:
            raise ModelConfigError(f"FactoredActorCritic: every Dict action component must be Discrete; not: {bad}")
        if head_names is not None and sorted(head_names) != list(names):
            raise ModelConfigError(
                f"model.head_names {list(head_names)} do not match the Dict action keys {list(names)}"
            )
        layout = HeadLayout(names, tuple(int(action_space[k].n) for k in names), "dict")
    elif isinstance(action_space, gym.spaces.MultiDiscrete):
        if action_space.nvec.ndim != 1:
            raise ModelConfigError("FactoredActorCritic: MultiDiscrete action spaces must be 1-D")
        sizes = tuple(int(n) for n in action_space.nvec)
        names = tuple(head_names) if head_names is not None else tuple(f"head_{i}" for i in range(len(sizes)))
        if len(names) != len(sizes):
            raise ModelConfigError(
                f"model.head_names has {len(names)} names, the MultiDiscrete space has {len(sizes)} components"
            )
        layout = HeadLayout(names, sizes, "multi_discrete")
    elif isinstance(action_space, gym.spaces.Discrete):
        names = tuple(head_names) if head_names is not None else ("action",)
        if len(names) != 1:
            raise ModelConfigError("model.head_names must have exactly one name for a Discrete action space")
        layout = HeadLayout(names, (int(action_space.n),), "discrete")
    else:
        raise ModelConfigError(
            "FactoredActorCritic supports Dict-of-Discrete, MultiDiscrete and Discrete action spaces, "
            f"got {action_space}"
        )
    what = "FactoredActorCritic: Dict action key" if layout.action_format == "dict" else "model.head_names: head name"
    for name in layout.names:
        try:
            check_name(name, what)
        except ValueError as exc:  # a ModelConfigError: preflight reports it as a config error
            raise ModelConfigError(str(exc)) from None
    if len(set(layout.names)) != len(layout.names):
        raise ModelConfigError(f"head names must be unique, got {list(layout.names)}")
    if VALUE_HEAD in layout.names:
        raise ModelConfigError(f"an action head may not be called {VALUE_HEAD!r}: that name reports the value head")
    return layout


def _mlp(
    in_dim: int, hiddens: Sequence[int], out_dim: int | None, activation: str, out_gain: float = 1.0
) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hiddens:
        linear = nn.Linear(in_dim, width)
        nn.init.orthogonal_(linear.weight, gain=float(np.sqrt(2.0)))
        nn.init.zeros_(linear.bias)
        layers += [linear, _ACTIVATIONS[activation]()]
        in_dim = width
    if out_dim is not None:
        out = nn.Linear(in_dim, out_dim)
        # Small output gains (CleanRL's PPO init): near-uniform initial policy, small values.
        nn.init.orthogonal_(out.weight, gain=out_gain)
        nn.init.zeros_(out.bias)
        layers.append(out)
    return nn.Sequential(*layers)


class FactoredActorCritic(TorchRLModule, ValueFunctionAPI):
    """Multi-head actor-critic for factored discrete action spaces.

    ``model_config`` keys: ``trunk_hiddens`` (default ``[128, 128]``), ``head_hiddens``
    (``[]``: each head is one linear layer), ``value_hiddens`` (``[]``), ``activation``
    (``"tanh"``, ``"relu"`` or ``"silu"``), ``head_names`` (for MultiDiscrete/Discrete
    spaces), ``head_logit_scale`` (``{head: factor}``, multiplies that head's logits),
    ``vf_share_layers`` (default ``False``: the value head has its own trunk of the same
    widths, ``value_trunk``, as RLlib's default module does; ``True``: it reads the policy
    trunk).  Separate trunks learned better on the built-in env and on CartPole
    (``bench/vf_share_layers.py``, 3 seeds each).  Observations must be a ``Box``; they are flattened per sample.

    Reported heads are the output layers (``heads[name]``, ``value_head``); trunks, shared or
    not, count in the global norm only.
    """

    @override(TorchRLModule)
    def setup(self) -> None:
        cfg = dict(self.model_config or {})
        self.head_layout = resolve_heads(self.action_space, cfg.get("head_names"))
        activation = cfg.get("activation", "tanh")
        if activation not in _ACTIVATIONS:
            raise ModelConfigError(f"model.activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        if not isinstance(self.observation_space, gym.spaces.Box):
            raise ModelConfigError(f"FactoredActorCritic needs a Box observation space, got {self.observation_space}")
        obs_dim = int(np.prod(self.observation_space.shape))
        trunk_hiddens = list(cfg.get("trunk_hiddens", [128, 128]))
        self.trunk = _mlp(obs_dim, trunk_hiddens, None, activation)
        self.vf_share_layers = bool(cfg.get("vf_share_layers", False))
        # Without sharing, the value function gets its own copy of the trunk's shape.
        self.value_trunk = None if self.vf_share_layers else _mlp(obs_dim, trunk_hiddens, None, activation)
        embed_dim = trunk_hiddens[-1] if trunk_hiddens else obs_dim
        head_hiddens = list(cfg.get("head_hiddens", []))
        self.heads = nn.ModuleDict(
            {
                name: _mlp(embed_dim, head_hiddens, size, activation, out_gain=0.01)
                for name, size in zip(self.head_layout.names, self.head_layout.sizes, strict=True)
            }
        )
        self.value_head = _mlp(embed_dim, list(cfg.get("value_hiddens", [])), 1, activation, out_gain=1.0)
        # Per-head logit multipliers (default none): a diagnostic knob, e.g. to provoke an
        # exploding head on purpose; the head's gradient scales with it.
        scales = dict(cfg.get("head_logit_scale") or {})
        unknown = sorted(set(scales) - set(self.head_layout.names))
        if unknown:
            raise ModelConfigError(
                f"model.head_logit_scale: unknown heads {unknown}; heads are {list(self.head_layout.names)}"
            )
        self._logit_scale = {name: float(v) for name, v in scales.items() if float(v) != 1.0}
        self.action_dist_cls = FactoredCategorical.for_heads(
            self.head_layout.names, self.head_layout.sizes, self.head_layout.action_format
        )

    @property
    def head_names(self) -> tuple[str, ...]:
        """Action head names in logits order."""
        return self.head_layout.names

    def head_parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters per reported head: every action head, then ``"value"``."""
        groups = {name: list(self.heads[name].parameters()) for name in self.head_layout.names}
        groups[VALUE_HEAD] = list(self.value_head.parameters())
        return groups

    def _embed(self, batch: dict[str, Any]) -> torch.Tensor:
        """The policy trunk's output."""
        return self.trunk(self._flat_obs(batch))

    def _value_embed(self, batch: dict[str, Any], policy_embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """What the value head reads: the policy trunk's output when shared, else the value trunk's."""
        if self.value_trunk is None:
            return self._embed(batch) if policy_embeddings is None else policy_embeddings
        return self.value_trunk(self._flat_obs(batch))

    @staticmethod
    def _flat_obs(batch: dict[str, Any]) -> torch.Tensor:
        obs = batch[Columns.OBS]
        return obs.reshape(obs.shape[0], -1).float()

    def _logits(self, embeddings: torch.Tensor) -> torch.Tensor:
        scale = self._logit_scale
        return torch.cat(
            [self.heads[name](embeddings) * scale.get(name, 1.0) for name in self.head_layout.names], dim=-1
        )

    @override(RLModule)
    def _forward(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return {Columns.ACTION_DIST_INPUTS: self._logits(self._embed(batch))}

    @override(RLModule)
    def _forward_train(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        embeddings = self._embed(batch)
        # EMBEDDINGS are what compute_values reads (RLlib's PPO loss passes them back).
        return {
            Columns.ACTION_DIST_INPUTS: self._logits(embeddings),
            Columns.EMBEDDINGS: self._value_embed(batch, embeddings),
        }

    @override(ValueFunctionAPI)
    def compute_values(self, batch: dict[str, Any], embeddings: torch.Tensor | None = None) -> torch.Tensor:
        if embeddings is None:
            embeddings = self._value_embed(batch)
        return self.value_head(embeddings).squeeze(-1)
