"""Modules added and removed mid-run (self-play snapshots, leagues): monitored from their first update.

RLlib's ``Algorithm.add_module`` / ``remove_module`` call ``Learner.add_module`` /
``remove_module`` on every learner.  ``ModuleChanges`` (a mixin of ``GradmonMonitor``) then
makes the learner's modules distributed again (``rllib.module_sync``: with 2+ learners the new
module gets its share of the gradient average and rank 0's weights, never RLlib's WORLD-group
DDP) and gives a monitored new module its telemetry (heads, bands, latches, its clock at the
learner's, its state in checkpoints); a removed module's telemetry and state go with it.  The
norm pass is rebuilt for the new set of modules, and the step's pending norm records (with
``report_every`` > 1 a step spans several updates) are carried into it: every other module keeps
the minibatches it trained before the change (its counts, norms and latches of the step); only the
removed module's go, and an added module has none from before it existed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import ModuleID

from gradmon_ray.distributed.agreement import within_deadline
from gradmon_ray.head_labels import check_name
from gradmon_ray.rllib.module_sync import SparseSafeModuleSync
from gradmon_ray.rllib.module_telemetry import resolve_module
from gradmon_ray.telemetry.head_assignment import HeadSlots
from gradmon_ray.telemetry.norm_plan import PackedNorms

logger = logging.getLogger(__name__)


class ModuleChanges:
    """Mixin of ``GradmonMonitor`` (needs its ``_monitors``, ``_wants``, ``_monitor_of``, ``_attach``)."""

    @override(TorchLearner)
    def add_module(self, *, module_id: ModuleID, module_spec: Any, **kwargs: Any) -> Any:
        """RLlib's ``add_module``, then: the module distributed like the others (its own share of
        the gradient average with 2+ learners) and, if monitored, its telemetry from its first
        update on (heads, bands, latches; its clock at the learner's; its state in checkpoints)."""
        if self._wants(module_id):  # before RLlib adds it; RLlib's own check lets "a b" and "a,b" through
            check_name(module_id, "added module id")
        before = self._norm_pass_state()
        add = super().add_module  # with 2+ learners RLlib wraps the module in DDP: a collective
        what = f"add_module({module_id!r}) to reach every learner (RLlib's DDP wrapping of the module is a collective)"
        spec = within_deadline(
            lambda: add(module_id=module_id, module_spec=module_spec, **kwargs), self.gradmon.collective_timeout_s, what
        )
        self.arrange_gradient_average()
        if self._wants(module_id) and isinstance(self.module[module_id], torch.nn.Module):
            rl_module = self.module[module_id].unwrapped()
            monitor = self._monitor_of(
                resolve_module(module_id, rl_module, self.gradmon, self.latch_heads_of(rl_module))
            )
            monitor.tracker.iteration = self.gradmon_iteration  # every module's clock advances together
            self._monitors[module_id] = monitor
            self._monitors = {mid: self._monitors[mid] for mid in self.module.keys() if mid in self._monitors}  # noqa: SIM118
            self._attach(module_id, monitor)
        self.note_module_seen(module_id)
        self._setup_norm_pass()
        self._carry_norm_records(*before)
        return spec

    @override(TorchLearner)
    def remove_module(self, module_id: ModuleID, **kwargs: Any) -> Any:
        """RLlib's ``remove_module``; the module's telemetry and state go with it (the other modules
        keep their records of the step)."""
        before = self._norm_pass_state()
        spec = super().remove_module(module_id, **kwargs)
        monitor = self._monitors.pop(module_id, None)
        if monitor is not None:
            monitor.noise_hook.remove()
        self.arrange_gradient_average()
        self._setup_norm_pass()
        self._carry_norm_records(*before)
        return spec

    def _norm_pass_state(self) -> tuple[list[ModuleID], HeadSlots, tuple[PackedNorms, ...]]:
        """The monitored modules, their slots and the step's pending records, before a change."""
        return list(self._monitors), self._norm_plan.slots, self._norm_records.records

    def _carry_norm_records(self, ids: list[ModuleID], slots: HeadSlots, records: tuple[PackedNorms, ...]) -> None:
        """The step's records so far, re-laid out for the new set of modules (module ``ids`` had ``slots``)."""
        if not records or not self._monitors or not self.gradmon.telemetry:
            return
        new = self._norm_plan.slots
        for row in carried_records(records, slots, ids, new, list(self._monitors)):
            self._norm_records.add(PackedNorms(row, (), new.trunk_base))

    def note_module_seen(self, module_id: ModuleID) -> None:
        """Remember that the learner had module ``module_id`` (for ``warn_unseen_modules``)."""
        self._seen_modules.add(str(module_id))

    def warn_unseen_modules(self) -> None:
        """Once, at the first telemetry step, on rank 0: one line naming every configured module id or
        pattern (``modules``, ``per_module``, ``probe.modules``) that no module of this learner has
        matched so far: a typo, or a module a league has not added yet (not an error)."""
        if getattr(self, "_unseen_warned", True):
            return
        self._unseen_warned = True
        note = self.gradmon.unseen_note(self._seen_modules)
        if note is not None and (not dist.is_initialized() or dist.get_rank() == 0):  # one line, not one a learner
            logger.warning(note)

    @override(SparseSafeModuleSync)
    def _local_gradients(self, index: int, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        monitor = self._monitors.get(self._synced_module_ids[index])
        if monitor is not None and monitor.noise is not None:
            monitor.noise_hook.add_local(params, grads)  # the noise scale's local squares, before the average


def carried_records(
    records: tuple[PackedNorms, ...],
    old: HeadSlots,
    old_ids: list[ModuleID],
    new: HeadSlots,
    new_ids: list[ModuleID],
) -> list[torch.Tensor]:
    """``records`` (of modules ``old_ids``, laid out by ``old``) as rows laid out by ``new`` for
    ``new_ids``: a kept module's columns moved to its new place, a removed one's dropped, a new one's
    filled as "no gradient in that minibatch" (NaN squares, zero counts: not trained there, as a
    module whose agents were not in the minibatch).  One gather, once per module change."""
    packed = torch.stack([r.packed for r in records])  # [minibatches, heads + 3 * modules]
    width, m = packed.shape[1], old.num_modules
    nan_col, zero_col = width, width + 1
    filler = packed.new_tensor([float("nan"), 0.0]).expand(packed.shape[0], 2)
    at = {mid: j for j, mid in enumerate(old_ids)}
    index: list[int] = []
    for k, mid in enumerate(new_ids):  # each module's head squares
        j, count = at.get(mid), len(new.head_names[k])
        index += [nan_col] * count if j is None else list(range(old.head_offsets[j], old.head_offsets[j] + count))
    for block, fill in ((0, nan_col), (1, zero_col), (2, zero_col)):  # global squares, non-finite, NaN counts
        index += [fill if mid not in at else old.trunk_base + block * m + at[mid] for mid in new_ids]
    columns = torch.tensor(index, dtype=torch.long, device=packed.device)
    return list(torch.cat([packed, filler], dim=1).index_select(1, columns).unbind(0))


def states_by_module(parts: Mapping[str, Any], monitors: Mapping[ModuleID, Any]) -> dict[str, dict[ModuleID, Any]]:
    """Per checkpointed part (``{state key: value}``), ``{module_id: state}`` of the ``monitors`` the
    value holds.  A checkpoint may hold other modules than this learner monitors (one removed since,
    ``modules`` narrowed on resume, one added since): those both have are returned, the checkpoint's
    others are left out (one log line names them).  A state written before multi-agent support (one
    module's state, not keyed by module: some of its values are not mappings) belongs to the one
    monitored module."""
    out: dict[str, dict[ModuleID, Any]] = {}
    ignored: set[str] = set()
    for key, value in parts.items():
        if value and all(isinstance(v, Mapping) for v in value.values()):  # keyed by module id
            ignored.update(str(mid) for mid in value if mid not in monitors)
            out[key] = {mid: v for mid, v in value.items() if mid in monitors}
        elif len(monitors) == 1:
            out[key] = {next(iter(monitors)): value}
        else:
            raise ValueError(
                f"checkpointed gradmon state is keyed {sorted(value)}, not by the modules {list(monitors)}"
            )
    if ignored:
        logger.warning(
            "gradmon: the restored state holds gradmon state of module(s) %s that this learner does not monitor "
            "(removed, or not in gradmon's modules): not loaded",
            sorted(ignored),
        )
    return out


def align_clocks(monitors: Mapping[ModuleID, Any], loaded: Mapping[ModuleID, Any]) -> None:
    """The monitored modules without restored telemetry (``loaded``: those with) start fresh, their
    clock at the restored one: every module's clock advances together (``gradmon_iteration``)."""
    if loaded:
        clock = max(monitors[mid].tracker.iteration for mid in loaded)
        for mid, monitor in monitors.items():
            if mid not in loaded:
                monitor.tracker.iteration = clock
