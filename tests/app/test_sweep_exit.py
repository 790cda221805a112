"""``gradmon-ray tune``'s exit status: 0 only when every trial finished or was stopped by a health
rule; one failed trial makes it 1, with one line naming the failed trials (was: 0 when any trial
succeeded)."""

from __future__ import annotations

from gradmon_ray.app.cli_common import EXIT_FAILED, EXIT_OK
from gradmon_ray.app.sweep.command import sweep_exit
from gradmon_ray.app.sweep.run import TrialSummary


def _trial(trial_id: str, status: str, run_id: str | None = None) -> TrialSummary:
    return TrialSummary(
        trial_id=trial_id, status=status, run_id=run_id, iterations=1, metric=None, stop_reason=None, config={}
    )


def test_every_trial_finished_or_stopped_is_success():
    assert sweep_exit([_trial("a", "finished"), _trial("b", "stopped")]) == (EXIT_OK, None)


def test_one_failed_trial_fails_the_sweep_and_is_named():
    trials = [_trial("a", "finished", "r1"), _trial("b", "failed", "r2"), _trial("c", "failed")]
    assert sweep_exit(trials) == (EXIT_FAILED, "gradmon-ray: 2 of 3 trials failed: b (MLflow run r2), c")


def test_all_failed_is_a_failure():
    assert sweep_exit([_trial("a", "failed")])[0] == EXIT_FAILED
