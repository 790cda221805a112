"""Blame for a non-finite event: which head, minibatch, loss term, parameter and rows, re-run on a copy.

Per minibatch a gradmon learner keeps a REFERENCE to each monitored module's minibatch (no
kernel, no copy; freed at the drain), and per update one to the train batch's columns (RLlib
shuffles a module's batch between epochs by replacing its columns, so the kept dict still holds
the unshuffled rows that ``RowOrigins`` maps to episodes).  At the drain, when the host copy
says a module had a NaN/Inf gradient, a skipped minibatch or a newly tripped log-prob latch,
``diagnose_module`` names:

- the heads whose norm was non-finite in the first such minibatch (the minibatch norms that
  ride the step's host copy);
- the loss terms and the first parameter, from a re-run of that minibatch on a deep copy of the
  module (the learner's module, its gradients and optimizer are untouched) with the weights the
  learner holds at the drain: equal to those of the minibatch when every later minibatch was
  skipped, and a poisoned weight or a NaN in the data is non-finite again with any weights
  ("reproduced"), where a one-off fault is not;
- the rows, upstream first (``telemetry.blame``), with the first row's episode, agent, timestep.

Nothing here runs unless the event happened: the per-minibatch path only appends references.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from ray.rllib.core.columns import Columns

from gradmon_ray.rllib.row_origins import RowOrigins
from gradmon_ray.telemetry.blame import Diagnosis, blame_rows, json_number
from gradmon_ray.telemetry.head_norms import ParamRows
from gradmon_ray.telemetry.tracker import IterationTelemetry

LossTermsFn = Callable[[Any, Mapping[str, Any], Mapping[str, Any]], "dict[str, torch.Tensor] | None"]
"""``(module copy, minibatch, forward output) -> {term name: 0-d loss}`` as they enter the loss
(their sum need not be the loss: only finiteness is read); None: the learner's loss is not split."""


@dataclass
class DiagnosisInputs:
    """What a learner keeps, by reference, for a diagnosis at the step's drain."""

    minibatches: dict[Any, list[tuple[int, int, Mapping[str, Any]]]] = field(default_factory=lambda: defaultdict(list))
    """Per module: (minibatch index in the step, update number, the minibatch's columns)."""
    train_columns: dict[Any, dict[str, Any]] = field(default_factory=dict)
    """Per module: the last update's train batch columns (before any shuffle)."""
    updates: int = 0
    origins: RowOrigins | None = None

    def keep_minibatch(self, module_id: Any, index: int, batch: Mapping[str, Any]) -> None:
        self.minibatches[module_id].append((index, self.updates, batch))

    def keep_train_batch(self, batch: Any) -> None:
        self.updates += 1
        policy_batches = getattr(batch, "policy_batches", None) or {}
        # dict(...): a copy of the column map, not of a tensor (RLlib's shuffle swaps the columns).
        self.train_columns = {mid: dict(part) for mid, part in policy_batches.items()}

    def clear(self) -> None:
        """The step's end: nothing kept holds device memory until the next update."""
        self.minibatches = defaultdict(list)
        self.train_columns = {}


def event_in(summary: IterationTelemetry) -> bool:
    """Whether the step had a non-finite event: a NaN/Inf gradient, a skipped minibatch, a latch tripped now."""
    tripped = [*summary.nan_first_iteration.values(), *summary.inf_first_iteration.values()]
    return (
        summary.nan_grad_count > 0 or summary.inf_grad_count > 0 or summary.skipped > 0 or summary.iteration in tripped
    )


def first_nonfinite_minibatch(norms: np.ndarray | None, among: Sequence[int] | None = None) -> int | None:
    """The first row of ``[minibatches, heads + 1]`` norms with a non-finite entry (of rows ``among``)."""
    if norms is None or norms.size == 0:
        return None
    bad = ~np.isfinite(norms).all(axis=1)
    rows = [i for i in (range(len(bad)) if among is None else among) if i < len(bad) and bad[i]]
    return int(rows[0]) if rows else None


