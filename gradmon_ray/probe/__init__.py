"""The gradient probe: non-destructive per-component, per-bucket gradient analysis."""

from gradmon_ray.probe.components import COMPONENTS, ComponentReport, component_gradients
from gradmon_ray.probe.regularizers import BUILTIN_REGULARIZERS, RegularizerSpec, resolve_regularizer

__all__ = [
    "BUILTIN_REGULARIZERS",
    "COMPONENTS",
    "ComponentReport",
    "RegularizerSpec",
    "component_gradients",
    "resolve_regularizer",
]
