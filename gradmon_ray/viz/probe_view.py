"""The latest gradient probe as the panel, the report and the plots show it: per probed module, per
bucket, each component's gradient norm and signed share, and the iteration it was taken at.

A one-module run's probe has plain names (``grad_norm/bucket_1/task``) and shows as module None,
unlabelled; in a multi-module run each module's (``module/<id>/grad_norm/bucket_1/task``) is its
own table, labelled ``module <id>`` (``runs.probe_view`` reads the names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gradmon_ray import metric_parsing as mp

Table = dict[str, dict[str, float]]
"""``table[bucket][component]``."""


@dataclass
class ProbeView:
    """The latest probe of each module: ``norms[module][bucket][component]``, ``shares`` alike."""

    step: int | None
    """The latest probed iteration over the modules (None: no probe ran, or not looked up)."""
    norms: dict[str | None, Table] = field(default_factory=dict)
    shares: dict[str | None, Table] = field(default_factory=dict)
    steps: dict[str | None, int | None] = field(default_factory=dict)
    """Per module, the iteration of its own latest probe (a module not probed lately keeps its older one)."""

    @property
    def modules(self) -> list[str | None]:
        """The probed modules, None (a one-module run's plain names) first, then the ids sorted."""
        return sorted(self.norms, key=lambda m: (m is not None, m or ""))

    def module_buckets(self, module: str | None) -> list[str]:
        """``module``'s buckets in numeric order (``bucket_2`` before ``bucket_10``)."""
        return sorted(self.norms.get(module, {}), key=mp.bucket_index)

    def module_components(self, module: str | None) -> list[str]:
        """``module``'s components, in the order its buckets first name them."""
        seen: dict[str, None] = {}
        for bucket in self.module_buckets(module):
            seen.update(dict.fromkeys(self.norms[module][bucket]))
        return list(seen)

    @property
    def buckets(self) -> list[str]:
        """Every module's buckets, once each, in numeric order."""
        return sorted({b for table in self.norms.values() for b in table}, key=mp.bucket_index)

    @property
    def components(self) -> list[str]:
        """Every module's components, once each."""
        seen: dict[str, None] = {}
        for module in self.modules:
            seen.update(dict.fromkeys(self.module_components(module)))
        return list(seen)

    def cell(self, module: str | None, bucket: str, component: str) -> tuple[float | None, float | None]:
        """``(norm, share)`` of one module's bucket and component (None where not logged)."""
        norm = self.norms.get(module, {}).get(bucket, {}).get(component)
        return norm, self.shares.get(module, {}).get(bucket, {}).get(component)

    def label(self, module: str | None) -> str:
        """``iteration 4`` for a one-module run's probe, ``module p1, iteration 4`` for a module's."""
        step = self.steps.get(module, self.step)
        return ("" if module is None else f"module {module}, ") + f"iteration {step}"
