"""The Variance Gradient Scaler: it CHANGES training (scales gradients), so it is not in ``telemetry/``.

``scaler`` holds the public class, ``kernels`` its per-step tensor updates, ``checkpoint`` and
``reporting`` its state and metrics halves.  ``gradmon_ray.telemetry.VarianceGradientScaler`` stays
as the documented public name (a re-export; this package imports nothing from ``telemetry``).
"""

from gradmon_ray.vgs.scaler import VarianceGradientScaler

__all__ = ["VarianceGradientScaler"]
