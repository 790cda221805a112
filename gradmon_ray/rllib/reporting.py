"""Once per telemetry step: the packed reduction, the host copy, RLlib metrics; gradmon's state.

``GradmonReporting`` is the second half of ``gradmon_ray.rllib.monitor.GradmonMonitor`` (the
first half runs per minibatch).  See that module's docstring for what one step is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from ray.rllib.core.learner.learner import Learner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import StateDict

from gradmon_ray import metric_names as mn
from gradmon_ray.distributed import ReplicaDivergenceError, Segments, parameter_checksum, reduce_iteration
from gradmon_ray.rllib import compat
from gradmon_ray.rllib.metrics_stats import log_step_metrics
from gradmon_ray.telemetry.noise_scale import noise_scales
from gradmon_ray.telemetry.state_digest import state_digest

TELEMETRY_STATE_KEY = "gradmon_telemetry"
"""Key of the telemetry state (latches, prev values, counters, the clock) in ``Learner.get_state()``."""
VGS_STATE_KEY = "gradmon_vgs"
"""Key of the Variance Gradient Scaler's state inside ``Learner.get_state()``."""
NOISE_STATE_KEY = "gradmon_noise_scale"
"""Key of the gradient-noise-scale EMAs inside ``Learner.get_state()`` (2+ learners)."""
PROBE_STATE_KEY = "gradmon_probe"
"""Key of the probe bookkeeping (iteration count, probe counters) inside ``Learner.get_state()``."""
GRADMON_STATE_KEYS = (TELEMETRY_STATE_KEY, VGS_STATE_KEY, NOISE_STATE_KEY, PROBE_STATE_KEY)
"""Everything gradmon adds to the learner's checkpointed state."""


