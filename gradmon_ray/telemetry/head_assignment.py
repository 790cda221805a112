"""Which gradient goes to which head of which module: the slots ``GradientNormPlan`` adds squares into.

Slots: every module's heads, module after module (``head_offsets``), then one trunk slot per
module, which takes what no head of that module takes (the shared trunk, a row-split
parameter's whole square, the rows no head claims).  Built once; the plan turns it into index
tensors per pattern of present gradients.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

import torch

from gradmon_ray.telemetry.head_norms import HeadPart, ParamRows

ModuleHeads = tuple[Mapping[str, Iterable[HeadPart]], Sequence[torch.nn.Parameter]]
"""One module's ``(head -> parts, every trainable parameter)``."""


class HeadSlots:
    """The slot of every parameter (and of every row of a row-split one) of one or more modules."""

    def __init__(self, modules: Sequence[ModuleHeads]) -> None:
        self.num_modules = len(modules)
        self.head_names: tuple[tuple[str, ...], ...] = tuple(tuple(groups) for groups, _ in modules)
        offsets = [0, *itertools.accumulate(len(names) for names in self.head_names)]
        self.head_offsets: tuple[int, ...] = tuple(offsets[:-1])
        """Where each module's heads start in the batched head vector."""
        self.trunk_base = offsets[-1]
        """Number of head slots of all modules; module ``m``'s trunk slot is ``trunk_base + m``."""
        self.num_slots = self.trunk_base + self.num_modules
        params: list[torch.nn.Parameter] = []
        whole: list[int] = []
        module_of: list[int] = []
        row_params: list[tuple[int, tuple[int, ...]]] = []
        for m, (groups, module_params) in enumerate(modules):
            trunk = self.trunk_base + m
            slot_of, rows_of = assign_slots(groups, self.head_offsets[m])
            position = {id(p): len(params) + i for i, p in enumerate(module_params)}
            if any(pid not in position for pid in [*slot_of, *rows_of]):
                raise ValueError("every head parameter must also be listed in all_params")
            for p in module_params:
                whole.append(slot_of.get(id(p), trunk))
                module_of.append(m)
            row_params.extend((position[pid], row_slots(parts, trunk)) for pid, parts in rows_of.items())
            params.extend(module_params)
        self.params: tuple[torch.nn.Parameter, ...] = tuple(params)
        self.whole: tuple[int, ...] = tuple(whole)
        """Slot of each parameter taken whole (a row-split one: its module's trunk slot)."""
        self.module_of: tuple[int, ...] = tuple(module_of)
        self.row_params: tuple[tuple[int, tuple[int, ...]], ...] = tuple(row_params)
        """(position in ``params``, the slot of each of its rows) of every row-split parameter."""

    def norm_columns(self, module: int) -> list[int]:
        """Module ``module``'s columns of a ``[..., slots]`` per-slot array (``NormRecords.stacked``'s
        ``values``): its heads, then its trunk slot (there: its global norm)."""
        start = self.head_offsets[module]
        return [*range(start, start + len(self.head_names[module])), self.trunk_base + module]

    def module_heads(self, values: torch.Tensor, module: int) -> torch.Tensor:
        """Module ``module``'s entries of a batched per-head vector (a view)."""
        start = self.head_offsets[module]
        return values[..., start : start + len(self.head_names[module])]


def assign_slots(
    groups: Mapping[str, Iterable[HeadPart]], first_slot: int = 0
) -> tuple[dict[int, int], dict[int, tuple[int, list[tuple[slice, int]]]]]:
    """(id of a whole parameter -> head slot, id of a row-split one -> (row count, [(rows, head slot)])),
    the heads numbered from ``first_slot``.

    Raises ``ValueError`` unless the heads are disjoint: a parameter in two heads, overlapping
    rows, or a parameter taken whole and by rows."""
    names = list(groups)
    slot_of: dict[int, int] = {}
    rows_of: dict[int, tuple[int, list[tuple[slice, int]]]] = {}
    shape_of: dict[int, tuple[int, ...]] = {}
    for slot, parts in enumerate(groups.values(), start=first_slot):
        for part in parts:
            if isinstance(part, ParamRows):
                rows_of.setdefault(id(part.param), (part.param.shape[0], []))[1].append((part.rows, slot))
                shape_of[id(part.param)] = tuple(part.param.shape)
            else:
                if id(part) in slot_of:
                    raise ValueError("a parameter belongs to two heads; head groups must be disjoint")
                slot_of[id(part)] = slot
    for pid, (_, parts) in rows_of.items():
        if pid in slot_of:
            raise ValueError(
                f"a parameter of shape {shape_of[pid]} is taken whole by head {names[slot_of[pid] - first_slot]!r} "
                f"and by rows by head {names[parts[0][1] - first_slot]!r}; head groups must be disjoint"
            )
        ordered = sorted(parts, key=lambda part: part[0].start)
        for (a, slot_a), (b, slot_b) in itertools.pairwise(ordered):
            if b.start < a.stop:
                raise ValueError(
                    f"rows {a.start}:{a.stop} (head {names[slot_a - first_slot]!r}) and {b.start}:{b.stop} (head "
                    f"{names[slot_b - first_slot]!r}) of a parameter of shape {shape_of[pid]} overlap; "
                    "head groups must be disjoint"
                )
    return slot_of, rows_of


def row_slots(parts: tuple[int, list[tuple[slice, int]]], trunk: int) -> tuple[int, ...]:
    """The head slot of each row of a ``(row count, [(rows, slot)])`` parameter; ``trunk`` where no head takes it."""
    slots = [trunk] * parts[0]
    for rows, slot in parts[1]:
        slots[rows] = [slot] * (rows.stop - rows.start)
    return tuple(slots)


def flat_pieces(
    slots: HeadSlots, kept: Sequence[int], targets: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """``targets`` (views shaped like ``slots.params[i]`` for ``i`` in ``kept``) cut into contiguous
    flat pieces that each go to one slot: (pieces, each one's slot, each one's module).  A whole
    parameter is one piece; a row-split one, one piece per run of rows of one slot (rows are
    contiguous in a row-major tensor)."""
    rows_of = dict(slots.row_params)
    pieces: list[torch.Tensor] = []
    piece_slot: list[int] = []
    piece_module: list[int] = []
    for i, target in zip(kept, targets, strict=True):
        flat, module = target.reshape(-1), slots.module_of[i]
        if i in rows_of:
            runs, row = _runs(rows_of[i]), flat.numel() // target.shape[0]
        else:
            runs, row = [(0, flat.numel(), slots.whole[i])], 1
        for start, stop, slot in runs:
            pieces.append(flat[start * row : stop * row])
            piece_slot.append(slot)
            piece_module.append(module)
    return pieces, piece_slot, piece_module


def _runs(row_slots: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(start, stop, slot)`` of each run of consecutive rows that go to the same slot."""
    runs, start = [], 0
    for slot, rows in itertools.groupby(row_slots):
        stop = start + len(list(rows))
        runs.append((start, stop, slot))
        start = stop
    return runs
