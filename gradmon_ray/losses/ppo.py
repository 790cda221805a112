"""PPO's loss, term by term, with the per-head log-probs kept.

This is RLlib's ``PPOTorchLearner.compute_loss_for_module`` formula (clipped surrogate,
clipped value loss, entropy bonus, optional KL penalty to the sampling policy), written as
a pure function because the learner needs the per-head log-probs it computes on the way
(for the NaN/Inf latches) and the probes need each term separately.  Deliberate differences:
masking uses ``torch.where`` instead of boolean indexing (which synchronises with the host to
size its output); every masked mean is taken in one pass over the stacked terms and the total
is their linear combination (fewer ops: a GPU minibatch is launch-bound), which differs from
RLlib's sum order at rounding level; and every term is returned.  ``tests/losses/test_ppo.py``
checks equality with RLlib's implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing
from ray.rllib.utils.numpy import SMALL_NUMBER

from gradmon_ray.losses.distribution import FactoredCategorical


@dataclass
class PPOLossTerms:
    """All terms of one PPO loss evaluation (0-d tensors unless noted)."""

    total: torch.Tensor
    policy: torch.Tensor
    """``-mean(surrogate)``."""
    value: torch.Tensor
    """Mean clipped squared value error (0 without a critic)."""
    value_unclipped: torch.Tensor
    entropy: torch.Tensor
    """Mean summed-over-heads entropy."""
    kl: torch.Tensor
    """Mean KL(sampling policy || current policy), 0 when the KL loss is off."""
    per_head_logp: torch.Tensor
    """``[B, num_heads]`` log-prob of each head's taken action under the current policy."""
    per_head_entropy_rows: torch.Tensor
    """``[B, num_heads]`` entropy of each head per row."""
    values: torch.Tensor
    """``[B]`` value predictions (zeros without a critic)."""
    mask: torch.Tensor | None = None

    @property
    def per_head_entropy(self) -> torch.Tensor:
        """``[num_heads]`` masked mean entropy per head, computed only when asked for (the
        training step never needs it, so it costs nothing per minibatch)."""
        return masked_mean(self.per_head_entropy_rows, self.mask)


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the first dimension's valid rows; plain mean when ``mask`` is None.

    ``valid``: ``mask.sum()`` when the caller has it already (a loss takes several masked means
    of one mask: one count, not one per term)."""
    if mask is None:
        return x.mean(dim=0)
    count = mask.sum() if valid is None else valid
    if x.dim() > 1:
        mask = mask.reshape(mask.shape[0], *([1] * (x.dim() - 1)))
    return torch.where(mask, x, 0.0).sum(dim=0) / count


_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _masked_means(rows: torch.Tensor, mask: torch.Tensor | None, valid: torch.Tensor | None) -> torch.Tensor:
    """``[terms]`` masked means of ``[terms, rows]`` (``masked_mean`` along the last dimension: the
    ``[rows]`` mask broadcasts without a reshape, and ``where`` takes a 0-d zero made once, not a
    Python 0.0 wrapped every call: two ops fewer a loss).  ``valid``: ``mask.sum()``."""
    if mask is None:
        return rows.mean(1)
    key = (rows.device, rows.dtype)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = _ZEROS[key] = torch.zeros((), dtype=rows.dtype, device=rows.device)
    return torch.where(mask, rows, zero).sum(1) / valid


def explained_variance(targets: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
    """``max(-1, 1 - Var(targets - predictions) / Var(targets))``, RLlib's formula.

    RLlib's ``explained_variance`` builds its ``-1`` bound on the host and copies it to the
    device on every call; this clamps on the device instead.
    """
    y = targets if targets.dim() == 1 else targets.squeeze()  # a 1-D squeeze is a no-op, but still an op
    y_hat = predictions if predictions.dim() == 1 else predictions.squeeze()
    y_var = torch.var(y, dim=0)
    diff_var = torch.var(y - y_hat, dim=0)
    return torch.clamp(1 - diff_var / (y_var + SMALL_NUMBER), min=-1.0)


def ppo_loss_terms(
    *,
    dist: FactoredCategorical,
    prev_dist: FactoredCategorical | None,
    actions: object,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    values: torch.Tensor | None,
    value_targets: torch.Tensor | None,
    mask: torch.Tensor | None,
    clip_param: float,
    vf_clip_param: float,
    vf_loss_coeff: float,
    entropy_coeff: float | torch.Tensor,
    kl_coeff: float | torch.Tensor,
    use_kl_loss: bool,
    separate_means: bool = False,
) -> PPOLossTerms:
    """Evaluate PPO's loss; ``values=None`` means no critic (value terms are zero).

    ``separate_means``: one masked mean per term instead of one over the stacked terms, so that
    each term's gradient alone never runs through another's graph (the stacked mean's backward
    sends it zeros, and 0 x NaN is NaN): the diagnosis's per-term blame (``rllib.diagnosis``)."""
    valid = mask.sum() if mask is not None else None  # one count for every masked mean
    per_head_logp = dist.per_head_logp(actions)
    logp_ratio = torch.exp(per_head_logp.sum(-1) - old_logp)
    surrogate = torch.min(
        advantages * logp_ratio,
        advantages * torch.clamp(logp_ratio, 1 - clip_param, 1 + clip_param),
    )
    per_head_entropy = dist.per_head_entropy()
    entropy = per_head_entropy.sum(-1)

    if use_kl_loss and prev_dist is None:
        raise ValueError("use_kl_loss needs the sampling policy's distribution")
    has_critic = values is not None
    if has_critic:
        vf_loss = torch.pow(values - value_targets, 2.0)
        vf_loss_clipped = torch.clamp(vf_loss, 0, vf_clip_param)
    else:
        values = torch.zeros_like(surrogate)
    # Every masked mean of the loss at once: one stack, one masked sum, one division (one masked
    # mean per term was four dispatched ops each, forward, and as many backward: a GPU minibatch
    # is launch-bound).  The total is their linear combination, as a mean is linear.
    columns = [surrogate, entropy]
    if has_critic:
        columns += [vf_loss_clipped, vf_loss]
    if use_kl_loss:
        columns.append(prev_dist.kl(dist))  # type: ignore[union-attr]
    if separate_means:
        means = iter([_masked_means(column.unsqueeze(0), mask, valid)[0] for column in columns])
    else:
        means = iter(_masked_means(torch.stack(columns), mask, valid).unbind(0))  # in ``columns``' order
    policy, mean_entropy = -next(means), next(means)
    zero = None if has_critic and use_kl_loss else torch.zeros((), device=surrogate.device)  # an op: only if used
    mean_vf_loss, mean_vf_unclipped = (next(means), next(means)) if has_critic else (zero, zero)
    mean_kl = next(means) if use_kl_loss else zero

    total = policy - entropy_coeff * mean_entropy
    if has_critic:
        total = total + vf_loss_coeff * mean_vf_loss
    if use_kl_loss:
        total = total + kl_coeff * mean_kl
    return PPOLossTerms(
        total=total,
        policy=policy,
        value=mean_vf_loss,
        value_unclipped=mean_vf_unclipped,
        entropy=mean_entropy,
        kl=mean_kl,
        per_head_logp=per_head_logp,
        per_head_entropy_rows=per_head_entropy,
        values=values,
        mask=mask,
    )