class GradmonReporting:
    """Mixin: the per-step report and the checkpointed state (needs ``GradmonMonitor.build``)."""

    # --- once per telemetry step -------------------------------------------------------
    @override(Learner)
    def after_gradient_based_update(self, *, timesteps: dict[str, Any]) -> None:
        super().after_gradient_based_update(timesteps=timesteps)
        self._updates_since_report += 1
        if self._updates_since_report >= self._report_every:
            self._updates_since_report = 0
            self._report()

    @property
    def gradmon_iteration(self) -> int:
        """Telemetry steps completed: THE gradmon clock (latches, probe, faults, checksums use it)."""
        return self._tracker.iteration

    def gradmon_extra_metrics(self) -> dict[str, float]:
        """Metrics a subclass adds to the step (called before the clock advances)."""
        return {}

    def _report(self) -> None:
        metrics = dict(self.gradmon_extra_metrics())
        if not self.gradmon.telemetry and self._vgs is None:
            self._tracker.skip_iteration()
            self._log_gradmon_metrics(metrics)
            return
        lanes, checksum_ok = self._reduce_step()
        if self.gradmon.telemetry:
            health = lanes["health"] if self._head_health.enabled else None
            summary = self.last_telemetry = self._tracker.finish_iteration(lanes["telemetry"], health)
            metrics.update(summary.to_metrics())
            metrics.update(self._noise_scale_metrics(lanes["noise"], summary.minibatches))
        else:
            self._tracker.skip_iteration()
        if self._vgs is not None:
            metrics.update(zip(mn.VGS_DEVICE_METRICS, lanes["vgs"].tolist(), strict=True))
            metrics.update(self._vgs.host_metrics())
        if self._grad_scaler is not None:
            metrics[mn.SCALER_SKIPPED_UPDATES], metrics[mn.GRAD_SCALE] = (float(v) for v in lanes["scaler"])
        if checksum_ok is not None:
            metrics[mn.REPLICA_CHECKSUM_OK] = float(checksum_ok)
        self._log_gradmon_metrics(metrics)
        if checksum_ok is False:
            raise ReplicaDivergenceError(
                f"learner replicas hold different parameters after iteration {self.gradmon_iteration} "
                f"(detected on rank {self._collective.rank} of {self._collective.world_size}); "
                "the run cannot be trusted: restore the last checkpoint"
            )

    def _noise_scale_metrics(self, noise: np.ndarray, minibatches: int) -> dict[str, float]:
        """B_simple per head and global from the reduced noise lanes of one step, as metrics."""
        rows = self._noise_hook.take_rows()
        if self._noise is None:
            return {}
        per_head, global_scale = noise_scales(
            self._noise, noise, world_size=self._collective.world_size, minibatches=minibatches, rows=rows
        )
        return mn.noise_scale_metrics(per_head, global_scale)

    def _log_gradmon_metrics(self, metrics: dict[str, float]) -> None:
        log_step_metrics(self.metrics, self._module_id, metrics)

    def _reduce_step(self) -> tuple[dict[str, np.ndarray], bool | None]:
        """Pack, reduce ONCE across learners, copy to the host ONCE; then unpack by segment name.

        Reduced: the telemetry lanes, the checksum digits (zeros unless this is a check step),
        the noise-scale lanes and the policy head-health lanes (``rllib.head_health``; computed
        here, once per step, from the step's last minibatch).  Local (identical on every replica, or rank-local): the
        scaler lanes, the VGS metrics and this rank's own checksum digits.
        """
        collective = self._collective
        every = self.gradmon.replica_check_every
        check = collective.active and every > 0 and (self.gradmon_iteration + 1) % every == 0
        digits = (
            parameter_checksum(list(self._norm_plan.params)).to(self.device)
            if check
            else torch.zeros(2, dtype=torch.float64, device=self.device)
        )
        scaler_lanes = self._minibatch_step.scaler_lanes
        empty = scaler_lanes[:0]
        local = Segments(
            {
                "scaler": scaler_lanes if self._grad_scaler is not None else empty,
                "vgs": self._vgs.metrics_tensor() if self._vgs is not None else empty,
                "checksum": digits,
            }
        )
        health = self._head_health.lanes() if self.gradmon.telemetry else empty
        reduced = reduce_iteration(
            self._accumulator,
            collective,
            checksum=digits,
            noise=self._noise_hook.lanes,
            local=local.pack(),
            health=health,
        )
        scaler_lanes[0].zero_()
        self._noise_hook.zero_()
        parts = local.unpack(reduced.local)
        k = collective.world_size
        checksum_ok = bool(np.array_equal(reduced.checksum, k * parts["checksum"])) if check else None
        return {"telemetry": reduced.lanes, "noise": reduced.noise, "health": reduced.health, **parts}, checksum_ok

    def telemetry_state(self) -> dict[str, Any]:
        """The persistent telemetry state (latches, prev values, counters)."""
        return self._tracker.state_dict()

    def gradmon_state_digest(self) -> str:
        """SHA-256 of this learner's gradmon state (latches, prev values, counters, VGS, noise, probe)."""
        state = self.get_state(components=list(GRADMON_STATE_KEYS))
        return state_digest({k: v for k, v in state.items() if k in GRADMON_STATE_KEYS})

    @override(Learner)
    def get_state(self, components: Any = None, *, not_components: Any = None, **kwargs: Any) -> StateDict:
        state = super().get_state(components, not_components=not_components, **kwargs)
        wanted = [
            (TELEMETRY_STATE_KEY, self._tracker),
            (NOISE_STATE_KEY, self._noise),
            (VGS_STATE_KEY, self._vgs),
        ]
        for key, part in wanted:
            if part is not None and compat.wants_component(self, key, components, not_components):
                state[key] = part.state_dict()
        return state

    @override(Learner)
    def set_state(self, state: StateDict) -> None:
        super().set_state(state)
        if TELEMETRY_STATE_KEY in state:
            self._tracker.load_state_dict(state[TELEMETRY_STATE_KEY])
        if NOISE_STATE_KEY in state and self._noise is not None:
            self._noise.load_state_dict(state[NOISE_STATE_KEY])
        if VGS_STATE_KEY in state and self._vgs is not None:
            self._vgs.load_state_dict(state[VGS_STATE_KEY])
