"""Agents that pull against each other: each module's gradient on the parameters modules share.

With a shared encoder (RLlib's ``multi_agent/shared_encoder_cartpole.py``: an encoder module
without a loss of its own, under two policy modules) the learner's one backward sums every
policy's gradient on the encoder, and its norm says nothing about whether the policies agree.
Every ``shared_gradients_every`` telemetry steps, on the step's last minibatch (the learner kept
references to it), this re-runs the forward of the whole ``MultiRLModule`` and each module's loss
and takes each loss's gradient alone (``torch.autograd.grad``: the learner's ``.grad`` and
optimizer are untouched).  Shared: a parameter that two or more modules' losses reach.  Per
module: the norm of its gradient on the shared parameters and the lowest cosine with another
module's (-1: they pull in opposite directions); every pair's cosine goes to the driver as JSON.
The numbers ride the step's one host copy.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import torch

LossFn = Callable[[Any, Mapping[str, Any], Mapping[str, Any]], torch.Tensor]
"""``(module id, its minibatch, its forward output) -> its loss`` (the learner's, without gradmon's recording)."""


def last_shared_minibatch(kept: Mapping[Any, list[tuple[int, int, Mapping[str, Any]]]]) -> dict[Any, Mapping[str, Any]]:
    """The latest minibatch (by step index) with two or more modules' rows: ``{module id: its columns}``."""
    by_index: dict[int, dict[Any, Mapping[str, Any]]] = {}
    for module_id, entries in kept.items():
        for index, _, batch in entries:
            by_index.setdefault(index, {})[module_id] = batch
    shared = [index for index, modules in by_index.items() if len(modules) >= 2]
    return by_index[max(shared)] if shared else {}


def shared_gradients(multi_module: Any, batch: Mapping[Any, Mapping[str, Any]], loss: LossFn) -> torch.Tensor | None:
    """``[modules, modules + 1]``: per module (``batch``'s order) its shared-gradient norm, then its cosine
    with each module's (1 with itself); None when no parameter is reached by two losses."""
    modules = [m for m in multi_module.values() if isinstance(m, torch.nn.Module)]  # a MultiRLModule is not one
    params = list({id(p): p for m in modules for p in m.parameters() if p.requires_grad}.values())
    with ExitStack() as stack, torch.enable_grad():
        for module in modules:  # 2+ learners: a DDP forward outside no_sync would wait for a backward sync
            if isinstance(module, torch.nn.parallel.DistributedDataParallel):
                stack.enter_context(module.no_sync())
        fwd = multi_module.forward_train({mid: dict(columns) for mid, columns in batch.items()})
        grads = {}
        for module_id, columns in batch.items():
            if module_id not in fwd:
                continue
            value = loss(module_id, columns, fwd[module_id])
            grads[module_id] = torch.autograd.grad(value, params, allow_unused=True, retain_graph=True)
    reached = [i for i in range(len(params)) if sum(g[i] is not None for g in grads.values()) >= 2]
    if len(grads) < 2 or not reached:
        return None
    with torch.no_grad():
        vectors = torch.stack(
            [
                torch.cat([(g[i] if g[i] is not None else torch.zeros_like(params[i])).reshape(-1) for i in reached])
                for g in grads.values()
            ]
        ).double()
        norms = vectors.norm(dim=1)
        cosines = (vectors @ vectors.T) / (norms[:, None] * norms[None, :])
        return torch.cat([norms[:, None], cosines], dim=1)


def shared_metrics(module_ids: list[Any], values: Any, norm_name: str, min_name: str) -> dict[Any, dict[str, float]]:
    """Per module its shared-gradient norm and lowest cosine with another module (host values)."""
    out: dict[Any, dict[str, float]] = {}
    for k, module_id in enumerate(module_ids):
        others = [float(values[k][1 + j]) for j in range(len(module_ids)) if j != k]
        out[module_id] = {norm_name: float(values[k][0]), min_name: min(others)}
    return out


def pair_cosines(module_ids: list[Any], values: Any) -> str:
    """Every pair's cosine as JSON, ``{"p0_vs_p1": 0.12, ...}``."""
    pairs = {
        f"{a}_vs_{b}": float(values[i][1 + j]) for (i, a), (j, b) in itertools.combinations(enumerate(module_ids), 2)
    }
    return json.dumps(pairs, sort_keys=True)
