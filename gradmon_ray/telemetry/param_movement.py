"""How far each head moved in a telemetry step, and how many of its gradient elements were exactly zero.

Per head and per module, once per step (never per minibatch): ``|theta_after - theta_before|``,
``|theta_before|``, ``|theta_after|`` and the number of exactly-zero elements of the step's last
gradient (units that pass no gradient: a ReLU that never fires, an embedding row never used).
The update-to-weight ratio ``|delta| / |theta_before|`` is the rule of thumb of CS231n (Karpathy,
"Neural Networks Part 3", section "Ratio of weights:updates"): about 1e-3 per update; much lower,
the learning rate is likely too low; much higher, too high (docs/metrics.md).

One copy of the monitored parameters a step: the step's end copy is the next step's start
(two flat buffers, swapped).  Eight ops a step whatever the number of modules, tensors and heads:
the parameters' multi-tensor copy, the difference, the gradients' multi-tensor copy, their
zero marks, ONE multi-tensor norm over every head's piece of the four buffers, then one stack,
square and ``index_add`` into ``[4, slots]`` (the norm plan's slots: heads, then each module's
total).  Squares of 0/1 marks sum to the count.  Nothing reads the host: the result rides the
step's one host copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gradmon_ray import compat
from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.head_assignment import HeadSlots, flat_pieces

QUANTITIES = ("before", "delta", "after", "zero_grads")
"""The rows of ``ParameterMovement.measure``'s ``[4, slots]`` result (sums of squares; counts)."""


class ParameterMovement:
    """The step's parameter movement of every monitored module (see the module docstring)."""

    def __init__(self, slots: HeadSlots) -> None:
        self.slots = slots
        params = list(slots.params)
        self.params = params
        device = params[0].device if params else torch.device("cpu")
        sizes = [p.numel() for p in params]
        n = sum(sizes)
        self._start, self._end, delta, grads, zeros = (torch.zeros(n, device=device) for _ in range(5))
        views = lambda flat: [v.view(p.shape) for v, p in zip(flat.split(sizes), params, strict=True)]  # noqa: E731
        self._views = {"start": views(self._start), "end": views(self._end), "grads": views(grads)}
        self._delta, self._grads, self._zeros = delta, grads, zeros
        h, m = slots.trunk_base, slots.num_modules
        self.width = h + m
        cut = lambda flat: flat_pieces(slots, range(len(params)), views(flat))  # noqa: E731 (same cut for each buffer)
        # Per buffer order [start, delta, end, zeros]: each piece to its head slot, every piece to its module's total.
        self._zero_pieces, piece_slot, piece_module = cut(zeros)
        head_pieces = [k for k, slot in enumerate(piece_slot) if slot < h]
        self._order = [*head_pieces, *range(len(piece_slot))]
        destinations = [*(piece_slot[k] for k in head_pieces), *(h + module for module in piece_module)]
        self._index = torch.tensor(
            [q * self.width + d for q in range(len(QUANTITIES)) for d in destinations], dtype=torch.long, device=device
        )
        self._base = torch.zeros(len(QUANTITIES) * self.width, device=device)
        numel = np.zeros(self.width)
        for piece, slot, module in zip(self._zero_pieces, piece_slot, piece_module, strict=True):
            numel[h + module] += piece.numel()
            if slot < h:
                numel[slot] += piece.numel()
        self.numel = numel
        """Elements per slot (host): the denominators of the zero-gradient fractions."""
        self._pieces = {"start": cut(self._start)[0], "end": cut(self._end)[0]}
        self._delta_pieces = cut(delta)[0]
        self.primed = False

    def prime(self) -> None:
        """Copy the parameters as the next step's start (at build, after a restore or a module change)."""
        if self.params:
            with torch.no_grad():
                compat.foreach_copy_(self._views["start"], self.params)
        self.primed = True

    def measure(self) -> tuple[torch.Tensor, bool] | None:
        """``[4 x slots]`` flat sums of squares (start, delta, end) and zero-gradient counts, and
        whether every parameter had a gradient (the counts mean nothing otherwise); the end copy
        becomes the next step's start.  None before ``prime``."""
        if not self.primed or not self.params:
            return None
        with torch.no_grad():
            compat.foreach_copy_(self._views["end"], self.params)  # under no_grad: no detach (an op a tensor)
            torch.sub(self._end, self._start, out=self._delta)
            grads = [p.grad for p in self.params]
            complete = all(g is not None for g in grads)
            if complete:
                compat.foreach_copy_(self._views["grads"], grads)
                torch.eq(self._grads, 0.0, out=self._zeros)
            normed = [*self._pieces["start"], *self._delta_pieces, *self._pieces["end"], *self._zero_pieces]
            norms = compat.foreach_norm(normed)
            count = len(self._delta_pieces)
            values = torch.stack([norms[q * count + k] for q in range(len(QUANTITIES)) for k in self._order])
            out = torch.index_add(self._base, 0, self._index, values * values)
        self._start, self._end = self._end, self._start  # the end is the next step's start: no copy
        self._views["start"], self._views["end"] = self._views["end"], self._views["start"]
        self._pieces["start"], self._pieces["end"] = self._pieces["end"], self._pieces["start"]
        return out, complete


def movement_metrics(
    values: np.ndarray,
    numel: np.ndarray,
    heads: Sequence[str],
    *,
    updates: int,
    band: tuple[float, float],
    zero_counts_valid: bool = True,
) -> dict[str, float]:
    """Per head the update ratio, parameter norm, zero-gradient fraction and the ratio's band code;
    ``values``: ``[4, heads + 1]`` (the module's columns of ``measure``, its total last), ``numel``
    likewise; ``updates``: minibatch updates the step took (the band judges the ratio per update)."""
    start, delta, end, zeros = (np.asarray(v, dtype=np.float64) for v in values)
    out: dict[str, float] = {}
    low, high = band
    for j, head in enumerate([*heads, None]):
        if start[j] <= 0 or numel[j] <= 0:
            continue  # no weights (or all zero): no ratio
        ratio = float(np.sqrt(delta[j]) / np.sqrt(start[j]))
        if head is None:  # the module's total
            out[mn.UPDATE_RATIO] = ratio
            continue
        out[mn.head_metric(mn.HEAD_UPDATE_RATIO, head)] = ratio
        out[mn.head_metric(mn.HEAD_PARAM_NORM, head)] = float(np.sqrt(end[j]))
        if zero_counts_valid:
            out[mn.head_metric(mn.HEAD_ZERO_GRAD_FRACTION, head)] = float(np.round(zeros[j]) / numel[j])
        if updates > 0:
            per_update = ratio / updates
            out[mn.head_metric(mn.HEAD_UPDATE_BAND, head)] = float(
                -1 if per_update < low else 1 if per_update > high else 0
            )
    return out


def module_columns(values: np.ndarray, width: int, columns: Sequence[int]) -> np.ndarray:
    """A module's ``[4, heads + 1]`` share of ``measure``'s flat result (copied to the host)."""
    return np.asarray(values).reshape(len(QUANTITIES), width)[:, list(columns)]


def numel_columns(numel: np.ndarray, columns: Sequence[int]) -> np.ndarray:
    return np.asarray(numel)[list(columns)]