def diagnose_module(
    *,
    module_id: Any,
    rl_module: torch.nn.Module,
    groups: Mapping[str, Sequence[Any]],
    head_names: Sequence[str],
    summary: IterationTelemetry,
    norms: np.ndarray | None,
    inputs: DiagnosisInputs,
    loss_terms: LossTermsFn,
    rank: int = 0,
) -> Diagnosis:
    """The blame for one module's non-finite event in this step (see the module docstring)."""
    kept = inputs.minibatches.get(module_id, [])
    # A module absent from a minibatch (a sparse agent) has NaN norms there ("no gradient"): only the
    # minibatches it was in can blame it.
    present = sorted({index for index, _, _ in kept})
    first = first_nonfinite_minibatch(norms, present or None)
    heads = (
        [] if first is None else [h for h, v in zip(head_names, norms[first, :-1], strict=False) if not np.isfinite(v)]
    )
    chosen = next((k for k in kept if k[0] == first), None) if first is not None else None
    if chosen is None:  # no non-finite norm (a latch only): the first kept minibatch with a bad row
        chosen = next((k for k in kept if blame_rows(k[2]).count > 0), kept[0] if kept and first is None else None)
    reproduced, rerun, terms, parameter, rows = None, {}, [], None, {}
    if chosen is not None:
        index, update, batch = chosen
        first = index if first is None else first
        replay = rerun_minibatch(rl_module, batch, groups, loss_terms)
        reproduced, rerun, terms, parameter = replay.reproduced, replay.report, replay.terms, replay.parameter
        train = inputs.train_columns.get(module_id) if update == inputs.updates else None
        found = blame_rows({**batch, **replay.row_fields}, train)
        origin = None
        # The recorded episodes are this train batch's when their row counts agree.
        if found.first_row is not None and found.in_train_batch and inputs.origins is not None:
            matches = inputs.origins.rows(module_id) == _rows_of(train)
            origin = inputs.origins.origin(module_id, found.first_row) if matches else None
        rows = {
            "count": found.count,
            "fields": found.fields,
            "obs_columns": found.obs_columns,
            "first_field": found.first_field,
            "spread_by": found.spread_by,
            "first": origin or {"row": found.first_row, "in": "train batch" if found.in_train_batch else "minibatch"},
        }
    return Diagnosis(
        iteration=summary.iteration,
        module=str(module_id),
        minibatch=first,
        minibatches=summary.minibatches,
        skipped=summary.skipped,
        heads=heads,
        loss_terms=terms,
        parameter=parameter,
        rows=rows,
        reproduced=reproduced,
        rerun=rerun,
        rank=rank,
        heads_total=len(head_names),
    )


def _rows_of(columns: Mapping[str, Any] | None) -> int:
    if not columns:
        return -1
    obs = columns.get(Columns.OBS)
    return int(obs.shape[0]) if isinstance(obs, torch.Tensor) else -1


@dataclass
class Replay:
    """One minibatch re-run on a copy of the module."""

    reproduced: bool
    terms: list[str]
    parameter: str | None
    report: dict[str, Any]
    row_fields: dict[str, torch.Tensor]


def rerun_minibatch(
    rl_module: torch.nn.Module, batch: Mapping[str, Any], groups: Mapping[str, Sequence[Any]], loss_terms: LossTermsFn
) -> Replay:
    """Forward, loss terms and gradients of ``batch`` on a deep copy of ``rl_module`` (non-destructive)."""
    names = {id(p): n for n, p in rl_module.named_parameters()}
    twin = copy.deepcopy(rl_module)
    params = [(n, p) for n, p in twin.named_parameters() if p.requires_grad]
    bad_weight = next((n for n, p in params if not bool(torch.isfinite(p.detach()).all())), None)
    with torch.enable_grad():
        fwd = twin.forward_train(dict(batch))
        logits = fwd[Columns.ACTION_DIST_INPUTS]
        row_fields = {"module_logits": logits.detach()}
        try:
            dist = twin.get_train_action_dist_cls().from_logits(logits)
            row_fields["module_logp"] = dist.logp(batch[Columns.ACTIONS]).detach()
        except Exception:  # a distribution without logp on these actions: its logits still count
            pass
        terms = loss_terms(twin, batch, fwd) or {}
        bad_terms, values, total_grads = [], {}, None
        tensors = [p for _, p in params]
        for name, value in terms.items():
            values[name] = json_number(float(value.detach()))
            grads = (
                torch.autograd.grad(value, tensors, allow_unused=True, retain_graph=True)
                if value.requires_grad
                else [None] * len(tensors)
            )
            finite = bool(torch.isfinite(value.detach())) and all(
                g is None or bool(torch.isfinite(g).all()) for g in grads
            )
            if not finite:
                bad_terms.append(name)
            total_grads = (
                grads if total_grads is None else [_add(a, b) for a, b in zip(total_grads, grads, strict=True)]
            )
    grads_by_name = dict(zip((n for n, _ in params), total_grads or [None] * len(params), strict=True))
    bad_grad = next((n for n, g in grads_by_name.items() if g is not None and not bool(torch.isfinite(g).all())), None)
    head_counts = {
        head: _counts([_rows(grads_by_name.get(names.get(id(_param(part)), "")), part) for part in parts])
        for head, parts in groups.items()
    }
    outputs_bad = any(not bool(torch.isfinite(t).all()) for t in row_fields.values())
    reproduced = bool(bad_terms) or bad_grad is not None or bad_weight is not None or outputs_bad
    report = {"loss": values, "head_grad_counts": head_counts, "weights_finite": bad_weight is None}
    return Replay(reproduced, bad_terms, bad_weight or bad_grad, report, row_fields)


def _param(part: Any) -> torch.nn.Parameter:
    return part.param if isinstance(part, ParamRows) else part


def _rows(grad: torch.Tensor | None, part: Any) -> torch.Tensor | None:
    if grad is None:
        return None
    return grad[part.rows] if isinstance(part, ParamRows) else grad


def _counts(grads: list[torch.Tensor | None]) -> dict[str, int]:
    present = [g for g in grads if g is not None]
    nan = sum(int(torch.isnan(g).sum()) for g in present)
    inf = sum(int(torch.isinf(g).sum()) for g in present)
    return {"nan": nan, "inf": inf}


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b
