"""The Variance Gradient Scaler: it CHANGES training (scales gradients), so it is not in ``telemetry/``.

``scaler`` holds the public class, ``kernels`` its per-step tensor updates, ``checkpoint`` and
``reporting`` its state and metrics halves.  ``gradmon_ray.vgs.VarianceGradientScaler`` is the
public name (``telemetry`` does not re-export it: it measures, this changes training).
"""

from gradmon_ray.vgs.scaler import VarianceGradientScaler

__all__ = ["VarianceGradientScaler"]
