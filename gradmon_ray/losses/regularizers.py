"""Regularizers whose gradient the probe tracks (seed 003, ADR-009).

A ``RegularizerSpec`` is a name, a function ``fn(module, batch, fwd_out) -> scalar tensor``,
a weight and an on/off switch.  Built-ins are below; a user regularizer is given by dotted
path (``"my_pkg.regs:entropy_floor"``).  Tracking is off by default (it costs one backward
pass per regularizer).  A regularizer that raises, or whose value does not depend on the
parameters, is reported with ``<name>_grad_norm_error = 1`` and a warning; it never stops
the probe or training.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from ray.rllib.core.columns import Columns

from gradmon_ray.import_paths import resolve_regularizer_fn
from gradmon_ray.losses.ppo import masked_mean

RegularizerFn = Callable[[torch.nn.Module, Mapping[str, Any], Mapping[str, Any]], torch.Tensor]


@dataclass(frozen=True)
class RegularizerSpec:
    """One regularizer: ``weight * fn(module, batch, fwd_out)``."""

    name: str
    fn: RegularizerFn
    weight: float = 1.0
    enabled: bool = True


def logit_l2(module: torch.nn.Module, batch: Mapping[str, Any], fwd_out: Mapping[str, Any]) -> torch.Tensor:
    """Mean over valid rows of the mean squared action logit (keeps logits from running away)."""
    logits = fwd_out[Columns.ACTION_DIST_INPUTS]
    return masked_mean(logits.pow(2).mean(-1), batch.get(Columns.LOSS_MASK))


def uniform_prior_kl(module: torch.nn.Module, batch: Mapping[str, Any], fwd_out: Mapping[str, Any]) -> torch.Tensor:
    """Mean over valid rows of the sum over heads of KL(pi_head || uniform) = log K_head - H_head."""
    dist = module.get_train_action_dist_cls().from_logits(fwd_out[Columns.ACTION_DIST_INPUTS])
    log_k = _log_sizes(tuple(dist.head_sizes), dist.logits.device)
    return masked_mean((log_k - dist.per_head_entropy()).sum(-1), batch.get(Columns.LOSS_MASK))


@functools.cache
def _log_sizes(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``log K`` per head on ``device``, made once (a tensor from host data every minibatch is a
    pageable host->device copy: a wait on a GPU).  Never written to, so sharing it is safe."""
    return torch.tensor([math.log(k) for k in sizes], device=device)


def weight_l2(module: torch.nn.Module, batch: Mapping[str, Any], fwd_out: Mapping[str, Any]) -> torch.Tensor:
    """Sum of squared trainable parameters."""
    return sum(p.pow(2).sum() for p in module.parameters() if p.requires_grad)  # type: ignore[return-value]


BUILTIN_REGULARIZERS: dict[str, RegularizerFn] = {
    "logit_l2": logit_l2,
    "uniform_prior_kl": uniform_prior_kl,
    "weight_l2": weight_l2,
}


def resolve_regularizer(
    name: str, fn: str | RegularizerFn | None = None, weight: float = 1.0, enabled: bool = True
) -> RegularizerSpec:
    """A spec from config: ``fn`` is a built-in name, ``"pkg.module:function"``, or a callable
    (default: the built-in called ``name``).  Unknown names and failed imports are errors
    that name the regularizer and the allowed built-ins (``gradmon_ray.import_paths``)."""
    resolved = resolve_regularizer_fn(name, fn)
    function = BUILTIN_REGULARIZERS[resolved] if isinstance(resolved, str) else resolved
    return RegularizerSpec(name, function, float(weight), bool(enabled))
