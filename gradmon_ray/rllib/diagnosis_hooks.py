"""``GradmonDiagnosis``: the learner's side of the blame for a non-finite event (``rllib.diagnosis``).

A mixin of ``GradmonMonitor``: it keeps the references a diagnosis needs (the train batch's columns
once per update, each module's minibatch once per minibatch: no kernel), installs ``RowOrigins`` in
the learner connector, and at the drain turns an event into a ``Diagnosis`` logged under the module
(``telemetry.blame.RESULT_KEY``, RLlib's ``item_series``: not reduced, one per learner).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.learner import Learner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger
from ray.rllib.utils.typing import ModuleID

from gradmon_ray import compat
from gradmon_ray import metric_names as mn
from gradmon_ray.rllib.diagnosis import DiagnosisInputs, diagnose_module, event_in
from gradmon_ray.rllib.module_telemetry import ModuleTelemetry
from gradmon_ray.rllib.row_origins import install_row_origins
from gradmon_ray.telemetry.blame import RESULT_KEY
from gradmon_ray.telemetry.tracker import IterationTelemetry

logger = logging.getLogger(__name__)


class GradmonDiagnosis(compat.TrainBatchHook):
    """Mixin: keep what a diagnosis needs, by reference; diagnose a module's event at the drain."""

    def _setup_diagnosis(self) -> None:
        """After RLlib's build (the learner connector exists)."""
        origins = install_row_origins(compat.learner_connector(self))
        self._diagnosis = DiagnosisInputs(origins=origins)

    @override(compat.TrainBatchHook)
    def on_train_batch(self, batch: Any) -> None:
        super().on_train_batch(batch)
        if batch is not None and self.gradmon.telemetry:
            self._diagnosis.keep_train_batch(batch)

    def keep_minibatch(self, module_id: ModuleID, batch: Mapping[str, Any]) -> None:
        """A reference to module ``module_id``'s minibatch, indexed like the step's norm records."""
        self._diagnosis.keep_minibatch(module_id, len(self._norm_records), batch)

    def in_first_epoch(self, module_id: ModuleID) -> bool:
        """Whether module ``module_id``'s current minibatch is within the update's first pass over its
        train batch (``floor(rows / minibatch rows)`` minibatches: disjoint samples); from the kept
        references' shapes, no host read."""
        kept = self._diagnosis.minibatches.get(module_id)
        train = self._diagnosis.train_columns.get(module_id)
        if not kept or kept[-1][0] != len(self._norm_records) or train is None:
            return False
        update = kept[-1][1]
        if update != self._diagnosis.updates:
            return False
        rows, minibatch_rows = _rows(train), _rows(kept[-1][2])
        position = sum(1 for entry in kept if entry[1] == update)
        return rows > 0 and minibatch_rows > 0 and position <= rows // minibatch_rows

    def module_loss(self, module_id: ModuleID, batch: Mapping[str, Any], fwd_out: Mapping[str, Any]) -> torch.Tensor:
        """Module ``module_id``'s training loss on ``batch`` without gradmon's per-minibatch recording
        (the shared-gradient analysis); here the wrapped learner's own, its metrics thrown away."""
        config = self.config.get_config_for_module(module_id)
        saved, self.metrics = self.metrics, MetricsLogger()
        try:
            return super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)
        finally:
            self.metrics = saved

    def diagnosis_loss_terms(
        self, module_id: ModuleID, module: Any, batch: Mapping[str, Any], fwd_out: Mapping[str, Any]
    ) -> dict[str, torch.Tensor] | None:
        """The loss of ``module`` (a copy) on ``batch``, term by term, for the re-run; a subclass
        with its own loss splits it (``GradmonPPOTorchLearner``).  Here: the wrapped learner's
        own ``compute_loss_for_module`` as one ``total`` term, its metrics logged into a
        throw-away logger (the real ones stay the training's)."""
        if not isinstance(self, Learner):
            return None
        return {"total": GradmonDiagnosis.module_loss(self, module_id, batch, fwd_out)}

    def _diagnose(
        self, monitor: ModuleTelemetry, summary: IterationTelemetry, norms: np.ndarray | None
    ) -> dict[str, float]:
        """An event of ``monitor``'s module this step: its ``Diagnosis`` logged, its numbers returned."""
        if not event_in(summary):
            return {}
        module_id = monitor.module_id
        try:
            diagnosis = diagnose_module(
                module_id=module_id,
                rl_module=monitor.rl_module,
                groups=monitor.groups,
                head_names=monitor.head_names,
                summary=summary,
                norms=norms,
                inputs=self._diagnosis,
                loss_terms=lambda module, batch, fwd: self.diagnosis_loss_terms(module_id, module, batch, fwd),
                rank=self._collective.rank,
            )
        except Exception:  # an observer: a diagnosis that fails never stops training
            logger.exception("gradmon: the diagnosis of module %s at iteration %d failed", module_id, summary.iteration)
            return {}
        self.metrics.log_value((module_id, RESULT_KEY), diagnosis.to_json(), reduce="item_series")
        out = {mn.DIAGNOSIS_MINIBATCH: float(diagnosis.minibatch)} if diagnosis.minibatch is not None else {}
        if diagnosis.reproduced is not None:
            out[mn.DIAGNOSIS_REPRODUCED] = float(diagnosis.reproduced)
        return out

    def _forget_diagnosis_inputs(self) -> None:
        """End of the step: the kept minibatches go (the train batch stays until the next update)."""
        self._diagnosis.clear()


def _rows(columns: Mapping[str, Any]) -> int:
    """Rows of a batch's columns (its observations' first dimension: host metadata, no kernel)."""
    obs = columns.get(Columns.OBS)
    return int(obs.shape[0]) if isinstance(obs, torch.Tensor) else 0
