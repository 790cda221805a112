"""A factored categorical action distribution that exposes per-head log-probs and entropies.

RLlib's own ``TorchMultiDistribution``/``TorchMultiCategorical`` build one
``torch.distributions.Categorical`` per head and only return sums.  The learner needs the
per-head terms (for the NaN/Inf latches and the probes), so this class keeps all heads in
one padded ``[..., num_heads, max_size]`` tensor: every quantity is a few vectorised
kernels regardless of the number of heads, and the sums PPO needs are exactly the sums of
the per-head terms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import gymnasium as gym
import torch
from ray.rllib.core.distribution.distribution import Distribution
from ray.rllib.utils.annotations import override

ActionFormat = Literal["dict", "multi_discrete", "discrete"]


class FactoredCategorical(Distribution):
    """Independent categorical heads over concatenated logits.

    Build it with ``FactoredCategorical.for_heads(names, sizes, action_format)``, which
    returns a class whose ``from_logits(logits)`` RLlib can call.  Actions are a dict of
    ``[...]`` integer tensors (``"dict"``), one ``[..., num_heads]`` tensor
    (``"multi_discrete"``) or one ``[...]`` tensor (``"discrete"``).
    """

    head_names: tuple[str, ...] = ()
    head_sizes: tuple[int, ...] = ()
    action_format: ActionFormat = "dict"

    def __init__(self, logits: torch.Tensor, *, deterministic: bool = False) -> None:
        super().__init__()
        sizes = self.head_sizes
        if not sizes:
            raise TypeError("use FactoredCategorical.for_heads(...) to get a concrete distribution class")
        if logits.shape[-1] != sum(sizes):
            raise ValueError(
                f"logits have {logits.shape[-1]} entries; "
                f"heads {dict(zip(self.head_names, sizes, strict=True))} need {sum(sizes)}"
            )
        self.logits = logits
        self.deterministic = deterministic
        gather_index, valid = _padding_index(sizes, logits.device)
        # Append one -inf column and gather: heads smaller than the largest are padded with
        # -inf, which softmax maps to probability exactly 0.
        pad = logits.new_full((*logits.shape[:-1], 1), float("-inf"))
        padded = torch.cat([logits, pad], dim=-1)[..., gather_index]
        self.padded_logits = padded.reshape(*logits.shape[:-1], len(sizes), max(sizes))
        self._valid = valid
        self._log_probs: torch.Tensor | None = None

    @classmethod
    def for_heads(
        cls, head_names: Sequence[str], head_sizes: Sequence[int], action_format: ActionFormat
    ) -> type[FactoredCategorical]:
        """A subclass bound to these heads (what ``get_*_action_dist_cls`` returns)."""
        if len(head_names) != len(head_sizes) or not head_names:
            raise ValueError("need one size per head and at least one head")
        if action_format == "discrete" and len(head_names) != 1:
            raise ValueError("a Discrete action space has exactly one head")
        attrs = {
            "head_names": tuple(head_names),
            "head_sizes": tuple(int(s) for s in head_sizes),
            "action_format": action_format,
        }
        return type(f"FactoredCategorical_{'_'.join(head_names)}"[:80], (cls,), attrs)

    # --- per-head quantities -------------------------------------------------------
    @property
    def log_probs(self) -> torch.Tensor:
        """``[..., num_heads, max_size]`` log-probabilities (-inf on padding)."""
        if self._log_probs is None:
            self._log_probs = torch.log_softmax(self.padded_logits, dim=-1)
        return self._log_probs

    def actions_as_tensor(self, value: Any) -> torch.Tensor:
        """Actions in any accepted format as a ``[..., num_heads]`` long tensor."""
        if self.action_format == "dict":
            if not isinstance(value, Mapping):
                raise TypeError(f"expected a dict of actions with keys {self.head_names}, got {type(value).__name__}")
            return torch.stack(
                [torch.as_tensor(value[h]).reshape(self.logits.shape[:-1]) for h in self.head_names], dim=-1
            ).long()
        value = torch.as_tensor(value)
        if self.action_format == "discrete":
            return value.reshape(*self.logits.shape[:-1], 1).long()
        return value.reshape(*self.logits.shape[:-1], len(self.head_names)).long()

    def per_head_logp(self, value: Any) -> torch.Tensor:
        """``[..., num_heads]`` log-probability of each head's action."""
        idx = self.actions_as_tensor(value).unsqueeze(-1)
        return self.log_probs.gather(-1, idx).squeeze(-1)

    def _finite_log_probs(self) -> torch.Tensor:
        # Padding -> 0 (exp(0) * 0 = 0) and a genuine -inf logit -> the dtype's minimum
        # (0 * min = 0), as torch.distributions.Categorical.entropy clamps, so that neither
        # turns an entropy or KL into 0 * -inf = NaN.
        lp = self.log_probs.clamp(min=torch.finfo(self.log_probs.dtype).min)
        return torch.where(self._valid, lp, 0.0)

    def per_head_entropy(self) -> torch.Tensor:
        """``[..., num_heads]`` entropy of each head."""
        logp = self._finite_log_probs()
        return -(logp.exp() * logp).sum(-1)

    def per_head_kl(self, other: FactoredCategorical) -> torch.Tensor:
        """``[..., num_heads]`` KL(self || other) of each head."""
        mine, theirs = self._finite_log_probs(), other._finite_log_probs()
        return (mine.exp() * (mine - theirs)).sum(-1)

    # --- RLlib's Distribution API ----------------------------------------------------
    @override(Distribution)
    def logp(self, value: Any, **kwargs: Any) -> torch.Tensor:
        return self.per_head_logp(value).sum(-1)

    @override(Distribution)
    def entropy(self, **kwargs: Any) -> torch.Tensor:
        return self.per_head_entropy().sum(-1)

    @override(Distribution)
    def kl(self, other: Distribution, **kwargs: Any) -> torch.Tensor:
        return self.per_head_kl(other).sum(-1)  # type: ignore[arg-type]

    @override(Distribution)
    def sample(self, *, sample_shape: tuple[int, ...] | None = None, **kwargs: Any) -> Any:
        if sample_shape:
            raise NotImplementedError("FactoredCategorical.sample supports sample_shape=() only")
        if self.deterministic:
            flat = self.padded_logits.argmax(-1)
        else:
            # Gumbel-max: one vectorised draw for all heads; padding (-inf) is never chosen.
            gumbel = -torch.log(-torch.log(torch.rand_like(self.log_probs).clamp_(min=1e-20)))
            flat = (self.log_probs + gumbel).argmax(-1)
        return self._format(flat)

    @override(Distribution)
    def rsample(self, *, sample_shape: tuple[int, ...] | None = None, **kwargs: Any) -> Any:
        raise NotImplementedError("discrete heads have no reparameterised sample")

    def to_deterministic(self) -> FactoredCategorical:
        """The greedy (argmax per head) version, used for inference without exploration."""
        return type(self)(self.logits, deterministic=True)

    @classmethod
    def from_logits(cls, logits: torch.Tensor, **kwargs: Any) -> FactoredCategorical:
        return cls(logits)

    @classmethod
    def required_input_dim(cls, space: gym.Space | None = None, **kwargs: Any) -> int:
        return sum(cls.head_sizes)

    def _format(self, flat: torch.Tensor) -> Any:
        if self.action_format == "dict":
            return {h: flat[..., i] for i, h in enumerate(self.head_names)}
        if self.action_format == "discrete":
            return flat[..., 0]
        return flat


_INDEX_CACHE: dict[tuple[tuple[int, ...], str], tuple[torch.Tensor, torch.Tensor]] = {}


def _padding_index(sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather index into ``[logits, -inf]`` giving a ``[num_heads * max_size]`` layout, and
    the ``[num_heads, max_size]`` validity mask; cached per (sizes, device)."""
    key = (sizes, str(device))
    cached = _INDEX_CACHE.get(key)
    if cached is None:
        width, pad_col = max(sizes), sum(sizes)
        index, valid, offset = [], [], 0
        for size in sizes:
            index.extend(range(offset, offset + size))
            index.extend([pad_col] * (width - size))
            valid.append([True] * size + [False] * (width - size))
            offset += size
        cached = (
            torch.tensor(index, dtype=torch.long, device=device),
            torch.tensor(valid, dtype=torch.bool, device=device),
        )
        _INDEX_CACHE[key] = cached
    return cached
