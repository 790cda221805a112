"""The independent oracle of the drop-in tests: autograd of the STOCK learner's loss, by parameter name."""

from __future__ import annotations

import math
from typing import Any

import torch


def stock_head_norms(stock: Any, batch: Any, module_id: str, prefixes: dict[str, str]) -> dict[str, float]:
    """Norms of d(``stock``'s loss of ``module_id``)/d(parameters named like each head), float64.

    RLlib's own ``compute_loss_for_module`` and ``torch.autograd.grad`` by ``named_parameters()``
    prefix: nothing of gradmon's head resolution or ``GradientNormPlan``."""
    tensors = dict(stock._convert_batch_type(batch).policy_batches[module_id])
    module = stock.module[module_id].unwrapped()
    loss = stock.compute_loss_for_module(
        module_id=module_id,
        config=stock.config.get_config_for_module(module_id),
        batch=tensors,
        fwd_out=module.forward_train(tensors),
    )
    named = dict(module.named_parameters())
    out = {}
    for head, prefix in prefixes.items():
        params = [p for n, p in named.items() if n.startswith(prefix)]
        assert params, prefix
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        out[head] = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    return out
