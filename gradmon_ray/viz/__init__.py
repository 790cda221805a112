"""Seeing a run: the ``gradmon-ray watch`` terminal panel, PNG plots and the offline report.

Everything here reads what MLflow stored (``runs``), so the panel, the plots logged as
artifacts and ``gradmon-ray report`` all show the same numbers.
"""

from gradmon_ray.viz.runs import RunHistory, RunLookupError, RunSnapshot, load_history, resolve_run, snapshot

__all__ = ["RunHistory", "RunLookupError", "RunSnapshot", "load_history", "resolve_run", "snapshot"]
