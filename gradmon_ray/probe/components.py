"""Non-destructive per-component gradient analysis of one batch (the probe's core).

Given a module and a postprocessed PPO batch, every PPO loss component (task = clipped
surrogate, entropy bonus, KL penalty, value loss), as it enters the total loss with its
coefficient, and every enabled regularizer gets its own ``torch.autograd.grad`` pass.
``autograd.grad`` returns gradients without writing ``.grad`` and no optimizer is involved,
so the module's parameters, gradients and any optimizer are left exactly as they were.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradmon_ray.losses.ppo import ppo_loss_from_batch
from gradmon_ray.losses.regularizers import RegularizerSpec
from gradmon_ray.telemetry.shares import cosine_similarities, signed_shares

COMPONENTS = ("task", "entropy", "kl", "value")


@dataclass
class ComponentReport:
    """Gradient norms of one batch, by component, head and regularizer (plain floats)."""

    norms: dict[str, float]
    """L2 norm of each component's gradient over all trainable parameters."""
    per_head: dict[str, dict[str, float]]
    """component -> head -> L2 norm over that head's parameters (``kl`` only with the KL loss)."""
    losses: dict[str, float]
    """policy, entropy, kl, value, total (as logged by PPO)."""
    shares: dict[str, float]
    """Signed shares of the PPO components in their summed gradient (sum to 1)."""
    cosines: dict[str, float]
    """``"<a>_vs_<b>"`` -> cosine similarity of the two component gradients."""
    regularizers: dict[str, float] = field(default_factory=dict)
    """``<name>_grad_norm``, ``<name>_grad_norm_error``, ``total_grad_norm``, ``<name>_share``."""


def _norm(grads: Sequence[torch.Tensor | None]) -> float:
    squares = [g.double().pow(2).sum() for g in grads if g is not None]
    return math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0


def component_gradients(
    module: Any,
    batch: Mapping[str, Any],
    *,
    clip_param: float,
    vf_clip_param: float,
    vf_loss_coeff: float,
    entropy_coeff: float,
    kl_coeff: float,
    use_kl_loss: bool,
    regularizers: Sequence[RegularizerSpec] = (),
) -> ComponentReport:
    """Analyse ``batch`` (a dict of tensors as the learner sees it) on ``module``.

    ``module`` must be a ``FactoredActorCritic`` (or expose ``head_parameter_groups``,
    ``forward_train``, ``compute_values`` and a ``FactoredCategorical`` distribution).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    fwd = module.forward_train(batch)
    terms = ppo_loss_from_batch(
        module,
        batch,
        fwd,
        clip_param=clip_param,
        vf_clip_param=vf_clip_param,
        vf_loss_coeff=vf_loss_coeff,
        entropy_coeff=entropy_coeff,
        kl_coeff=kl_coeff,
        use_kl_loss=use_kl_loss,
    )
    # The total loss is exactly the sum of these (masked means are linear).  Without the KL
    # loss there is no KL component (its gradient would be an uninformative zero).
    component_losses = {
        "task": terms.policy,
        "entropy": -entropy_coeff * terms.entropy,
        "kl": kl_coeff * terms.kl if use_kl_loss else None,
        "value": vf_loss_coeff * terms.value,
    }
    if not use_kl_loss:
        del component_losses["kl"]
    grads: dict[str, list[torch.Tensor]] = {}
    for name, loss in component_losses.items():
        if loss is None or not loss.requires_grad:
            grads[name] = [torch.zeros_like(p) for p in params]
            continue
        raw = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        grads[name] = [torch.zeros_like(p) if g is None else g for p, g in zip(params, raw, strict=True)]

    position = {id(p): i for i, p in enumerate(params)}
    head_index = {
        head: [position[id(p)] for p in ps if id(p) in position] for head, ps in module.head_parameter_groups().items()
    }
    per_head = {
        name: {head: _norm([g[i] for i in idx]) for head, idx in head_index.items()} for name, g in grads.items()
    }
    cosines = {f"{a}_vs_{b}": v for (a, b), v in cosine_similarities(grads).items()}
    report = ComponentReport(
        norms={name: _norm(g) for name, g in grads.items()},
        per_head=per_head,
        losses={
            "policy": float(terms.policy.detach()),
            "entropy": float(terms.entropy.detach()),
            "kl": float(terms.kl.detach()),
            "value": float(terms.value.detach()),
            "total": float(terms.total.detach()),
        },
        shares=signed_shares(grads),
        cosines=cosines,
    )
    if regularizers:
        report.regularizers = regularizer_grad_norms(module, batch, fwd, params, regularizers)
    return report


def regularizer_grad_norms(
    module: Any,
    batch: Mapping[str, Any],
    fwd: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    specs: Sequence[RegularizerSpec],
) -> dict[str, float]:
    """ADR-009: ``<name>_grad_norm`` (weighted), ``<name>_grad_norm_error`` (0/1),
    ``total_grad_norm`` (norm of the weighted sum) and ``<name>_share`` (signed)."""
    out: dict[str, float] = {}
    ok: dict[str, list[torch.Tensor]] = {}
    for spec in specs:
        if not spec.enabled:
            continue
        try:
            value = spec.weight * spec.fn(module, batch, fwd)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise TypeError(f"must return a scalar tensor, got {type(value).__name__}")
            if not value.requires_grad:
                raise TypeError("its value does not depend on the parameters (not differentiable)")
            raw = torch.autograd.grad(value.reshape(()), list(params), retain_graph=True, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, raw, strict=True)]
            norm = _norm(grads)
            if not math.isfinite(norm):
                raise FloatingPointError("non-finite gradient")
        except Exception as exc:  # a broken regularizer is reported, never fatal
            warnings.warn(f"regularizer {spec.name!r} gradient failed: {type(exc).__name__}: {exc}", stacklevel=2)
            out[f"{spec.name}_grad_norm_error"] = 1.0
            out[f"{spec.name}_grad_norm"] = math.nan
            continue
        ok[spec.name] = grads
        out[f"{spec.name}_grad_norm"] = norm
        out[f"{spec.name}_grad_norm_error"] = 0.0
    if ok:
        total = [torch.stack([g[i] for g in ok.values()]).sum(0) for i in range(len(params))]
        out["total_grad_norm"] = _norm(total)
        out.update({f"{name}_share": share for name, share in signed_shares(ok).items()})
    return out
