"""The gradient probe: non-destructive per-component, per-bucket gradient analysis."""

from gradmon_ray.losses.regularizers import BUILTIN_REGULARIZERS, RegularizerSpec, resolve_regularizer
from gradmon_ray.probe.actor import GradientProbe, start_probe_actor
from gradmon_ray.probe.analysis import analyse_batch, episodes_from_batch
from gradmon_ray.probe.client import LossSettings, ModuleProbe, ProbeClient, ProbeOutcome, ProbeRequest
from gradmon_ray.probe.components import COMPONENTS, ComponentReport, component_gradients

__all__ = [
    "BUILTIN_REGULARIZERS",
    "COMPONENTS",
    "ComponentReport",
    "GradientProbe",
    "LossSettings",
    "ModuleProbe",
    "ProbeClient",
    "ProbeOutcome",
    "ProbeRequest",
    "RegularizerSpec",
    "analyse_batch",
    "component_gradients",
    "episodes_from_batch",
    "resolve_regularizer",
    "start_probe_actor",
]
