"""Runs by name: ``report``, ``watch --run-id`` and ``train --resume`` take a run's name where they
take its id, when only one run has it (``runs.run_by_id_or_name``)."""

from __future__ import annotations

import time
from typing import Any

SHOWN_CANDIDATES = 3
"""Runs an ambiguous name's error lists (ids and start times); the rest are counted."""


def runs_named(client: Any, name: str) -> list[Any]:
    """The runs of every active experiment whose name is exactly ``name``, newest first."""
    quote = next((q for q in ("'", '"') if q not in name), None)
    if quote is None:  # MLflow's filter strings have no escape for a name holding both quotes
        return []
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return []
    found = client.search_runs(
        experiments, f"attributes.run_name = {quote}{name}{quote}", order_by=["attributes.start_time DESC"]
    )
    return [run for run in found if run.info.run_name == name]  # exact, whatever the store's collation


def started(run: Any) -> str:
    """A run's start time, UTC, to the second."""
    stamp = run.info.start_time
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(stamp / 1000)) if stamp else "start unknown"


def candidates(runs: list[Any]) -> str:
    """``<id> (<start time>), ...`` for the first ``SHOWN_CANDIDATES`` runs, and how many more."""
    shown = ", ".join(f"{r.info.run_id} ({started(r)})" for r in runs[:SHOWN_CANDIDATES])
    return shown + (f" and {len(runs) - SHOWN_CANDIDATES} more" if len(runs) > SHOWN_CANDIDATES else "")
