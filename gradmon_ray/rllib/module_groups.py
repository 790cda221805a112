"""Modules with the same action distribution, drained together: one latch pass and one head-health
pass per group of such modules, not one per module.

A step's drain used to compute, module by module, the latches' per-head log-probs of every
minibatch (``heads.per_head_logp``, some 30 ops) and the head health of the last minibatch
(``telemetry.head_entropy``, some 30 ops).  Modules that share their RLlib module class, action
space and action-distribution inputs' width and dtype (self-play, independent agents of one
kind: the common multi-agent case) share the distribution, so their inputs are concatenated and
measured once; per module, a segmented sum (``index_add`` over each module's rows) splits the
result again.  A group of one module runs the single-module code.

The result is a list of *blocks*: ``(module indices, tensor)``, the tensor holding, module after
module, what each module of the block contributes (``lane_fold.LaneFold`` and
``distributed.reduce_modules`` read the blocks).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import tree  # dm-tree, an RLlib dependency: actions may be nested (a Dict action space)

from gradmon_ray.rllib.heads import per_head_logp
from gradmon_ray.rllib.module_telemetry import ModuleTelemetry
from gradmon_ray.telemetry.accumulator import joined_mask, nonfinite_flags
from gradmon_ray.telemetry.head_entropy import grouped_head_health_lanes, segment_ids

Block = tuple[list[int], list[torch.Tensor]]
"""(module indices, tensors whose concatenation holds their values module after module): the
latch flags' blocks (``lane_fold.FlagBlock``)."""


@torch.no_grad()  # the references are not detached (no op a minibatch)
def latch_flag_blocks(monitors: Sequence[ModuleTelemetry]) -> list[Block]:
    """The step's log-prob latch flags of every module: per module ``[NaN flag per latch head,
    Inf flag per latch head]`` (bool; rows a loss mask drops never latch); the records are cleared.

    The drop-in's references (``record_latch_inputs``) are grouped by distribution; log-probs a
    loss handed over (``record_logp``) are read module by module."""
    blocks: list[Block] = []
    groups: dict[Hashable, list[tuple[int, ModuleTelemetry, list[Any]]]] = {}
    for index, monitor in enumerate(monitors):
        inputs = monitor.take_latch_inputs()
        if inputs:
            groups.setdefault(_distribution_key(monitor, inputs[0][0]), []).append((index, monitor, inputs))
        else:
            blocks.append(([index], list(monitor.accumulator.take_logp_flags())))
    for members in groups.values():
        blocks.append(_group_latch_flags(members))
    return blocks


def _distribution_key(monitor: ModuleTelemetry, logits: torch.Tensor) -> Hashable:
    """Modules with equal keys have the same train action distribution over the same actions."""
    module = monitor.rl_module
    return (type(module), repr(module.action_space), logits.shape[-1], logits.dtype, len(monitor.tracker.latch_heads))


def _group_latch_flags(members: list[tuple[int, ModuleTelemetry, list[Any]]]) -> Block:
    records = [record for _, _, inputs in members for record in inputs]
    logits = torch.cat([x for x, _, _ in records])
    actions = tree.map_structure(lambda *parts: torch.cat(parts), *(a for _, a, _ in records))
    rows = [x.shape[:-1].numel() for x, _, _ in records]
    keep = joined_mask(rows, [m for _, _, m in records], logits.device)
    _, first, _ = members[0]
    logp = per_head_logp(first.rl_module, logits, actions, len(first.tracker.latch_heads))
    indices = [index for index, _, _ in members]
    if len(members) == 1:
        return indices, list(nonfinite_flags(logp, keep))
    module_rows = [sum(x.shape[:-1].numel() for x, _, _ in inputs) for _, _, inputs in members]
    src = logp if keep is None else torch.where(keep.unsqueeze(-1), logp, 0.0)  # padding rows never latch
    marks = torch.cat([torch.isnan(src), torch.isinf(src)], dim=1).to(logp.dtype)  # [rows, 2 x heads]
    counts = logp.new_zeros(len(members), marks.shape[1]).index_add_(0, segment_ids(module_rows, logp.device), marks)
    return indices, [(counts > 0).reshape(-1)]


@torch.no_grad()
def health_blocks(monitors: Sequence[ModuleTelemetry]) -> list[tuple[list[int], torch.Tensor]]:
    """The step's head-health lanes (``telemetry.head_entropy.head_health_lanes``) of every module
    that measures it, from its last minibatch; the references are forgotten."""
    blocks: list[tuple[list[int], torch.Tensor]] = []
    groups: dict[Hashable, list[tuple[int, Any]]] = {}
    for index, monitor in enumerate(monitors):
        recorder = monitor.head_health
        if not recorder.enabled:
            continue
        last = recorder.take()
        if last is None:
            blocks.append(([index], recorder.empty_lanes()))
            continue
        logits, prev, _ = last
        key = (recorder.sizes, logits.shape[-1], logits.dtype, prev is None)
        groups.setdefault(key, []).append((index, last))
    for (sizes, *_), members in groups.items():
        lasts = [last for _, last in members]
        sampling = None if lasts[0][1] is None else [prev for _, prev, _ in lasts]
        lanes = grouped_head_health_lanes([x for x, _, _ in lasts], sampling, sizes, [m for _, _, m in lasts])
        blocks.append(([index for index, _ in members], lanes))
    return blocks
