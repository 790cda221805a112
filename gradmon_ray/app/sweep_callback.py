"""``TrialProgress``: the Tune callback that prints a sweep's progress on the driver as results arrive."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray.tune import Callback

from gradmon_ray.app.sweep_progress import trial_progress_line
from gradmon_ray.telemetry.bands import DEFAULT_BANDS, BandSet


class TrialProgress(Callback):
    """One line per trial iteration (``trial_progress_line``), handed to ``out`` as Tune receives it.

    Tune calls ``on_trial_result`` on the driver for every ``tune.report`` of a trial, while the
    sweep runs; ``out`` prints and flushes (the CLI) or collects (tests).
    """

    def __init__(
        self,
        out: Callable[[str], Any],
        iterations: int,
        *,
        bands: BandSet = DEFAULT_BANDS,
        include_value_head: bool = False,
    ) -> None:
        self.out = out
        self.iterations = iterations
        self.bands = bands
        self.include_value_head = include_value_head

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        total = int((trial.config or {}).get("iterations", self.iterations))  # a sweep may vary it
        done = int(result.get("gradmon_iteration") or result.get("training_iteration") or 0)
        self.out(
            trial_progress_line(
                str(trial.trial_id),
                done,
                total,
                result,
                bands=self.bands,
                include_value_head=self.include_value_head,
                stop_reason=result.get("stop_reason_text"),
            )
        )

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.out(f"trial {trial.trial_id} failed; Tune restarts it from its last checkpoint (same MLflow run)")
