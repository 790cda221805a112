"""Which rows of a train batch held a non-finite value, upstream first, and the one-line blame.

Pure torch on the columns of one module's batch (RLlib's column names); no RLlib, no host read
beyond the answer.  ``rllib.diagnosis`` calls it at the drain of an iteration with a non-finite
event; ``tracking`` and ``viz`` render its ``Diagnosis`` JSON with ``blame_line``.

"Upstream first": a NaN reward makes the GAE value targets of every row before it NaN (RLlib's
GAE is one backward discounted sum over the episodes concatenated, masked with 0 x NaN = NaN, so
it crosses episode boundaries), and the batch-wide advantage standardization then makes EVERY
advantage NaN.  The
first field (in ``UPSTREAM_FIELDS`` order) with a non-finite value anywhere in the train batch
is the cause, its first such row is the row blamed, and the fields it poisoned downstream are
named as spread (``spread_by``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

RESULT_KEY = "gradmon_diagnosis"
"""The key of the learners' ``Diagnosis`` JSONs under RLlib's ``result["learners"][module]`` (not a metric)."""

UPSTREAM_FIELDS = ("obs", "rewards", "value_targets", "advantages", "action_dist_inputs", "action_logp")
"""Batch columns checked, each computed from the ones before it (env, then GAE, then the
standardization; the sampling policy's logits and log-probs come from the observation)."""
RERUN_FIELDS = ("module_logits", "module_logp")
"""What the re-run adds per row: the current module's action-distribution inputs and the log-prob
of the taken action (non-finite there and nowhere upstream: the weights, not the data)."""

SPREAD_BY = {
    "value_targets": "GAE (RLlib's backward discounted sum over the concatenated batch: every earlier row)",
    "advantages": "advantage standardization over the whole train batch",
}
"""Why a downstream field is non-finite in more rows than its cause."""


def nonfinite_rows(value: Any) -> torch.Tensor | None:
    """``[B]`` bool: the rows of a batch column with a NaN/Inf entry (None: not a float tensor)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() == 0:
        return None
    bad = ~torch.isfinite(value.detach())
    return bad.reshape(bad.shape[0], -1).any(dim=1)


@dataclass
class RowBlame:
    """The rows of one minibatch (and of its whole train batch) with a non-finite value."""

    count: int
    """Rows of the minibatch with a non-finite value in any checked field."""
    fields: list[str]
    """Checked fields that held a non-finite value: the minibatch's, and the train batch's cause."""
    obs_columns: list[int]
    """Flat observation indices that held a non-finite value (train batch, else the minibatch)."""
    first_row: int | None
    """Row of the cause in the train batch (in the minibatch where no train batch was kept)."""
    first_field: str | None
    """The most upstream field with a non-finite value: the cause."""
    spread_by: list[str] = field(default_factory=list)
    """How the cause reached the other fields (``SPREAD_BY``), in upstream order."""
    in_train_batch: bool = False
    """Whether ``first_row`` indexes the whole train batch (else the minibatch)."""


def blame_rows(minibatch: Mapping[str, Any], train_batch: Mapping[str, Any] | None = None) -> RowBlame:
    """Count the minibatch's non-finite rows; find the cause upstream first in ``train_batch``."""
    checked = (*UPSTREAM_FIELDS, *RERUN_FIELDS)
    mini_rows = {f: r for f in checked if (r := nonfinite_rows(minibatch.get(f))) is not None}
    any_row = None
    for rows in mini_rows.values():
        any_row = rows if any_row is None else any_row | rows
    count = int(any_row.sum()) if any_row is not None else 0
    fields = [f for f, rows in mini_rows.items() if bool(rows.any())]
    # The cause: the first poisoned field of the whole train batch, upstream first; with none there
    # (the weights, not the data), the first of the minibatch's own and re-run fields.
    first_field, first_row, source, in_train = None, None, minibatch, False
    if train_batch is not None:
        source_rows = {f: r for f in UPSTREAM_FIELDS if (r := nonfinite_rows(train_batch.get(f))) is not None}
        first_field = next((f for f in UPSTREAM_FIELDS if f in source_rows and bool(source_rows[f].any())), None)
        source, in_train = train_batch, True
    if first_field is None:
        source_rows, source, in_train = mini_rows, minibatch, False
        first_field = next((f for f in checked if f in mini_rows and bool(mini_rows[f].any())), None)
    if first_field is not None:
        first_row = int(source_rows[first_field].nonzero()[0, 0])
    if first_field is not None and first_field not in fields:
        fields.append(first_field)
    fields.sort(key=checked.index)
    return RowBlame(
        count=count,
        fields=fields,
        obs_columns=_obs_columns(source.get("obs")),
        first_row=first_row,
        first_field=first_field,
        spread_by=_spread(source_rows, first_field),
        in_train_batch=in_train,
    )


def _obs_columns(obs: Any) -> list[int]:
    if not isinstance(obs, torch.Tensor) or not obs.is_floating_point() or obs.dim() == 0:
        return []
    bad = ~torch.isfinite(obs.detach().reshape(obs.shape[0], -1))
    return [int(i) for i in bad.any(dim=0).nonzero().flatten()]


def _spread(rows: Mapping[str, torch.Tensor], cause: str | None) -> list[str]:
    """The downstream fields non-finite in rows where every field before them was finite."""
    if cause is None:
        return []
    spread, upstream = [], None
    for name in UPSTREAM_FIELDS:
        bad = rows.get(name)
        if bad is None:
            continue
        if name in SPREAD_BY and upstream is not None and bool((bad & ~upstream).any()):
            spread.append(SPREAD_BY[name])
        upstream = bad if upstream is None else upstream | bad
    return spread


def json_number(value: float) -> float | str:
    """A float as JSON allows it: ``"nan"``, ``"inf"``, ``"-inf"`` as strings."""
    return value if math.isfinite(value) else str(value)


@dataclass
class Diagnosis:
    """One non-finite event of one module in one iteration (``diagnosis/iter_<n>_<module>.json``).

    The keys of ``to_json`` are a contract other tools read (docs/diagnosis.md)."""

    iteration: int
    module: str
    minibatch: int | None
    """First minibatch (from 0, over all epochs) with a non-finite gradient or row."""
    minibatches: int
    skipped: int
    """Minibatches the learner skipped in the iteration (0 also when the optimizer stepped on NaN)."""
    heads: list[str]
    """Heads whose gradient norm was non-finite in that minibatch."""
    loss_terms: list[str]
    """Loss terms whose value or gradient was non-finite on the re-run."""
    parameter: str | None
    """The first non-finite weight by name, else the first with a non-finite gradient on the re-run."""
    rows: dict[str, Any]
    reproduced: bool | None
    """Re-run on a copy of the module: non-finite again (data or weights), not (a transient fault),
    None (not re-run: no minibatch kept, or a learner whose loss gradmon cannot split)."""
    rerun: dict[str, Any] = field(default_factory=dict)
    """Per component of the re-run: each loss term's value, per head NaN/Inf gradient counts."""
    rank: int = 0
    heads_total: int = 0
    """The module's reported heads (``heads`` is all of them when equal in number)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Diagnosis:
        data = json.loads(text)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def skipped_text(skipped: int, minibatches: int) -> str:
    """``skipped 34/34: did not train`` (every minibatch skipped) or ``skipped 3/34``."""
    text = f"skipped {skipped}/{minibatches}"
    return f"{text}: did not train" if minibatches > 0 and skipped >= minibatches else text


def blame_line(diagnosis: Diagnosis) -> str:
    """The console/watch line: what, where, which term and parameter, which rows, reproduced or not."""
    d = diagnosis
    if d.heads and len(d.heads) == d.heads_total > 1:
        what = f"NaN/Inf in every head ({d.heads_total})"
    elif d.heads:
        what = ("NaN/Inf in head " if len(d.heads) == 1 else "NaN/Inf in heads ") + ",".join(d.heads)
    else:
        what = "NaN/Inf in no head's gradient"
    where = f"minibatch {d.minibatch}/{d.minibatches}" if d.minibatch is not None else "no minibatch kept"
    parts = [f"{what} (module {d.module}), {where}"]
    if d.loss_terms:
        parts.append(("loss term " if len(d.loss_terms) == 1 else "loss terms ") + ",".join(d.loss_terms))
    if d.parameter:
        parts.append(f"parameter {d.parameter}")
    line = ", ".join(parts)
    rows = d.rows or {}
    if rows.get("first_field"):
        first = rows.get("first") or {}
        origin = [f"{k} {first[k]}" for k in ("episode_id", "agent_id") if first.get(k) is not None]
        if first.get("t") is not None:
            origin.append(f"t={first['t']}")
        fields = ",".join(rows.get("fields", []))
        line += f"; {rows.get('count', 0)} rows non-finite ({fields}), first: {rows['first_field']}"
        line += (" of " + " ".join(origin)) if origin else f" row {first.get('row')}"
        if rows.get("obs_columns"):
            line += f" obs columns {rows['obs_columns'][:8]}"
        if rows.get("spread_by"):
            line += " (spread by " + "; ".join(rows["spread_by"]) + ")"
    if d.reproduced is not None:
        line += "; " + ("reproduced on re-run" if d.reproduced else "not reproduced on re-run (transient)")
    if d.skipped:
        line += "; " + skipped_text(d.skipped, d.minibatches)
    return line