def ppo_loss_from_batch(
    module: Any,
    batch: Mapping[str, Any],
    fwd_out: Mapping[str, Any],
    *,
    clip_param: float,
    vf_clip_param: float,
    vf_loss_coeff: float,
    entropy_coeff: float | torch.Tensor,
    kl_coeff: float | torch.Tensor,
    use_kl_loss: bool,
    use_critic: bool = True,
    logits: torch.Tensor | None = None,
    separate_means: bool = False,
) -> PPOLossTerms:
    """``ppo_loss_terms`` on an RLlib train batch and ``module.forward_train`` output.

    ``module`` is a ``FactoredActorCritic`` (any RLModule whose train distribution is a
    ``FactoredCategorical`` and that has ``compute_values``).  ``logits`` overrides
    ``fwd_out``'s action logits (the learner's fault injection uses it).
    """
    dist_cls = module.get_train_action_dist_cls()
    if not issubclass(dist_cls, FactoredCategorical):
        raise TypeError("the PPO loss needs an RLModule whose action distribution is FactoredCategorical")
    dist = dist_cls.from_logits(fwd_out[Columns.ACTION_DIST_INPUTS] if logits is None else logits)
    prev_dist = (
        module.get_exploration_action_dist_cls().from_logits(batch[Columns.ACTION_DIST_INPUTS]) if use_kl_loss else None
    )
    values = module.compute_values(batch, embeddings=fwd_out.get(Columns.EMBEDDINGS)) if use_critic else None
    return ppo_loss_terms(
        dist=dist,
        prev_dist=prev_dist,
        actions=batch[Columns.ACTIONS],
        old_logp=batch[Columns.ACTION_LOGP],
        advantages=batch[Postprocessing.ADVANTAGES],
        values=values,
        value_targets=batch.get(Postprocessing.VALUE_TARGETS),
        mask=batch.get(Columns.LOSS_MASK),
        clip_param=clip_param,
        vf_clip_param=vf_clip_param,
        vf_loss_coeff=vf_loss_coeff,
        entropy_coeff=entropy_coeff,
        kl_coeff=kl_coeff,
        use_kl_loss=use_kl_loss,
        separate_means=separate_means,
    )
