"""The per-module numbers of a telemetry step computed on the host copy beyond the tracker's own.

A mixin of ``GradmonReporting`` (``rllib.monitor_step``): how far each head moved
(``telemetry.param_movement``), the gradient noise scale (2+ learners: ``telemetry.noise_scale``;
one learner: ``telemetry.noise_one_learner``) and the clip that RLlib applies, read from the
learner's config.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from ray.rllib.core import ALL_MODULES
from ray.rllib.core.columns import Columns

from gradmon_ray import metric_names as mn
from gradmon_ray.distributed import ReducedIteration
from gradmon_ray.rllib.module_telemetry import ModuleTelemetry
from gradmon_ray.rllib.shared_gradients import (
    last_shared_minibatch,
    pair_cosines,
    shared_gradients,
    shared_metrics,
)
from gradmon_ray.telemetry.noise_one_learner import one_learner_noise_inputs
from gradmon_ray.telemetry.noise_scale import GLOBAL_ENTRY, noise_scale_metrics, noise_scales
from gradmon_ray.telemetry.param_movement import QUANTITIES, movement_metrics
from gradmon_ray.tracking.diagnosis_tags import SHARED_COSINES_KEY

logger = logging.getLogger(__name__)


class GradmonStepMetrics:
    """Mixin: movement, noise scale and clip of one module's step (needs ``GradmonMonitor``'s state)."""

    def _movement_metrics(self, monitor: ModuleTelemetry, reduced: ReducedIteration, summary: Any) -> dict[str, float]:
        """Update ratio, weight norm, zero-gradient fraction per head (``telemetry.param_movement``)."""
        moved = (reduced.extra or {}).get("movement")
        if moved is None:
            return {}
        index = list(self._monitors.values()).index(monitor)
        columns = self._norm_plan.slots.norm_columns(index)
        return movement_metrics(
            moved.reshape(len(QUANTITIES), -1)[:, columns],
            self._movement.numel[columns],
            monitor.head_names,
            updates=summary.minibatches - summary.skipped,
            band=(monitor.tracker.bands.update_ratio.low, monitor.tracker.bands.update_ratio.high),
            zero_counts_valid=self._zero_counts_valid,
        )

    def _shared_gradients(self) -> tuple[list[Any], Any] | None:
        """Every ``shared_gradients_every`` steps: ``(module ids, [modules, modules + 1] device values)`` of
        the step's last minibatch with two or more modules (``rllib.shared_gradients``); else None."""
        every = self.gradmon.shared_gradients_every
        if not (self.gradmon.telemetry and every > 0 and (self.gradmon_iteration + 1) % every == 0):
            return None
        batch = last_shared_minibatch(self._diagnosis.minibatches)
        if not batch:
            return None
        try:
            values = shared_gradients(self.module, batch, self.module_loss)
        except Exception:  # an observer: an analysis that fails never stops training
            logger.exception("gradmon: the shared-gradient analysis failed at step %d", self.gradmon_iteration + 1)
            return None
        return (list(batch), values) if values is not None else None

    def _shared_metrics(self, ids: list[Any], values: np.ndarray) -> dict[Any, dict[str, float]]:
        """Per module its shared-gradient norm and lowest cosine; every pair's cosine logged learner-wide."""
        values = np.asarray(values).reshape(len(ids), len(ids) + 1)
        self.metrics.log_value((ALL_MODULES, SHARED_COSINES_KEY), pair_cosines(ids, values), reduce="item_series")
        return shared_metrics(ids, values, mn.SHARED_GRAD_NORM, mn.SHARED_GRAD_COSINE_MIN)

    def _global_norm_clip(self, module_id: Any) -> float | None:
        """The module's ``grad_clip`` where RLlib clips by global norm (None: no clip, or per tensor/value)."""
        config = self.config.get_config_for_module(module_id)
        clip = getattr(config, "grad_clip", None)
        return float(clip) if clip is not None and getattr(config, "grad_clip_by", None) == "global_norm" else None

    def _noise_scale_metrics(self, monitor: ModuleTelemetry, noise: np.ndarray, minibatches: int) -> dict[str, float]:
        """B_simple per head and global from the reduced noise lanes of one step, as metrics."""
        rows = monitor.noise_hook.take_rows()
        if monitor.noise is None or monitor.module_id in self.partially_trained:
            # B_simple needs every learner's local gradient of the module; a learner without
            # the module's samples has none, so the step has no noise scale for it.
            return {}
        per_head, global_scale = noise_scales(
            monitor.noise, noise, world_size=self._collective.world_size, minibatches=minibatches, rows=rows
        )
        return noise_scale_metrics(per_head, global_scale)

    def _one_learner_noise_metrics(
        self, monitor: ModuleTelemetry, sum_sq: np.ndarray, norms: np.ndarray | None
    ) -> dict[str, float]:
        """B_simple with one learner (``telemetry.noise_one_learner``): the first epoch's minibatches."""
        added, monitor.epoch_sum.minibatches = monitor.epoch_sum.minibatches, []
        kept = self._diagnosis.minibatches.get(monitor.module_id) or []
        rows = {index: int(batch[Columns.OBS].shape[0]) for index, _, batch in kept if Columns.OBS in batch}
        inputs = (
            one_learner_noise_inputs(sum_sq, norms, added, rows.get(added[0], 0))
            if norms is not None and added
            else None
        )
        if inputs is None:
            return {}
        scales = monitor.noise.update(*(list(x) if isinstance(x, np.ndarray) else x for x in inputs))
        defined = {name: value for name, value in scales.items() if np.isfinite(value)}
        return noise_scale_metrics(defined, defined.pop(GLOBAL_ENTRY, None))
