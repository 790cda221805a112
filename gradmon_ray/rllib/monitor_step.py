"""Once per telemetry step: the packed reduction, the host copy, RLlib metrics; gradmon's state.

``GradmonReporting`` is the second half of ``gradmon_ray.rllib.monitor.GradmonMonitor`` (the
first half runs per minibatch).  See that module's docstring for what one step is.
"""

from __future__ import annotations

from typing import Any

import torch
from ray.rllib.core import ALL_MODULES
from ray.rllib.core.learner.learner import Learner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import StateDict

from gradmon_ray import compat
from gradmon_ray import metric_names as mn
from gradmon_ray.distributed import (
    ModuleLanes,
    ReducedIteration,
    ReplicaDivergenceError,
    Segments,
    parameter_checksum,
    reduce_modules,
)
from gradmon_ray.rllib.metrics_stats import log_step_metrics
from gradmon_ray.rllib.module_changes import align_clocks, states_by_module
from gradmon_ray.rllib.module_groups import health_blocks, latch_flag_blocks
from gradmon_ray.rllib.module_telemetry import ModuleTelemetry
from gradmon_ray.rllib.step_metrics import GradmonStepMetrics
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


class GradmonReporting(GradmonStepMetrics):
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
        """Telemetry steps completed: THE gradmon clock (latches, probe, faults, checksums use it).

        Every monitored module's tracker advances together, once per step."""
        for monitor in self._monitors.values():
            return monitor.tracker.iteration
        return 0

    def gradmon_extra_metrics(self) -> dict[str, float]:
        """Learner-wide metrics a subclass adds to the step (the probe counters), logged once per
        learner under RLlib's ``ALL_MODULES`` key, never under a module (called before the clock advances)."""
        return {}

    def _report(self) -> None:
        self.warn_unseen_modules()
        metrics: dict[Any, dict[str, float]] = {mid: {} for mid in self._monitors}
        extra = dict(self.gradmon_extra_metrics())
        if extra:  # not a module's: which module is "first" is RLlib's set order, and it can be removed
            metrics[ALL_MODULES] = extra
        vgs_on = any(m.vgs is not None for m in self._monitors.values())
        if not self.gradmon.telemetry and not vgs_on:
            for monitor in self._monitors.values():
                monitor.tracker.skip_iteration()
            self._log_gradmon_metrics(metrics)
            self._forget_diagnosis_inputs()
            return
        reduced, checksum_ok = self._reduce_step()
        for module_id, monitor in self._monitors.items():
            metrics[module_id].update(self._module_metrics(monitor, reduced[module_id]))
            if checksum_ok is not None:
                metrics[module_id][mn.REPLICA_CHECKSUM_OK] = float(checksum_ok[module_id])
        extra = next(iter(reduced.values())).extra if reduced else None
        if extra and "shared" in extra:
            for module_id, values in self._shared_metrics(self._shared_ids, extra["shared"]).items():
                metrics.setdefault(module_id, {}).update(values)
        self._log_gradmon_metrics(metrics)
        self._forget_diagnosis_inputs()
        self.partially_trained.clear()
        diverged = [mid for mid, ok in (checksum_ok or {}).items() if not ok]
        if diverged:
            raise ReplicaDivergenceError(
                f"learner replicas hold different parameters of module(s) {diverged} after iteration "
                f"{self.gradmon_iteration} (detected on rank {self._collective.rank} of "
                f"{self._collective.world_size}); the run cannot be trusted: restore the last checkpoint"
            )

    def _module_metrics(self, monitor: ModuleTelemetry, reduced: ReducedIteration) -> dict[str, float]:
        """One module's metrics of this step, from its share of the reduced host copy."""
        metrics: dict[str, float] = {}
        local = _local_segments(monitor).unpack(reduced.local)
        if self.gradmon.telemetry and reduced.lanes[monitor.tracker.layout.minibatches] == 0:
            # No learner trained the module in this step (its agents were in no shard, or it is
            # not in policies_to_train): nothing to report, not even "missing" norms.
            monitor.tracker.skip_iteration()
            monitor.noise_hook.take_rows()
            return metrics
        if self.gradmon.telemetry:
            health = reduced.health if monitor.head_health.enabled else None
            summary = monitor.last_telemetry = monitor.tracker.finish_iteration(
                reduced.lanes,
                health,
                minibatch_norms=reduced.minibatch_norms,
                grad_clip=self._global_norm_clip(monitor.module_id),
            )
            metrics.update(summary.to_metrics())
            if monitor.epoch_sum is not None:
                metrics.update(self._one_learner_noise_metrics(monitor, local["epoch_sum"], reduced.minibatch_norms))
            else:
                metrics.update(self._noise_scale_metrics(monitor, reduced.noise, summary.minibatches))
            metrics.update(self._diagnose(monitor, summary, reduced.minibatch_norms))
            metrics.update(self._movement_metrics(monitor, reduced, summary))
        else:
            monitor.tracker.skip_iteration()
        if monitor.vgs is not None:
            metrics.update(zip(mn.VGS_DEVICE_METRICS, local["vgs"].tolist(), strict=True))
            metrics.update(monitor.vgs.host_metrics())
        if monitor.grad_scaler is not None:
            metrics[mn.SCALER_SKIPPED_UPDATES], metrics[mn.GRAD_SCALE] = (float(v) for v in local["scaler"])
        return metrics

    def _log_gradmon_metrics(self, metrics: dict[Any, dict[str, float]]) -> None:
        for module_id, values in metrics.items():
            log_step_metrics(self.metrics, module_id, values)

    def _reduce_step(self) -> tuple[dict[Any, ReducedIteration], dict[Any, bool] | None]:
        """Pack every module's lanes, reduce ONCE across learners, copy to the host ONCE.

        Reduced: the telemetry lanes, the checksum digits (zeros unless this is a check step;
        one checksum per module; the second value returned: per module, whether the replicas
        agree), the noise-scale lanes and the policy head-health lanes (``rllib.head_health``;
        computed here, once per step, from the step's last minibatch).  Local (identical on every
        replica, or rank-local): the scaler lanes, the VGS metrics and this rank's own checksum
        digits.
        """
        collective = self._collective
        every = self.gradmon.replica_check_every
        check = collective.active and every > 0 and (self.gradmon_iteration + 1) % every == 0
        # One checksum per module (two float64 digits each): a divergence names its module.
        digits = (
            torch.cat([parameter_checksum(list(m.params)).to(self.device) for m in self._monitors.values()])
            if check and self._monitors
            else self._no_checksum()
        )
        monitors = list(self._monitors.values())
        # Modules with the same action distribution: one latch and one head-health pass each group.
        flags = latch_flag_blocks(monitors)
        health = health_blocks(monitors) if self.gradmon.telemetry else []
        stacked = self._norm_records.stacked()
        lanes = self._lane_fold.fold(stacked, flags)  # every module's lanes at once
        self._norm_records.clear()
        slots = self._norm_plan.slots
        for monitor in monitors:  # one learner's noise scale: the first epoch's summed gradients, per head
            if monitor.epoch_sum is not None:
                monitor.epoch_sum_lanes = monitor.epoch_sum.drain()
        parts = [
            ModuleLanes(m.tracker.layout, m.noise_hook.lanes, _local_segments(m).pack(), slots.norm_columns(k))
            for k, m in enumerate(monitors)
        ]
        # Every minibatch's norms ride the copy too: the iteration's max, p95 and clip fraction.
        norms = stacked.values if stacked is not None and self.gradmon.telemetry else None
        moved = self._movement.measure() if self.gradmon.telemetry else None  # how far each head went
        self._zero_counts_valid = moved is not None and moved[1]
        extra = {"movement": moved[0]} if moved is not None else {}
        shared = self._shared_gradients()  # every shared_gradients_every steps, with shared parameters
        if shared is not None:
            self._shared_ids, extra["shared"] = shared
        reduced = reduce_modules(
            lanes,
            parts,
            collective,
            checksum=digits,
            health=health,
            minibatch_norms=norms,
            extra=extra,
        )
        for monitor in self._monitors.values():  # only lanes in use were written (two ops a module saved)
            if monitor.grad_scaler is not None:
                monitor.scaler_lanes[0].zero_()
            if monitor.noise is not None:
                monitor.noise_hook.zero_()
        k = collective.world_size
        checksum_ok = None
        if check and reduced:
            agree = (reduced[0].checksum == k * reduced[0].own_checksum).reshape(-1, 2).all(axis=1)
            checksum_ok = dict(zip(self._monitors, (bool(a) for a in agree), strict=True))
        return dict(zip(self._monitors, reduced, strict=True)), checksum_ok

    def _no_checksum(self) -> torch.Tensor:
        """The checksum digits of a step without a check: zeros, made once (packing copies them)."""
        zeros = getattr(self, "_zero_digits", None)
        if zeros is None or zeros.numel() != 2 * len(self._monitors):
            zeros = self._zero_digits = torch.zeros(2 * len(self._monitors), dtype=torch.float64, device=self.device)
        return zeros

    def telemetry_state(self) -> dict[str, Any]:
        """The persistent telemetry state (latches, prev values, counters) of every monitored module."""
        return {mid: monitor.tracker.state_dict() for mid, monitor in self._monitors.items()}

    def gradmon_state_digest(self) -> str:
        """SHA-256 of this learner's gradmon state (latches, prev values, counters, VGS, noise, probe)."""
        state = self.get_state(components=list(GRADMON_STATE_KEYS))
        return state_digest({k: v for k, v in state.items() if k in GRADMON_STATE_KEYS})

    @override(Learner)
    def get_state(self, components: Any = None, *, not_components: Any = None, **kwargs: Any) -> StateDict:
        state = super().get_state(components, not_components=not_components, **kwargs)
        for key, part in _STATE_PARTS.items():
            per_module = {
                mid: piece.state_dict()
                for mid, monitor in self._monitors.items()
                if (piece := monitor.parts()[part]) is not None
            }
            if per_module and compat.wants_component(self, key, components, not_components):
                state[key] = per_module
        return state

    @override(Learner)
    def restore_from_path(self, *args: Any, **kwargs: Any) -> None:
        super().restore_from_path(*args, **kwargs)
        self._movement.prime()  # the restored weights are the next step's start

    @override(Learner)
    def set_state(self, state: StateDict) -> None:
        """RLlib's ``set_state``, then each monitored module's gradmon state; a checkpoint of other
        modules than this learner monitors loads the modules both have (``module_changes.states_by_module``)."""
        super().set_state(state)
        self._movement.prime()
        by_key = states_by_module({key: state[key] for key in _STATE_PARTS if key in state}, self._monitors)
        for key, states in by_key.items():
            for mid, piece_state in states.items():
                piece = self._monitors[mid].parts()[_STATE_PARTS[key]]
                if piece is not None:
                    piece.load_state_dict(piece_state)
        align_clocks(self._monitors, loaded=by_key.get(TELEMETRY_STATE_KEY, {}))


_STATE_PARTS = {TELEMETRY_STATE_KEY: "telemetry", NOISE_STATE_KEY: "noise", VGS_STATE_KEY: "vgs"}
"""Learner state key -> the ``ModuleTelemetry.parts()`` entry it checkpoints, per module."""


def _local_segments(monitor: ModuleTelemetry) -> Segments:
    """The module's rank-local values riding the step's host copy (same layout on pack and unpack)."""
    empty = monitor.no_lanes
    return Segments(
        {
            "scaler": monitor.scaler_lanes if monitor.grad_scaler is not None else empty,
            "vgs": monitor.vgs.metrics_tensor() if monitor.vgs is not None else empty,
            "epoch_sum": monitor.epoch_sum_lanes,
        }
    )
